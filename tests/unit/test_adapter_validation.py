"""Bad PEFT adapters are rejected with a clear InvalidAdapterError; nothing is unpickled."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from app.errors import AdapterNotFoundError, InvalidAdapterError
from app.model.config import ModelConfig
from tests.support.helpers import make_random_adapter
from tests.support.store_helpers import load_local


@pytest.fixture(scope="module")
def good(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(
        tiny_model_dir, tmp_path_factory.mktemp("good") / "a", rank=4, targets=["q_proj", "up_proj"]
    )


@pytest.fixture(scope="module")
def shape(tiny_model_dir):
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir)).shape


def _copy(good, tmp_path, edit_config=None):
    d = tmp_path / "bad"
    shutil.copytree(good, d)
    if edit_config:
        cfg = json.loads((d / "adapter_config.json").read_text())
        edit_config(cfg)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def test_good_adapter_loads(good, shape):
    w = load_local("a", good, 16, shape)
    assert w.manifest.rank == 4 and len(w.version) == 16
    assert {m for _, m in w.tensors} == {"q_proj", "up_proj"}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(r=32), "exceeds the configured max_lora_rank"),
        (lambda c: c.update(target_modules=["q_proj", "lm_head"]), "unknown target modules"),
        (lambda c: c.update(use_dora=True), "DoRA"),
        (lambda c: c.update(bias="all"), "bias"),
        (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda c: c.update(r="8"), "positive integer"),
        (lambda c: c.update(target_modules=["k_proj"]), "not listed in target_modules"),
    ],
)
def test_bad_config(good, shape, tmp_path, edit, message):
    with pytest.raises(InvalidAdapterError, match=message):
        load_local("a", _copy(good, tmp_path, edit), 16, shape)


def test_shape_mismatch_and_rank_mismatch(good, shape, tmp_path):
    d = _copy(good, tmp_path)
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 99),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4),
        },
        str(d / "adapter_model.safetensors"),
    )
    with pytest.raises(InvalidAdapterError, match="do not fit the base model"):
        load_local("a", d, 16, shape)


def test_missing_half_of_a_pair(good, shape, tmp_path):
    d = _copy(good, tmp_path)
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64)},
        str(d / "adapter_model.safetensors"),
    )
    with pytest.raises(InvalidAdapterError, match="missing lora_B"):
        load_local("a", d, 16, shape)


def test_corrupt_and_missing_files(good, shape, tmp_path):
    d = _copy(good, tmp_path)
    (d / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InvalidAdapterError, match="corrupt"):
        load_local("a", d, 16, shape)
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidAdapterError, match="not valid JSON"):
        load_local("a", d, 16, shape)
    (d / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapterError, match="missing adapter_config.json"):
        load_local("a", d, 16, shape)
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        load_local("a", tmp_path / "nowhere", 16, shape)


def test_pickle_bin_is_never_loaded(good, shape, tmp_path):
    d = _copy(good, tmp_path)
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")  # a malicious pickle
    with pytest.raises(InvalidAdapterError, match="never loaded"):
        load_local("a", d, 16, shape)
