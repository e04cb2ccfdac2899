import inspect
import os
import re

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))
# Serve's proxy has 5 s to report ready (three tries) before Serve gives up on it; on a 2-core machine
# under a CPU hog it missed that. Set before any Ray starts, so every Ray (and `serve run`) inherits it.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")

# The tiers are folders: tests/unit (no Ray; `slow` marks real checkpoints and kernel compiles),
# tests/serve (starts Ray or Ray Serve: marked `serve` here), tests/gpu (needs CUDA: skipped
# without it). tests/support holds what they share. The quick loop: `pytest tests/unit -m "not slow"`.
TIERS = ("unit", "serve", "gpu")

# A test in tests/unit that starts Ray (found in its source or its fixtures') fails at
# collection, so a new Serve test cannot slip into the quick loop.
_STARTS_RAY = re.compile(r"\b(serving|shared_serve|ray\.init|serve\.run|serve\.start|Cluster|deploy_replicas)\(")


def _starts_ray(item) -> bool:
    funcs = [item.function] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    for func in funcs:
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError):  # built-in fixtures
            continue
        if _STARTS_RAY.search(source):
            return True
    return False


def _tier(item) -> str:
    tier = item.path.parent.name
    if tier not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/{{{','.join(TIERS)}}}/")
    return tier


# Modules whose Ray differs from the session's shared one (tests/support/app_fixtures.py): workers with
# an S3 endpoint of their own in their environment, or a Ray of their own (`serve run`, a
# multi-node Cluster). They run last, so the other Serve modules share one Ray start.
_OWN_RAY_LAST = ("test_adapter_source_app.py", "test_app_s3.py", "test_app_serve_run.py", "test_config_change.py")
_OWN_RAY_LAST += ("test_node_loss.py", "test_app_serve_cli.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in _OWN_RAY_LAST)  # stable: the order within each group stays
    skip = (
        None
        if torch.cuda.is_available()
        else pytest.mark.skip(reason="needs a CUDA device (run on the device machine)")
    )
    for item in items:
        tier = _tier(item)
        if skip is not None and (tier == "gpu" or "gpu" in item.keywords):
            item.add_marker(skip)
        if tier == "serve":
            item.add_marker(pytest.mark.serve)
        elif tier == "unit" and isinstance(item, pytest.Function) and _starts_ray(item):
            raise pytest.UsageError(f"{item.nodeid} starts Ray: it belongs in tests/serve/")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.support.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir():
    from app.model.default import default_model_dir as find

    return find()


def pytest_sessionfinish(session, exitstatus):
    """The Ray the Serve modules shared (tests/support/app_fixtures.py) stops with the session."""
    import sys

    fixtures = sys.modules.get("tests.support.app_fixtures")
    if fixtures is not None:
        fixtures.release_shared()
