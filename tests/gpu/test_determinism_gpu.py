"""Issue 46 on the GPU. Instance invariance: engines built under three allocation patterns (alone;
after odd-sized ballast that shifts every later address; beside a second engine still alive) give
bitwise-identical tokens and logprobs for the same requests in the same waves, in the default mode
and with `deterministic: true`. Batch invariance (`deterministic: true`): a request's tokens and
logprobs are the same alone, in a batch of others and resumed after a migration; and the fixed
ops (row-tiled GEMM, per-row attention, SGMV at one split) give a row the same bits whatever rows
share its call."""

import dataclasses
import random

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from ops import fixed_order
from ops.fixed_attention import as_decode_rows
from ops.fixed_gemm import linear
from ops.lora import LoraSlice, add_lora
from ops.paged_attention import PrefillRows
from ops.paged_decode import paged_decode
from tests.gpu import test_cuda_graphs_gpu as graphs_test

pytestmark = pytest.mark.gpu
model_dir = graphs_test.model_dir  # the tiny Llama (head dim 128, GQA 8/2) and its 8 adapters
PATTERNS = ("alone", "shifted", "beside_another")


def _engine(model_dir, deterministic: bool):
    path, adapters = model_dir
    cfg = EngineConfig(
        max_num_seqs=32,
        max_lora_rank=64,
        max_loras=8,
        num_kv_blocks=1024,
        dtype=torch.float16,
        device="cuda",
        deterministic=deterministic,
    )
    return build_engine(path, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None)


def _requests(model_dir, seed=5, n=16):
    rng = random.Random(seed)
    names = [None, *sorted(model_dir[1])]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, prompt_logprobs=2)
    return [
        GenerateRequest(f"r{i}", tuple(rng.randrange(512) for _ in range(rng.randint(3, 90))), params, names[i % 9])
        for i in range(n)
    ]


def _run(engine, waves: dict[int, list[GenerateRequest]]) -> dict:
    """{request id: (tokens, logprobs, prompt logprobs)}; waves[k] join before step k."""
    out, step, pending = {}, 0, dict(waves)
    while engine.has_work() or pending:
        for r in pending.pop(step, []):
            engine.add(r)
        for c in engine.step():
            assert isinstance(c, TokenChunk), c
            toks, lps, plps = out.setdefault(c.request_id, ([], [], []))
            toks += c.token_ids
            lps += c.logprobs or ()
            plps += c.prompt_logprobs or ()
        step += 1
    return out


def _under(pattern: str, model_dir, deterministic: bool):
    """Build an engine under an allocation pattern and run the same waves; the ballast and the
    other engine stay alive until the run is over."""
    keep = []
    if pattern == "shifted":  # odd sizes: every later block of the caching allocator lands elsewhere
        keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1 << 20 | 272, 3 * 4096 + 16, 999_983)]
    elif pattern == "beside_another":
        keep = [_engine(model_dir, deterministic)]
    engine = _engine(model_dir, deterministic)
    reqs = _requests(model_dir)
    got = _run(engine, {0: reqs[:10], 3: reqs[10:]})
    del keep, engine
    torch.cuda.empty_cache()
    return got


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_engines_under_three_allocation_patterns_agree_bitwise(model_dir, deterministic):
    runs = {p: _under(p, model_dir, deterministic) for p in PATTERNS}
    first = runs[PATTERNS[0]]
    for p in PATTERNS[1:]:
        differ = sorted(k for k in first if runs[p][k] != first[k])
        assert not differ, f"{p}: requests {differ} differ from {PATTERNS[0]}'s"


def test_a_request_is_bitwise_the_same_alone_batched_and_migrated(model_dir):
    engine = _engine(model_dir, deterministic=True)
    assert engine.stats().to_dict()["paths"] == fixed_order.fixed("cuda").as_dict()
    reqs = _requests(model_dir, seed=7, n=24)
    batched = _run(engine, {0: reqs[:12], 2: reqs[12:]})
    for r in reqs[::3]:  # every third: alone, then resumed after 6 tokens (a migration's recompute)
        alone = _run(engine, {0: [r]})[r.request_id]
        assert alone[:2] == batched[r.request_id][:2], r.request_id
        moved = dataclasses.replace(r, request_id=r.request_id + "m", resume_token_ids=tuple(alone[0][:6]))
        got = _run(engine, {0: [moved, reqs[(reqs.index(r) + 1) % len(reqs)]]})[moved.request_id]
        assert (got[0], got[1]) == (alone[0][6:], alone[1][6:]), r.request_id


def test_fixed_gemm_rows_are_independent_of_m():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 1024, device="cuda", generator=g).half()
    w = (torch.randn(3072, 1024, device="cuda", generator=g) * 0.02).half()
    with fixed_order.using(fixed_order.fixed("cuda")):
        full = linear(x, w)
        for m in (1, 7, 33, 128, 129, 257):
            assert torch.equal(linear(x[-m:], w), full[-m:]), m


def test_fixed_attention_prefill_rows_equal_decode_rows():
    g = torch.Generator(device="cuda").manual_seed(1)
    blocks, bs, kvh, heads, d = 64, 16, 2, 8, 128
    k_cache = torch.randn(blocks, bs, kvh, d, device="cuda", generator=g).half()
    v_cache = torch.randn(blocks, bs, kvh, d, device="cuda", generator=g).half()
    ctx, new = 300, 40  # one request: 40 new rows over a context of 300
    table = torch.randperm(blocks, device="cuda", generator=g)[: -(-ctx // bs)].int()
    kv_index = (table.long()[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[:ctx]
    cu = lambda *v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    rows = PrefillRows(new, cu(0, new), cu(0, ctx), kv_index, new, ctx)
    q = torch.randn(new, heads, d, device="cuda", generator=g).half()
    dec = as_decode_rows(rows, bs)
    pre = torch.empty_like(q)
    paged_decode(pre, q, k_cache, v_cache, dec.block_tables, dec.context_lens, 0.088, 1)
    for picks in ([39], [0, 39], list(range(0, 40, 3))):
        one = torch.empty(len(picks), heads, d, device="cuda", dtype=q.dtype)
        paged_decode(one, q[picks], k_cache, v_cache, dec.block_tables[picks], dec.context_lens[picks], 0.088, 1)
        assert torch.equal(one, pre[picks]), picks


def test_fixed_sgmv_rows_are_independent_of_the_grid():
    """A row of one adapter alone, in a 12-row segment of its adapter (past the <= 8-row variant of
    rank tile 16), there among 39 one-row segments of others, and in a 300-token step (past the
    256-token switch to 32-row items): the same bits on the fixed path (ops/lora.py FIXED_SGMV)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    slots, rank, h_in, h_out = 8, 16, 1024, 1024
    A = (torch.randn(slots, rank, h_in, device="cuda", generator=g) * 0.05).half()
    B = (torch.randn(slots, rank, h_out, device="cuda", generator=g) * 0.05).half()
    ranks = torch.full((slots,), rank, dtype=torch.int32, device="cuda")
    scales = torch.ones(slots, device="cuda")
    x = torch.randn(400, h_in, device="cuda", generator=g).half()
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731

    def run(indptr, slot_ids, rows):
        y = torch.zeros(len(rows), h_out, device="cuda", dtype=torch.float16)
        with fixed_order.using(fixed_order.fixed("cuda")):
            add_lora(y, x[rows], [LoraSlice(A, B, i32(slot_ids), 0)], i32(indptr), ranks, scales)
        return y

    alone = run([0, 1], [3], [0])
    in12 = run([0, 12], [3], [0, *range(100, 111)])[:1]
    among = run([*range(40), 51], [i % slots for i in range(39)] + [3], [*range(200, 239), 0, *range(100, 111)])[39:40]
    big = run([0, 300], [3], [0, *range(100, 399)])[:1]
    for name, got in (("12-row segment", in12), ("among others", among), ("300 tokens", big)):
        assert torch.equal(got, alone), name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs sm_89+"
)
def test_fp8_activation_quantization_does_not_depend_on_the_address():
    """quantize_rows once took its torch path for a view not 16-byte aligned: other rounding for the
    same values at another address. Now every layout the kernel can read goes through it."""
    from ops.fp8 import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randn(33 * 1024 + 4, device="cuda", generator=g).half()
    odd = base[4:].view(33, 1024)  # 8 bytes past an aligned start
    even = odd.clone()
    assert odd.data_ptr() % 16 and not even.data_ptr() % 16
    (qa, sa), (qb, sb) = quantize_rows(odd), quantize_rows(even)
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
