"""The application's arguments (`args:` in serve_config.yaml), validated once.

Pydantic lives only here, at the YAML boundary: `parse_args` turns the raw
dict into frozen dataclasses the deployments use, or raises ConfigError whose
message names every offending field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import jinja2
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from adapters_store.errors import AdapterUriError
from adapters_store.paths import parse_uri
from adapters_store.store import StoreConfig
from app.engine.config import EngineConfig
from app.engine.tp.placement import tensor_parallel_options
from app.serving.adapter_args import AdapterCacheArgs, store_config
from cluster.autoscaling import ray_autoscaling_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class ConfigError(ValueError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _kv_blocks(value):
    """num_kv_blocks: one message for a bad value (not one per member of the union)."""
    if value is None or value == "auto" or (type(value) is int and value >= 1):
        return value
    raise ValueError("an integer >= 1, or auto")


class ApiKeyArgs(_Strict):
    key: str = Field(min_length=8)
    adapters: list[str] | None = None  # adapters this key may use; None = all (the base model always)


class DeploymentArgs(_Strict):
    """Ray Serve options of one deployment (what `.options()` takes)."""

    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int | None = Field(None, ge=1)
    ray_actor_options: dict[str, Any] | None = None
    # A replica being replaced (a scale-down, a redeploy) is killed this long after it stopped taking
    # requests: sized for the longest generation, so a stream it relays or runs ends on its own.
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0)
    graceful_shutdown_wait_loop_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_scaling_mode(self):
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        return self

    def options(self, **defaults) -> dict[str, Any]:
        given = {k: v for k, v in self.model_dump().items() if v is not None}
        if "autoscaling_config" in given:
            defaults.pop("num_replicas", None)
        return {**defaults, **given}


class ClusterArgs(_Strict):
    """Routing and migration across LoraReplica replicas (cluster/)."""

    router: Literal["consolidating", "power_of_two"] = "consolidating"  # power_of_two: Ray Serve's default
    reserve_kv_blocks: int = Field(1, ge=0)  # free KV blocks a replica keeps beyond a new prompt's
    routing_stats_period_s: float = Field(0.5, gt=0)  # how often the router reads each replica's stats
    max_queued_requests: int = Field(1024, ge=-1)  # waiting for room beyond this → 503 (-1: unbounded)
    max_migrations: int = Field(8, ge=0)  # moves per request (migrations + failovers) before it fails
    failover_wait_s: float = Field(60.0, gt=0)  # how long a moved request waits for a replica to take it


class AppArgs(_Strict):
    model: str | None = None  # checkpoint dir, .gguf or s3://bucket/prefix/; None: the embedded SmolLM2-135M-Instruct
    model_name: str | None = None  # the base model's `model` id in the API
    # None: float32 on the CPU, bfloat16 on CUDA; float64: a CPU reference precision
    dtype: Literal["float32", "bfloat16", "float16", "float64"] | None = None
    quantization: Literal["fp8"] | None = None  # fp8 base projections, on sm_89+ GPUs (docs/models.md)
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    max_batch_size: int = Field(16, ge=1)
    max_tokens_per_step: int = Field(1024, ge=1)
    # KV cache per replica, in blocks; auto (the default on CUDA): what fits in gpu_memory_utilization of the GPU
    # (app/engine/kv_sizing.py); None: auto on CUDA, 512 on the CPU
    num_kv_blocks: Annotated[int | Literal["auto"] | None, BeforeValidator(_kv_blocks)] = None
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # auto KV: the share of the GPU's memory to fill
    block_size: int = Field(16, ge=1)
    max_loras: int = Field(8, ge=1)
    lora_memory_gb: float | None = Field(None, gt=0)  # GPU memory for adapter slots: overrides max_loras
    max_lora_rank: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs one replica's model is sharded over
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured at start-up (false: eager, for debugging)
    # the engine loop in a child process of each LoraReplica (docs/served_path.md); auto: on CUDA
    engine_process: Literal["auto"] | bool = "auto"
    # every kernel reduces in a batch-independent order: a request's tokens are the same alone, batched,
    # resumed or migrated (docs/configuration.md; app/engine/determinism.py)
    deterministic: bool = False
    prefix_caching: bool = True  # share full KV blocks of equal (adapter version, token prefix) across requests
    prefix_cache_max_blocks: int | None = Field(
        None, ge=0
    )  # unreferenced cached blocks kept at most; None: any free block
    adapter_dirs: list[str] = []
    adapter_roots: list[str] | None = None  # where registrations may point; None: adapter_dirs and s3://
    replica: DeploymentArgs = DeploymentArgs()
    ingress: DeploymentArgs = DeploymentArgs()
    cluster: ClusterArgs = ClusterArgs()
    api_keys: list[ApiKeyArgs] = []
    admin_key: str | None = Field(None, min_length=8)
    max_body_bytes: int = Field(4 * 2**20, ge=1024)  # a larger request body is refused with a 413
    registry_path: str | None = Field(
        None, min_length=1
    )  # local file or s3://bucket/key: runtime registrations persist
    adapter_source: str | None = Field(None, min_length=1)  # s3://bucket/prefix/ or a directory: names load on demand
    adapter_cache: AdapterCacheArgs = AdapterCacheArgs()  # host / disk tiers' budgets (app/serving/adapter_args.py)
    # how the model writes tool calls (vLLM's --tool-call-parser); auto: from its chat template, else its family
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # the chat template (vLLM's --chat-template): a file, or the Jinja text itself; None: the checkpoint's
    chat_template: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _dtype_for_the_device(self):
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        elif self.device != "cpu" and self.dtype not in ("float16", "bfloat16"):  # the CUDA kernels are half only
            raise ValueError(f"dtype {self.dtype} is not served on CUDA: use float16 or bfloat16")
        return self


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


def _describe(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"]) or "args"
        lines.append(f"  {field}: {e['msg']} (got {e.get('input')!r})")
    return "invalid serve_config.yaml args:\n" + "\n".join(lines)


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
        options["autoscaling_config"] = ray_autoscaling_config(options["autoscaling_config"])
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
        raise ConfigError(_describe(exc)) from None
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
