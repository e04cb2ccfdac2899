"""`build_app(args)`: the application serve_config.yaml names (`app.builder:build_app`).

Three deployments: Ingress (HTTP, OpenAI API) → LoraReplica (one engine each),
both reading AdapterRegistry. Replica count / autoscaling and Ray actor options
come from `args.replica` / `args.ingress` (a `deployments:` section in the YAML
still overrides them, as Serve does for any app).

`serve run app.builder:build_app key=value …` works too: Ray passes those arguments as text, typed
here as serve_config.yaml would type them (app/serving/cli_args.py). Ray's `serve build` takes no
builder arguments, so `python -m app.builder key=value … [-o FILE]` writes the equivalent
serve_config.yaml instead (validated first).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ray.serve import Application

from app.engine.factory import load_tokenizer
from app.model.default import DEFAULT_MODEL_NAME
from app.model.family import check_checkpoint
from app.openai.auth import check_bind, serve_bind_host
from app.openai.ingress import Ingress
from app.serving.cli_args import typed_args
from app.serving.config import AppArgs, ConfigError, parse_args
from app.serving.registry import AdapterRegistry, scan
from app.serving.replica import LoraReplica, ReplicaSettings, build_async_engine


def build_app(args: dict) -> Application:
    """Serve calls this with the YAML's `args`, or `serve run`'s key=value arguments (it must take
    exactly one parameter)."""
    return app_from_args(typed_args(args, AppArgs))


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


def config_yaml(args: dict) -> str:
    """serve_config.yaml for these `key=value` arguments (validated as `serve run` would): the
    application's args as typed, Serve's options as in the shipped serve_config.yaml."""
    import yaml

    typed = typed_args(args, AppArgs) or {}
    parse_args(typed, DEFAULT_MODEL_NAME)  # a bad value stops here, with the message `serve run` gives
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [
            {"name": "loraplex", "route_prefix": "/", "import_path": "app.builder:build_app", "args": typed}
        ],
    }
    return "# written by `python -m app.builder` (docs/deploy.md)\n" + yaml.safe_dump(config, sort_keys=False)


def main(argv: list[str]) -> int:
    """`python -m app.builder key=value … [-o FILE]`: what Ray's `serve build` would write, had it builder args."""
    out = None
    if "-o" in argv:
        i = argv.index("-o")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    bad = [a for a in argv if "=" not in a]
    if bad:
        print(f"arguments are key=value, got {bad[0]!r}", file=sys.stderr)
        return 2
    try:
        text = config_yaml(dict(a.split("=", 1) for a in argv))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if out is None:
        sys.stdout.write(text)
    else:
        with open(out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
