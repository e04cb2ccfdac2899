"""The serving app's pieces without Ray: YAML args, API keys, request validation."""

import pytest
import torch
import yaml
from pydantic import ValidationError

from app.errors import ContextLengthError
from app.openai.auth import Auth, AuthenticationError, PermissionDeniedError
from app.openai.requests import ChatCompletionRequest, CompletionRequest
from app.serving.config import ApiKey, ConfigError, parse_args
from tests.support.app_fixtures import REPO


def _yaml_args(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())["applications"][0]["args"]


def test_the_shipped_configs_parse():
    cpu = parse_args(_yaml_args("serve_config.yaml"), "base")
    assert cpu.engine.device == "cpu" and cpu.model_name == "base" and cpu.adapter_dirs
    assert cpu.replica_options["max_ongoing_requests"] > 5  # Serve's default would starve the batch
    gpu = parse_args(_yaml_args("serve_config_gpu.yaml"), "base")
    assert gpu.engine.device == "cuda" and gpu.engine.dtype == torch.bfloat16
    assert gpu.replica_options["ray_actor_options"]["num_gpus"] == 1
    assert "num_replicas" not in gpu.replica_options  # autoscaling instead


@pytest.mark.parametrize(
    "args, field",
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"num_kv_blocks": "many"}, "num_kv_blocks"),
        ({"max_batch": 8}, "max_batch"),  # a typo is an error, not silently ignored
        ({"replica": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}}}, "replica"),
        ({"api_keys": [{"key": "short"}]}, "api_keys.0.key"),
        ({"adapter_dirs": ["/no/such/dir"]}, "adapter_dirs.0"),
    ],
)
def test_bad_config_names_the_field(args, field):
    with pytest.raises(ConfigError) as err:
        parse_args(args, "base")
    assert f"  {field}:" in str(err.value)


def test_dtype_defaults_by_device_and_float32_is_refused_on_cuda():
    """The CUDA kernels are half only: float32 there would fail at the first LoRA add-on."""
    from app.engine.config import EngineConfig

    assert parse_args({}, "base").engine.dtype == torch.float32
    assert parse_args({"device": "cuda"}, "base").engine.dtype == torch.bfloat16
    for dtype in ("float32", "float64"):
        with pytest.raises(ConfigError, match=f"dtype {dtype} is not served on CUDA"):
            parse_args({"device": "cuda", "dtype": dtype}, "base")
    with pytest.raises(ValueError, match="not served on CUDA"):
        EngineConfig(device="cuda")


def test_keys_and_tenants():
    auth = Auth((ApiKey("sk-tenant-a-000", frozenset({"a"})), ApiKey("sk-everything", None)), "sk-the-admin")
    with pytest.raises(AuthenticationError):
        auth.caller(None)
    with pytest.raises(AuthenticationError):
        auth.caller("Bearer sk-wrong-000")
    tenant = auth.caller("Bearer sk-tenant-a-000")
    assert tenant.may_use("a") and not tenant.may_use("b") and not tenant.admin
    assert auth.caller("bearer sk-everything").may_use("b")
    with pytest.raises(PermissionDeniedError):
        auth.admin("Bearer sk-everything")
    auth.admin("Bearer sk-the-admin")


def test_without_keys_everything_is_open_and_an_admin_key_guards_admin_only():
    assert Auth((), None).caller(None).admin
    admin_only = Auth((), "sk-the-admin")
    assert admin_only.caller(None).may_use("any")
    with pytest.raises(PermissionDeniedError):
        admin_only.admin(None)


def test_sampling_defaults_and_limits():
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "developer", "content": "x"}]})
    assert chat.sampling(prompt_len=10, context_limit=100, default_max=None, logprobs=None).max_tokens == 90
    assert chat.chat() == [{"role": "system", "content": "x"}]
    both = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_tokens": 50,
            "max_completion_tokens": 7,
            "stop": "x",
            "logprobs": True,
        }
    )
    params = both.sampling(10, 100, None, both.engine_logprobs)
    assert (params.max_tokens, params.stop, params.logprobs) == (7, ("x",), 0)
    text = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2, 3]]})
    assert text.prompt == [1, 2, 3] and text.sampling(3, 100, 16, None).max_tokens == 16
    with pytest.raises(ContextLengthError):
        text.sampling(100, 100, 16, None)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "p", "n": 17},  # above MAX_CHOICES
        {"model": "m", "prompt": "p", "max_tokens": 1.0},
        {"model": "m", "prompt": "p", "stream": 1},
        {"model": "m", "prompt": "p", "frequency_penalty": 2.5},
        {"model": "", "prompt": "p"},
    ],
)
def test_unsupported_or_mistyped_fields_are_rejected(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_the_shipped_configs_keep_streams_and_registrations():
    """Durable registry, Ingress and proxy on the head node, graceful shutdown sized for long
    generations, replica counts as `deployments:` overrides (a light update; docs/faults.md)."""
    for name in ("serve_config.yaml", "serve_config_gpu.yaml"):
        config = yaml.safe_load((REPO / name).read_text())
        app = config["applications"][0]
        settings = parse_args(app["args"], "base")
        assert config["proxy_location"] == "HeadOnly"
        assert settings.registry_path == "~/.cache/loraplex/registry.json"
        assert settings.ingress_options["ray_actor_options"]["resources"] == {"node:__internal_head__": 0.001}
        for options in (settings.ingress_options, settings.replica_options):
            assert options["graceful_shutdown_timeout_s"] >= 600 and options["graceful_shutdown_wait_loop_s"] <= 1
        assert "Ingress" in {d["name"] for d in app["deployments"]}
    cpu = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]
    assert "num_replicas" not in cpu["args"]["replica"]
    assert {d["name"]: d["num_replicas"] for d in cpu["deployments"]} == {"LoraReplica": 1, "Ingress": 1}
    tight = parse_args({"replica": {"graceful_shutdown_timeout_s": 30}}, "base")
    assert tight.replica_options["graceful_shutdown_timeout_s"] == 30


def test_prefix_cache_keys_reach_the_engine():
    on = parse_args({}, "m").engine
    off = parse_args({"prefix_caching": False, "prefix_cache_max_blocks": 4}, "m").engine
    assert (on.prefix_caching, on.prefix_cache_max_blocks) == (True, None)
    assert (off.prefix_caching, off.prefix_cache_max_blocks) == (False, 4)
    with pytest.raises(ConfigError, match="prefix_cache_max_blocks"):
        parse_args({"prefix_cache_max_blocks": -1}, "m")
