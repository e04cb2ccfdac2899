"""Tensor parallelism on 2 GPUs (NCCL, NVLink multicast off): a Llama-2-7B-shaped model
(7B widths and heads, 2 layers) in fp16/bf16, mixed-adapter batches against HF
transformers + PEFT with the single-GPU test's criterion (tests/gpu/test_engine_gpu.py)."""

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from tests.gpu.test_engine_gpu import ADAPTERS, check_mixed_batch_matches_peft
from tests.support.helpers import make_random_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
VOCAB = 32000


@pytest.fixture(scope="module")
def model_7b_shape(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        initializer_range=0.02,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    path = tmp_path_factory.mktemp("llama-7b-shape")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path, {
        n: make_random_adapter(path, path / "adapters" / n, seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tp2_engine_on_two_gpus_matches_peft(model_7b_shape, dtype):
    path, adapters = model_7b_shape
    cfg = EngineConfig(
        max_lora_rank=64, max_loras=4, num_kv_blocks=256, dtype=dtype, device="cuda", tensor_parallel_size=2
    )
    engine = build_engine(path, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None)
    try:
        assert engine.model.cfg.num_heads == 16  # each GPU holds half the heads
        check_mixed_batch_matches_peft(engine, path, adapters, dtype, vocab=VOCAB)
    finally:
        engine.model.shutdown()
