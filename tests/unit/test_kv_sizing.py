"""The KV sizing rule (app/engine/kv_sizing.py): per-block bytes as the engine allocates them for MHA,
GQA and sliding-window families and tensor-parallel shards; auto sizing within the utilization; an
explicit number that cannot fit refused with the largest that would."""

import pytest
import torch

from app.engine.kv_cache import allocate_kv
from app.engine.kv_sizing import GB, KvCacheError, fitting_blocks, kv_block_bytes, plan_kv
from app.model.config import ModelConfig
from tests.support.family_fixtures import FAMILIES

MIB = 2**20
# (layers, KV heads, head_dim) of the shapes the GPU configs are measured with
LLAMA2_7B, LLAMA3_8B, QWEN25_7B = (32, 32, 128), (32, 8, 128), (28, 4, 128)
H100, H200 = int(79.1 * GB), int(139.8 * GB)


def _bytes(shape, tp=1):
    layers, kv_heads, head_dim = shape
    return kv_block_bytes(layers, 16, kv_heads, head_dim, 2, tp)


def test_block_bytes_of_the_measured_shapes():
    assert _bytes(LLAMA2_7B) == 8 * MIB  # MHA: 32 KV heads
    assert _bytes(LLAMA3_8B) == 2 * MIB  # GQA: 8
    assert _bytes(QWEN25_7B) == 28 * 2 * 16 * 4 * 128 * 2
    assert _bytes(LLAMA3_8B, tp=2) == MIB  # each GPU holds half the KV heads
    with pytest.raises(KvCacheError, match="does not divide"):
        _bytes(QWEN25_7B, tp=8)


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_block_bytes_are_what_the_engine_allocates(family, tmp_path):
    """Sliding-window families (Mistral, Gemma, Phi-3) keep every layer's KV in the shared block
    table, so a block costs what it costs for full attention: the rule and allocate_kv agree."""
    from transformers import AutoConfig

    from tests.support.family_fixtures import make_family_checkpoint
    from tests.support.helpers import make_tiny_llama

    path = make_tiny_llama(tmp_path) if family == "llama" else make_family_checkpoint(family, tmp_path)[0]
    c = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))
    kv = allocate_kv(c.num_layers, 3, 4, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu")
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
    assert allocated == 3 * kv_block_bytes(c.num_layers, 4, c.num_kv_heads, c.head_dim, 2)


def test_auto_takes_the_utilization_share_of_what_is_left():
    used, workspace, bb = int(14.5 * GB), 2 * GB, 8 * MIB
    plan = plan_kv(None, total=H100, used=used, workspace=workspace, utilization=0.9, block_bytes=bb, block_size=16)
    assert plan.mode == "auto"
    assert plan.blocks == (int(0.9 * H100) - used - workspace) // bb
    assert plan.bytes <= 0.9 * H100 - used - workspace < plan.bytes + bb
    assert plan.tokens == 16 * plan.blocks
    assert plan.largest == (H100 - used - workspace) // bb > plan.blocks  # 1.0 leaves nothing spare
    assert plan.as_dict()["gb"] == round(plan.bytes / GB, 3)
    assert f"{plan.blocks} blocks" in plan.describe() and "workspace" in plan.describe()


def test_explicit_numbers_fit_or_are_refused_with_the_largest():
    """The shipped 8192 blocks of a Llama-2-7B shape (64 GiB of KV) do not fit an H100 80 GB beside
    its 13.5 GB of weights; they fit an H200."""
    used, workspace, bb = int(14.5 * GB), 2 * GB, _bytes(LLAMA2_7B)
    fits = plan_kv(8192, total=H200, used=used, workspace=workspace, utilization=0.9, block_bytes=bb, block_size=16)
    assert (fits.blocks, fits.mode) == (8192, "explicit")
    largest = (H100 - used - workspace) // bb
    with pytest.raises(KvCacheError, match=f"the largest that fits is {largest} ") as refused:
        plan_kv(8192, total=H100, used=used, workspace=workspace, utilization=0.9, block_bytes=bb, block_size=16)
    assert "\n" not in str(refused.value) and "auto" in str(refused.value)
    at_edge = plan_kv(
        largest, total=H100, used=used, workspace=workspace, utilization=0.9, block_bytes=bb, block_size=16
    )
    assert at_edge.blocks == largest  # explicit numbers may use the whole device, not only the utilization


def test_auto_refuses_a_cache_shorter_than_one_request():
    with pytest.raises(KvCacheError, match="max_model_len needs 8192"):
        plan_kv(
            None,
            total=24 * GB,
            used=16 * GB,
            workspace=GB,
            utilization=0.9,
            block_bytes=8 * MIB,
            block_size=16,
            min_blocks=8192,
        )


def test_cpu_plans_are_the_number_given():
    plan = plan_kv(512, total=0, used=0, workspace=0, utilization=0.9, block_bytes=1024, block_size=16)
    assert plan.blocks == 512 and plan.describe().endswith("GB")


def test_fitting_blocks_bounds():
    assert fitting_blocks(10 * GB, 11 * GB, 0, 0.9, MIB) == 0  # nothing left is zero, not negative
    for bad in (0, 1.01, -0.5):
        with pytest.raises(KvCacheError, match="gpu_memory_utilization"):
            fitting_blocks(GB, 0, 0, bad, MIB)
