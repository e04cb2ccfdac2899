"""A config with an architecture feature the engine lacks stops the start-up with a one-line
reason naming it — never a silent approximation."""

import json

import pytest
from transformers import LlamaConfig, MixtralConfig, Phi3Config, Qwen2Config

from app.builder import app_from_args
from app.model.config import ModelConfig

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "hf, named",
    [
        (LlamaConfig(**SMALL, attention_bias=True), "attention_bias"),
        (LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias"),
        (
            LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "rope_type 'dynamic'",
        ),
        (LlamaConfig(**SMALL, hidden_act="gelu"), "hidden activation 'gelu'"),
        (MixtralConfig(**SMALL), "unsupported architecture 'mixtral'"),
        (Qwen2Config(**SMALL, num_experts=8), "mixture of experts"),
        (
            Phi3Config(
                **SMALL,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                    "original_max_position_embeddings": 64,
                },
                max_position_embeddings=256,
            ),
            "rope_type 'longrope'",
        ),
        (Phi3Config(**SMALL, partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_unsupported_config_is_refused_by_name(hf, named):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf(hf)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_tensor_parallel_refuses_families_with_extra_weights():
    from app.engine.tp.sharding import shard_config

    with pytest.raises(ValueError, match="qwen2"):
        shard_config(ModelConfig.from_hf(Qwen2Config(**SMALL)), 2)


def test_serve_run_path_refuses_the_checkpoint(tmp_path):
    """`serve run`'s build_app fails before any deployment starts, naming the feature."""
    (tmp_path / "config.json").write_text(json.dumps({**LlamaConfig(**SMALL, attention_bias=True).to_dict()}))
    with pytest.raises(ValueError) as err:
        app_from_args({"model": str(tmp_path)})
    assert "attention_bias=true on llama" in str(err.value) and "\n" not in str(err.value)
