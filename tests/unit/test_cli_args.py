"""`serve run app.builder:build_app key=value …`: Ray's builder arguments (all text) typed and
validated as serve_config.yaml's `args:` are, with the YAML's messages; num_kv_blocks' defaults;
`python -m app.builder` writes the equivalent YAML."""

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from app.builder import build_app, config_yaml, main
from app.serving.cli_args import typed_args
from app.serving.config import AppArgs, ConfigError, parse_args
from tests.support.app_fixtures import REPO

NAME = "SmolLM2-135M-Instruct"
# the command line, as Ray's convert_args_to_dict hands it over
CLI = {"model": "null", "device": "cpu", "max_batch_size": "8", "adapter_dirs": str(REPO / "examples/adapters")}
YAML = {"model": None, "device": "cpu", "max_batch_size": 8, "adapter_dirs": [str(REPO / "examples/adapters")]}


def _message(raw) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_args(typed_args(raw, AppArgs), NAME)
    return str(refused.value)


def test_cli_arguments_give_the_settings_yaml_gives():
    assert typed_args(CLI, AppArgs) == YAML
    assert parse_args(typed_args(CLI, AppArgs), NAME) == parse_args(YAML, NAME)


def test_every_kind_of_field_reads_as_its_yaml_value():
    cli = {
        "num_kv_blocks": "auto",
        "gpu_memory_utilization": "0.85",
        "cuda_graphs": "false",
        "dtype": "bfloat16",
        "adapter_dirs": "a,b",
        "admin_key": "12345678",  # a text field keeps digits as text
        "model_name": "null",
        "api_keys": "[{key: sk-abcdefgh, adapters: [pirate]}]",
        "replica.num_replicas": "2",
        "replica.ray_actor_options": "{num_gpus: 1}",
        "replica.autoscaling_config.max_replicas": "4",
        "cluster.router": "power_of_two",
        "adapter_cache.host_gb": "2",
    }
    assert typed_args(cli, AppArgs) == {
        "num_kv_blocks": "auto",
        "gpu_memory_utilization": 0.85,
        "cuda_graphs": False,
        "dtype": "bfloat16",
        "adapter_dirs": ["a", "b"],
        "admin_key": "12345678",
        "model_name": None,
        "api_keys": [{"key": "sk-abcdefgh", "adapters": ["pirate"]}],
        "replica": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1}, "autoscaling_config": {"max_replicas": 4}},
        "cluster": {"router": "power_of_two"},
        "adapter_cache": {"host_gb": 2},
    }
    assert typed_args({"adapter_dirs": "[x, y]"}, AppArgs) == {"adapter_dirs": ["x", "y"]}


@pytest.mark.parametrize(
    ("cli", "yaml_args"),
    [
        ({"max_batch_size": "0"}, {"max_batch_size": 0}),
        ({"max_batch_size": "eight"}, {"max_batch_size": "eight"}),
        ({"num_kv_blocks": "many"}, {"num_kv_blocks": "many"}),
        ({"gpu_memory_utilization": "1.5"}, {"gpu_memory_utilization": 1.5}),
        ({"cuda_graphs": "maybe"}, {"cuda_graphs": "maybe"}),
        ({"max_batch_szie": "8"}, {"max_batch_szie": 8}),
        ({"device": "tpu"}, {"device": "tpu"}),
    ],
)
def test_a_bad_value_gets_the_yaml_message(cli, yaml_args):
    assert _message(cli) == _message(yaml_args)
    assert _message(cli).startswith("invalid serve_config.yaml args:\n  ")


def test_rays_builder_call_refuses_bad_text_with_the_yaml_message():
    """What `serve run app.builder:build_app max_batch_size=0` does before any cluster starts."""
    with pytest.raises(ConfigError) as refused:
        call_user_app_builder_with_args_if_necessary(build_app, {"max_batch_size": "0"})
    assert str(refused.value) == _message({"max_batch_size": 0})


def test_a_yaml_dict_stays_strict():
    """A dict with typed values is a YAML file's: quoted numbers there stay refused."""
    assert typed_args({"max_batch_size": "8", "adapter_dirs": []}, AppArgs) == {
        "max_batch_size": "8",
        "adapter_dirs": [],
    }
    assert "max_batch_size: Input should be a valid integer" in _message({"max_batch_size": "8", "adapter_dirs": []})


def test_num_kv_blocks_defaults_auto_on_cuda_and_512_on_the_cpu():
    assert parse_args({}, NAME).engine.num_kv_blocks == 512
    cuda = parse_args({"device": "cuda"}, NAME).engine
    assert cuda.num_kv_blocks is None and cuda.gpu_memory_utilization == 0.9
    assert parse_args({"device": "cuda", "num_kv_blocks": "auto"}, NAME).engine.num_kv_blocks is None
    assert parse_args({"device": "cuda", "num_kv_blocks": 4096}, NAME).engine.num_kv_blocks == 4096
    assert "num_kv_blocks: auto sizes the KV cache from a GPU" in _message({"num_kv_blocks": "auto"})
    tp = {"device": "cuda", "tensor_parallel_size": 2}
    assert "num_kv_blocks: give a number with tensor_parallel_size > 1" in _message(tp)
    assert parse_args({**tp, "num_kv_blocks": 1024}, NAME).engine.num_kv_blocks == 1024


def test_the_equivalent_yaml_deploys_the_same_args(tmp_path, capsys):
    text = config_yaml(CLI)
    app = yaml.safe_load(text)["applications"][0]
    assert app["import_path"] == "app.builder:build_app" and app["args"] == YAML
    out = tmp_path / "serve_config.yaml"
    assert main([f"{k}={v}" for k, v in CLI.items()] + ["-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load(text)
    assert main(["max_batch_size=0"]) == 1
    assert capsys.readouterr().err.strip() == _message({"max_batch_size": 0})
