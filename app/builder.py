"""`build_app(args)`: the application serve_config.yaml names (`app.builder:build_app`).

Three deployments: Ingress (HTTP, OpenAI API) → LoraReplica (one engine each),
both reading AdapterRegistry. Replica count / autoscaling and Ray actor options
come from `args.replica` / `args.ingress` (a `deployments:` section in the YAML
still overrides them, as Serve does for any app).
"""

from __future__ import annotations

from collections.abc import Callable

from ray.serve import Application

from app.engine.factory import load_tokenizer
from app.model.default import DEFAULT_MODEL_NAME
from app.model.family import check_checkpoint
from app.openai.auth import check_bind, serve_bind_host
from app.openai.ingress import Ingress
from app.serving.config import parse_args
from app.serving.registry import AdapterRegistry, scan
from app.serving.replica import LoraReplica, ReplicaSettings, build_async_engine


def build_app(args: dict) -> Application:
    """Serve calls this with the YAML's `args` (it must take exactly one parameter)."""
    return app_from_args(args)


def app_from_args(
    args: dict | None, engine_factory: Callable = build_async_engine, tokenizer_loader: Callable = load_tokenizer
) -> Application:
    """engine_factory(ReplicaSettings) → AsyncEngine, tokenizer_loader(path) → the Ingress's
    tokenizer: the seams tests use to swap the engine and to observe a tokenization."""
    settings = parse_args(args, DEFAULT_MODEL_NAME)
    check_bind(serve_bind_host(), settings.admin_key)  # `serve run`/`serve deploy`: Serve is up by now
    if settings.model is None:
        _warm_default_model()
    else:
        check_checkpoint(settings.model)  # an architecture feature the engine lacks stops `serve run` here
    adapters = tuple(scan(settings.adapter_dirs))
    registry = AdapterRegistry.bind(list(adapters), settings.registry_path, settings.adapter_store.default_root)
    replica = LoraReplica.options(**settings.replica_options).bind(
        ReplicaSettings(
            settings.model, settings.engine, adapters, _single_replica(settings.replica_options), settings.adapter_store
        ),
        registry,
        engine_factory,
    )
    return Ingress.options(**settings.ingress_options).bind(settings, replica, registry, tokenizer_loader)


def _single_replica(options: dict) -> bool:
    """A preempted request can only re-queue where it is; with several (or autoscaled)
    replicas it moves to another one (app/openai/client_stream.py)."""
    return options.get("num_replicas") == 1 and "autoscaling_config" not in options


def _warm_default_model() -> None:
    """Convert the embedded model once here, before ingress and replicas start: otherwise
    each would convert it at the same time on a fresh machine."""
    from app.model.default import default_model_dir

    default_model_dir()
