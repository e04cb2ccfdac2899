"""The schema of the application's arguments (`args:` in serve_config.yaml, or `key=value` on
`serve run`): pydantic models, strict, unknown keys refused.

Pydantic lives only at this boundary: app/serving/config.py validates against these models and
maps the result onto the components' frozen configs; `describe` turns a ValidationError into one
ConfigError message naming every offending field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from app.serving.adapter_args import AdapterCacheArgs


class ConfigError(ValueError):
    """Invalid application arguments; the message names every offending field."""


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


def describe(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"]) or "args"
        lines.append(f"  {field}: {e['msg']} (got {e.get('input')!r})")
    return "invalid serve_config.yaml args:\n" + "\n".join(lines)
