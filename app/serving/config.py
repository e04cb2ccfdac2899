"""The application's arguments resolved into what the deployments use: `parse_args` validates
the raw `args:` dict against the schema (app/serving/config_schema.py), then maps it onto frozen
dataclasses (EngineConfig, StoreConfig, Settings, Serve options), or raises ConfigError whose
message names every offending field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch
from pydantic import ValidationError

from adapters_store.errors import AdapterUriError
from adapters_store.paths import parse_uri
from adapters_store.store_config import StoreConfig
from app.engine.config import EngineConfig
from app.engine.tp.placement import tensor_parallel_options
from app.serving.adapter_args import store_config
from app.serving.config_schema import AppArgs, ClusterArgs, ConfigError, DeploymentArgs, describe
from cluster.autoscaling import ray_autoscaling_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class ApiKey:
    key: str
    adapters: frozenset[str] | None  # None = every adapter


@dataclass(frozen=True)
class Settings:
    """Everything the deployments need, resolved from AppArgs."""

    model: str | None
    model_name: str
    engine: EngineConfig
    adapter_dirs: tuple[str, ...]
    api_keys: tuple[ApiKey, ...]
    admin_key: str | None
    replica_options: dict
    ingress_options: dict
    max_body_bytes: int = 4 * 2**20
    registry_path: str | None = None
    max_migrations: int = 8
    failover_wait_s: float = 60.0
    adapter_roots: tuple[str, ...] = ("s3://",)
    adapter_store: StoreConfig = StoreConfig()  # tiers and on-demand source (its default_root)
    tool_parser: str = "auto"  # docs/tool_calling.md
    chat_template: str | None = None  # the template's text (the arg's file read here); None: the checkpoint's


# Long enough for a max_model_len generation at a slow decode (8192 tokens at 70 ms); Serve's own default
# (20 s) cut streams that an Ingress or LoraReplica being replaced was still serving.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 600.0
# How often a stopping replica checks that it has emptied: each deployment Serve stops waits at least
# this once, and Ctrl-C on `serve run` stops them one after another (issue 46: within 10 s).
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2
_GRACEFUL = {
    "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
    "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
}


def _adapter_roots(roots: list[str] | None, dirs: tuple[str, ...], source: str | None) -> tuple[str, ...]:
    """Local roots resolved (symlinks followed) like adapter_dirs; s3:// prefixes as given. The default:
    every adapter_dir, a local adapter_source, and any s3:// location the replicas' credentials reach."""
    if roots is None:
        local_source = _adapter_dirs([source], "adapter_source") if source and not source.startswith("s3://") else ()
        return (*dirs, *local_source, "s3://")
    local = [r for r in roots if not r.startswith("s3://")]
    resolved = iter(_adapter_dirs(local, "adapter_roots"))
    return tuple(r if r.startswith("s3://") else next(resolved) for r in roots)


def _adapter_dirs(dirs: list[str], field: str = "adapter_dirs") -> tuple[str, ...]:
    resolved = []
    for i, d in enumerate(dirs):
        path = Path(d).expanduser().resolve()  # relative to where `serve run` was started
        if not path.is_dir():
            raise ConfigError(f"invalid serve_config.yaml args:\n  {field}.{i}: no directory {str(path)!r}")
        resolved.append(str(path))
    return tuple(resolved)


_PROJECT = Path(__file__).resolve().parents[2]


def _chat_template(value: str | None) -> str | None:
    """The template's text: Jinja given inline (it holds a tag), else a file, relative to where
    `serve run` was started or else to the project (the shipped app/openai/templates/)."""
    if value is None:
        return None
    text = value if "{{" in value or "{%" in value else None
    for path in () if text else (Path(value).expanduser(), _PROJECT / value):
        if path.is_file():
            text = path.read_text()
            break
    if text is None:
        raise ConfigError(f"invalid serve_config.yaml args:\n  chat_template: no file {value!r} (nor Jinja text)")
    try:  # a syntax error stops `serve run` here, not every chat request later
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        if "generation" not in str(exc):  # transformers' own {% generation %} tag parses there
            raise ConfigError(f"invalid serve_config.yaml args:\n  chat_template: {exc} (line {exc.lineno})") from None
    return text


def _check_model(model: str | None) -> None:
    """An s3:// model's URI is checked here; the checkpoint itself where it is loaded (app/model/source.py)."""
    if model and model.startswith("s3://"):
        try:
            parse_uri(model)
        except AdapterUriError as exc:
            raise ConfigError(f"invalid serve_config.yaml args:\n  model: {exc}") from None


def cluster_options(c: ClusterArgs, engine: EngineConfig) -> dict:
    """The consolidating router (cluster/router.py) and its queue bound, as Serve options."""
    router = {
        "request_router_class": "cluster.router:ConsolidatingRouter",
        "request_router_kwargs": {
            "reserve_blocks": c.reserve_kv_blocks,
            "max_batch": engine.max_num_seqs,
            "block_size": engine.block_size,
        },
        "request_routing_stats_period_s": c.routing_stats_period_s,
        # a request waiting for room is retried every 10 → 50 ms (Serve's default backs off to 0.5 s);
        # the one place the backoff is set
        "initial_backoff_s": 0.01,
        "max_backoff_s": 0.05,
    }
    if c.router == "power_of_two":
        router = {"request_routing_stats_period_s": c.routing_stats_period_s}
    return {"max_queued_requests": c.max_queued_requests, "request_router_config": router}


# LoraReplica's code runs on Serve's own event loop, not a thread of its own: Serve then takes
# a stream's next item only once it has sent the previous one, and the stream hands over all
# it accumulated meanwhile as one item (app/engine/async_engine.py). On a separate thread the
# generator is drained at once, one token per item, however far behind the path is
# (docs/served_path.md: 2.3x the tokens/s delivered to 64 clients on 2 cores).
_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def _replica_options(replica: DeploymentArgs, max_ongoing: int, cluster: ClusterArgs, engine: EngineConfig) -> dict:
    """LoraReplica's Serve options; an autoscaling config gets the consolidation-aware
    policy unless it names its own (cluster/autoscaling.py)."""
    options = replica.options(num_replicas=1, max_ongoing_requests=max_ongoing, **_GRACEFUL)
    options.update(cluster_options(cluster, engine))
    actor = dict(options.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**_REPLICA_ENV, **(runtime_env.get("env_vars") or {})}
    options["ray_actor_options"] = {**actor, "runtime_env": runtime_env}
    if "autoscaling_config" in options:
        options["autoscaling_config"] = ray_autoscaling_config(options["autoscaling_config"], engine.max_num_seqs)
    return options


# Overrides `engine_process: auto` (a test run of the suite with, or without, the engine process).
ENGINE_PROCESS_ENV = "LORAPLEX_ENGINE_PROCESS"


def _engine_process(given: str | bool, device: str, tensor_parallel_size: int) -> bool:
    """auto: in its own process on CUDA, in the replica's on the CPU (docs/served_path.md measures both)."""
    if given == "auto":
        forced = os.environ.get(ENGINE_PROCESS_ENV)
        given = forced == "1" if forced in ("0", "1") else device != "cpu"
        if tensor_parallel_size > 1:
            return False
    if given and tensor_parallel_size > 1:  # its shard workers are Ray actors the replica creates
        raise ConfigError(
            "invalid serve_config.yaml args:\n  engine_process: not available with tensor_parallel_size > 1 "
            "(the shard workers are driven from the replica's process)"
        )
    return given


CPU_KV_BLOCKS = 512  # the CPU's default: nothing to measure there


def _num_kv_blocks(given: int | str | None, device: str, tensor_parallel_size: int) -> int | None:
    """The engine's num_kv_blocks: a number, or None for auto (one GPU only: the probe measures one)."""
    if isinstance(given, int):
        return given
    if device == "cpu":
        if given == "auto":
            raise ConfigError(
                "invalid serve_config.yaml args:\n  num_kv_blocks: auto sizes the KV cache from a GPU's memory; "
                "on the CPU give a number"
            )
        return CPU_KV_BLOCKS
    if tensor_parallel_size > 1:
        raise ConfigError(
            "invalid serve_config.yaml args:\n  num_kv_blocks: give a number with tensor_parallel_size > 1 "
            "(auto measures one GPU; docs/deploy.md has the formula)"
        )
    return None


def _engine_config(a: AppArgs) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=a.max_batch_size,
        max_tokens_per_step=a.max_tokens_per_step,
        num_kv_blocks=_num_kv_blocks(a.num_kv_blocks, a.device, a.tensor_parallel_size),
        gpu_memory_utilization=a.gpu_memory_utilization,
        block_size=a.block_size,
        max_loras=a.max_loras,
        max_lora_rank=a.max_lora_rank,
        dtype=_DTYPES[a.dtype],
        lora_memory_bytes=None if a.lora_memory_gb is None else int(a.lora_memory_gb * 2**30),
        device=a.device,
        max_model_len=a.max_model_len,
        tensor_parallel_size=a.tensor_parallel_size,
        cuda_graphs=a.cuda_graphs,
        prefix_caching=a.prefix_caching,
        prefix_cache_max_blocks=a.prefix_cache_max_blocks,
        quantization=a.quantization,
        engine_process=_engine_process(a.engine_process, a.device, a.tensor_parallel_size),
        deterministic=a.deterministic,
    )


def parse_args(raw: dict | None, default_model_name: str) -> Settings:
    try:
        a = AppArgs.model_validate(raw or {})
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None
    _check_model(a.model)
    try:
        engine = _engine_config(a)
    except ConfigError:
        raise
    except ValueError as exc:  # a combination the engine refuses (e.g. deterministic with fp8)
        raise ConfigError(f"invalid serve_config.yaml args:\n  {exc}") from None
    try:
        adapter_store = store_config(a.adapter_cache, a.adapter_source, a.max_lora_rank)
    except ValueError as exc:
        raise ConfigError(f"invalid serve_config.yaml args:\n  {exc}") from None
    name = a.model_name or (Path(a.model).name if a.model else default_model_name)
    dirs = _adapter_dirs(a.adapter_dirs)
    keys = tuple(ApiKey(k.key, frozenset(k.adapters) if k.adapters is not None else None) for k in a.api_keys)
    return Settings(
        model=a.model,
        model_name=name,
        engine=engine,
        adapter_dirs=dirs,
        api_keys=keys,
        admin_key=a.admin_key,
        # The engine batches many requests: Serve's default of 5 in flight per replica would starve it.
        replica_options=tensor_parallel_options(
            _replica_options(a.replica, 4 * a.max_batch_size, a.cluster, engine), a.tensor_parallel_size, a.device
        ),
        ingress_options=a.ingress.options(num_replicas=1, max_ongoing_requests=1024, **_GRACEFUL),
        max_body_bytes=a.max_body_bytes,
        registry_path=a.registry_path,
        max_migrations=a.cluster.max_migrations,
        failover_wait_s=a.cluster.failover_wait_s,
        adapter_roots=_adapter_roots(a.adapter_roots, dirs, a.adapter_source),
        adapter_store=adapter_store,
        tool_parser=a.tool_parser,
        chat_template=_chat_template(a.chat_template),
    )
