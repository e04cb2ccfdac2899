"""`deterministic: true` (app/engine/determinism.py): the paths are a pure function of the config,
the replica reports them, combinations without a fixed-order path are refused, and on the CPU
the fixed paths give a request the same bits alone, in a batch and resumed after a migration."""

import dataclasses

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.determinism import model_refusal, paths_for
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from app.serving.config import ConfigError, parse_args
from ops import fixed_order
from ops.fixed_attention import as_decode_rows, rows_forward
from ops.fixed_gemm import linear
from ops.paged_attention import PrefillRows
from tests.support.helpers import make_random_adapter


def test_the_paths_are_a_pure_function_of_the_config():
    on, off = EngineConfig(deterministic=True), EngineConfig()
    assert paths_for(on) == paths_for(EngineConfig(deterministic=True)) == fixed_order.fixed("cpu")
    assert paths_for(on).deterministic and paths_for(on).as_dict()["gemm"] == "row_tiles"
    assert paths_for(off) == fixed_order.LIBRARY and not paths_for(off).deterministic
    # nothing but the config decides: no batch, no device state (a CUDA config, read on a CPU machine)
    gpu = EngineConfig(device="cuda", dtype=torch.bfloat16, deterministic=True)
    assert paths_for(gpu).gemm_tile_rows == fixed_order.GEMM_TILE_ROWS["cuda"]
    assert paths_for(dataclasses.replace(gpu, max_num_seqs=64)) == paths_for(gpu)
    # the decode kernel's head layouts only, on CUDA; the CPU's torch path serves any
    assert model_refusal(gpu, torch.bfloat16, 80, 32, 8) is not None
    assert model_refusal(gpu, torch.bfloat16, 128, 32, 8) is None
    assert model_refusal(on, torch.float32, 80, 32, 8) is None


@pytest.mark.parametrize(
    "extra, named",
    [({"quantization": "fp8"}, "quantization"), ({"tensor_parallel_size": 2}, "tensor_parallel_size")],
)
def test_what_has_no_fixed_order_path_is_refused(extra, named):
    with pytest.raises(ValueError, match=f"deterministic: not with {named}"):
        EngineConfig(deterministic=True, **extra)
    with pytest.raises(ValueError, match="deterministic: not with mixed_graph_tokens"):
        EngineConfig(deterministic=True, mixed_graph_tokens=64)
    args = {"deterministic": True, "device": "cuda:0", "num_kv_blocks": 64, **extra}
    with pytest.raises(ConfigError) as err:
        parse_args(args, "m")
    assert f"deterministic: not with {named}" in str(err.value) and "Traceback" not in str(err.value)
    assert parse_args({"deterministic": True}, "m").engine.deterministic
    assert parse_args({"deterministic": True, "dtype": "float64"}, "m").engine.dtype == torch.float64
    assert not parse_args({}, "m").engine.deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fixed_gemm_rows_do_not_depend_on_the_rows_beside_them(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 96, generator=g, dtype=dtype), torch.randn(80, 96, generator=g, dtype=dtype)
    with fixed_order.using(fixed_order.fixed("cpu")):
        full = linear(x, w)
        for rows in ([5], [0, 1, 2], list(range(36, 3, -1)), list(range(20))):
            assert torch.equal(linear(x[rows], w), full[rows])
    assert fixed_order.current() == fixed_order.LIBRARY  # the block ended: the default again


def test_fixed_attention_gives_a_prefill_row_its_decode_bits():
    """A request's prompt rows as prefill (one step, beside another request) equal the same rows
    computed one by one as decode rows in batches of other shapes."""
    g = torch.Generator().manual_seed(1)
    block, kv_heads, heads, d = 4, 2, 4, 16
    k_cache, v_cache = torch.randn(2, 12, block, kv_heads, d, generator=g).unbind(0)
    tables = torch.tensor([[3, 7, 1, 0, 0], [5, 2, 9, 8, 11]], dtype=torch.int32)
    q = torch.randn(13, heads, d, generator=g)
    # request 0: 6 new rows over a context of 9; request 1: 7 new rows over 19
    flat = [int(tables[r, i // block]) * block + i % block for r, n in ((0, 9), (1, 19)) for i in range(n)]
    rows = PrefillRows(13, torch.tensor([0, 6, 13]), torch.tensor([0, 9, 28]), torch.tensor(flat), 7, 19)
    dec = as_decode_rows(rows, block)
    assert dec.context_lens.tolist() == [4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17, 18, 19]
    prefill = torch.empty_like(q)
    rows_forward(prefill, q, k_cache, v_cache, dec.block_tables, dec.context_lens, 0.25)
    for picks in ([12], [12, 0], [3, 12, 7, 1]):  # decode batches of other sizes and orders
        one = torch.empty(len(picks), heads, d)
        rows_forward(one, q[picks], k_cache, v_cache, dec.block_tables[picks], dec.context_lens[picks], 0.25)
        assert torch.equal(one, prefill[picks])


def _generate(engine, waves):
    seen = {}
    step = 0
    pending = {k: list(v) for k, v in waves.items()}
    while engine.has_work() or pending:
        for req in pending.pop(step, []):
            engine.add(req)
        for c in engine.step():
            assert isinstance(c, TokenChunk), c
            toks, lps = seen.setdefault(c.request_id, ([], []))
            toks += c.token_ids
            lps += c.logprobs or ()
        step += 1
    return seen


def test_a_request_has_the_same_bits_alone_batched_and_resumed(tiny_model_dir, tmp_path):
    adapter = make_random_adapter(tiny_model_dir, tmp_path / "a", rank=8, targets=["q_proj", "v_proj", "down_proj"])
    cfg = EngineConfig(num_kv_blocks=64, block_size=8, max_tokens_per_step=64, max_lora_rank=8, deterministic=True)
    engine = build_engine(tiny_model_dir, cfg, {"a": str(adapter)}, tokenizer=None)
    assert engine.model.paths == fixed_order.fixed("cpu")
    stats = engine.stats()  # what the replica's stats call reports (EngineStats.to_dict)
    assert stats.deterministic is True and stats.to_dict()["paths"] == fixed_order.fixed("cpu").as_dict()
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
    target = GenerateRequest("t", tuple(range(3, 30)), params, "a")
    alone = _generate(engine, {0: [target]})["t"]
    others = [
        GenerateRequest(f"o{i}", tuple(range(i, i + 5 + 9 * i)), params, "a" if i % 2 else None) for i in range(4)
    ]
    # beside prefills and decodes of other lengths and adapters, joining at other steps
    batched = _generate(engine, {0: others[:2], 1: [dataclasses.replace(target, request_id="t2")], 3: others[2:]})
    assert batched["t2"] == alone
    # migrated after 5 tokens: the rest recomputed by one prefill over prompt + those tokens
    resumed = dataclasses.replace(target, request_id="t3", resume_token_ids=tuple(alone[0][:5]))
    got = _generate(engine, {0: [resumed, others[3]]})["t3"]
    assert got == (alone[0][5:], alone[1][5:])
    assert engine.max_batch_seen >= 3
    # (with deterministic off, the batched run's logprobs differed from the lone run's in the last
    # bits when this test was written: the fixed paths are what makes them equal)
