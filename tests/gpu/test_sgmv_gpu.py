"""Device: the SGMV kernels equal the fp32 reference over Punica's workloads.

Every case draws fresh inputs, puts segments in random order on random pool
slots (some with no adapter), poisons v with NaN (so unwritten entries stay
NaN and entries that must not be read would spread NaN) and the pool rows
beyond each adapter's rank with NaN, and writes into a wider y at an offset
(columns outside the slice and rows without an adapter must come back
bit-identical).
"""

import math

import numpy as np
import pytest
import torch

from benchmarks.sgmv import request_adapters  # Punica's four workloads, as benchmarked
from benchmarks.sgmv_halves import sgmv_expand, sgmv_shrink
from ops import sgmv, sgmv_plan, sgmv_shapes
from ops.lora import LoraSlice
from ops.reference import lora_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKLOADS = ("distinct", "uniform", "skewed", "identical")
BATCHES = (1, 2, 3, 7, 16, 64, 256, 4096)
RANKS = (8, 16, 32, 64, 128, "mixed")
MIXED = (1, 7, 8, 13, 16, 32, 50, 64, 100, 128)
SLOTS = 640  # past the 512 slots the kernel stages in shared memory: both lookups run
TOL = 1e-2
PAD = 8  # y is wider than h_out: columns [PAD, PAD + h_out) are the slice


def make_segments(workload, batch, rng):
    """[(slot, rows)] in random order; rows of one adapter are one segment, some segments unadapted."""
    ids, counts = np.unique(request_adapters(workload, batch, rng), return_counts=True)
    slots = rng.choice(SLOTS, len(ids), replace=len(ids) > SLOTS)
    segs = [(int(s), int(c)) for s, c in zip(slots, counts)]
    if len(segs) >= 4:
        segs += [(-1, int(c)) for c in rng.integers(1, 4, len(segs) // 8)]
    rng.shuffle(segs)
    return segs


def make_pool(dtype, h_in, h_out, rank, seed, ranks=None):
    """A, B (NaN past each slot's rank), ranks and scales; `ranks` given: a pool sharing them."""
    torch.manual_seed(seed)
    max_rank = 128 if rank == "mixed" else rank
    if ranks is None and rank == "mixed":
        ranks = torch.tensor(MIXED, dtype=torch.int32, device="cuda")[
            torch.randint(len(MIXED), (SLOTS,), device="cuda")
        ]
    elif ranks is None:
        ranks = torch.full((SLOTS,), max_rank, dtype=torch.int32, device="cuda")
    A = torch.randn(SLOTS, max_rank, h_in, device="cuda").div_(math.sqrt(h_in))
    B = torch.randn(SLOTS, max_rank, h_out, device="cuda").div_(ranks.float().sqrt()[:, None, None])
    beyond = torch.arange(max_rank, device="cuda")[None, :] >= ranks[:, None]
    A[beyond], B[beyond] = math.nan, math.nan  # must never be read
    scales = torch.rand(SLOTS, device="cuda") * 1.5 + 0.5
    return A.to(dtype), B.to(dtype), ranks, scales


def reference(x, A, B, segs, ranks, scales, y0):
    """fp32 v and y, grouped by slot; the row mask of rows that got an adapter."""
    tokens, h_out = x.shape[0], B.shape[2]
    v = torch.full((tokens, A.shape[1]), math.nan, device="cuda")
    y = y0.float()
    starts = np.cumsum([0] + [n for _, n in segs])
    rows_of = {}
    for (slot, _), lo, hi in zip(segs, starts[:-1], starts[1:]):
        if slot >= 0:
            rows_of.setdefault(slot, []).append(torch.arange(lo, hi))
    for slot, parts in rows_of.items():
        rows, r = torch.cat(parts).cuda(), int(ranks[slot])
        vs = x[rows].float() @ A[slot, :r].float().T
        v[rows, :r] = vs
        y[rows, PAD : PAD + h_out] += float(scales[slot]) * (vs @ B[slot, :r].float())
    adapted = torch.zeros(tokens, dtype=torch.bool, device="cuda")
    for parts in rows_of.values():
        adapted[torch.cat(parts).cuda()] = True
    return v, y, adapted


def rel_err(out, ref):
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_case(dtype, h_in, h_out, rank, workload, batch, pool, rng, **forced):
    A, B, ranks, scales = pool
    segs = make_segments(workload, batch, rng)
    tokens = sum(n for _, n in segs)
    indptr = torch.tensor(np.cumsum([0] + [n for _, n in segs]), dtype=torch.int32, device="cuda")
    slot_ids = torch.tensor([s for s, _ in segs], dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, h_in, device="cuda", dtype=dtype)
    # y small next to the LoRA delta, or rounding y would swamp the delta's error
    y0 = (torch.randn(tokens, h_out + 2 * PAD, device="cuda") * 0.05).to(dtype)
    v_ref, y_ref, adapted = reference(x, A, B, segs, ranks.cpu(), scales.cpu(), y0)
    seg_args = (indptr, slot_ids, ranks)
    errors = []

    def check_y(y, what):
        cols = slice(PAD, PAD + h_out)
        if (
            not torch.equal(y[~adapted], y0[~adapted])
            or not torch.equal(y[:, :PAD], y0[:, :PAD])
            or not torch.equal(y[:, PAD + h_out :], y0[:, PAD + h_out :])
        ):
            errors.append(f"{what}: wrote outside its rows/columns")
        delta, delta_ref = y[adapted, cols].float() - y0[adapted, cols].float(), (y_ref - y0.float())[adapted, cols]
        if not (err := rel_err(delta, delta_ref)) < TOL:
            errors.append(f"{what}: y rel err {err:.2e}")

    def check_v(v, what):
        written = ~torch.isnan(v_ref)
        if not torch.isnan(v[~written]).all():
            errors.append(f"{what}: v written outside rows x rank")
        if not (err := rel_err(v[written], v_ref[written])) < TOL:
            errors.append(f"{what}: v rel err {err:.2e}")

    v = torch.full_like(v_ref, math.nan)
    check_v(sgmv_shrink(v, x, A, *seg_args), "shrink")
    y = y0.clone()
    check_y(sgmv_expand(y, v_ref, B, *seg_args, scales, y_offset=PAD), "expand")
    y, v = y0.clone(), torch.full_like(v_ref, math.nan)
    sgmv.add_lora(y, x, A, B, *seg_args, scales, y_offset=PAD, v=v, **forced)
    check_y(y, "add_lora")
    check_v(v, "add_lora")
    return [f"{dtype} h={h_in}->{h_out} r={rank} {workload} B={batch} nseg={len(segs)} {forced}: {e}" for e in errors]


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("h", (4096, 5120, 11008))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_equals_reference(dtype, h, rank):
    rng = np.random.default_rng(h)
    pool = make_pool(dtype, h, h, rank, seed=h)
    failures = [f for w in WORKLOADS for b in BATCHES for f in check_case(dtype, h, h, rank, w, b, pool, rng)]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("h_in,h_out", [(4096, 1024), (4096, 11008), (11008, 4096), (13824, 5120), (2048, 16384)])
def test_projection_shapes(h_in, h_out):
    rng = np.random.default_rng(h_out)
    pool = make_pool(torch.bfloat16, h_in, h_out, "mixed", seed=h_in)
    failures = [
        f
        for w in WORKLOADS
        for b in (1, 7, 64, 1000)
        for f in check_case(torch.bfloat16, h_in, h_out, "mixed", w, b, pool, rng)
    ]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("warps", (4, 8))
@pytest.mark.parametrize("split", (4, 8, 16))
def test_every_cluster_width_and_block_size(split, warps):
    """The defaults pick these by measurement: every choice must be exact, whatever is picked."""
    rng = np.random.default_rng(split * 100 + warps)
    pool = make_pool(torch.float16, 4096, 4096, "mixed", seed=split)
    forced = dict(split=split, warps=warps)
    failures = [
        f
        for w in WORKLOADS
        for b in (1, 16, 64, 300)
        for f in check_case(torch.float16, 4096, 4096, "mixed", w, b, pool, rng, **forced)
    ]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("groups", (2, 4))
@pytest.mark.parametrize("split", (8, 16))
def test_every_rank_group_width(split, groups):
    """Rank groups (clusters of an item each summing a share of v's ranks, traded through global
    memory): exact at rank tiles 64 and 128, mixed ranks included (some groups then hold no
    columns). Grids past what the GPU holds at once fall back to one cluster per item."""
    rng = np.random.default_rng(split * 10 + groups)
    failures = []
    for dtype, rank, h_in in ((torch.float16, 64, 4096), (torch.bfloat16, "mixed", 4096), (torch.float16, 128, 11008)):
        pool = make_pool(dtype, h_in, 4096, rank, seed=groups)
        failures += [
            f
            for w in WORKLOADS
            for b in (1, 2, 3, 7, 16, 64)
            for f in check_case(dtype, h_in, 4096, rank, w, b, pool, rng, split=split, groups=groups)
        ]
    assert not failures, "\n".join(failures[:20])
    A, B, ranks, scales = pool
    segs = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    plan = sgmv_plan.launch_plan(
        sgmv_shapes.FUSED,
        1,
        A=A,
        B=B,
        indptr=segs,
        slot_ids=segs[:1],
        ranks=ranks,
        scales=scales,
        split=split,
        groups=groups,
    )
    assert "grouped" in plan.name and plan.blocks == split * groups and plan.args.xcount is not None


def test_sm80_code_path_on_this_device(monkeypatch):
    """The kernels an A100 runs (no clusters: the fused kernel's split-K partials meet in L2,
    or one block per item on large grids; the expand split over 8 plain blocks), built as
    compute_80 PTX and compiled by the driver for this GPU, equal the reference too."""
    monkeypatch.setattr(sgmv_plan, "kernel_arch", lambda index: 80)
    rng = np.random.default_rng(80)
    failures = []
    for dtype, rank in ((torch.float16, 16), (torch.bfloat16, 64), (torch.float16, "mixed")):
        pool = make_pool(dtype, 4096, 5120, rank, seed=80)
        failures += [
            f
            for w, b in (
                ("distinct", 1),
                ("distinct", 16),
                ("distinct", 40),
                ("uniform", 64),
                ("skewed", 300),
                ("identical", 4096),
            )
            for f in check_case(dtype, 4096, 5120, rank, w, b, pool, rng)
        ]
    assert not failures, "\n".join(failures[:20])
    A, B, ranks, scales = pool
    segs = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    plan = sgmv_plan.launch_plan(
        sgmv_shapes.FUSED, 1, A=A, B=B, indptr=segs, slot_ids=segs[:1], ranks=ranks, scales=scales
    )
    assert "cluster" not in plan.name and plan.cluster == 16 and plan.args.xcount is not None


def slice_reference(x, slices, segs, ranks, scales, y0):
    """fp32 y of a sliced add-on (each slice's own segment slots), and per slice the rows it adapts."""
    y, adapted = y0.float(), []
    starts = np.cumsum([0] + [n for _, n in segs])
    for s in slices:
        rows = torch.zeros(len(y), dtype=torch.bool, device="cuda")
        cols = slice(s.y_offset, s.y_offset + s.B.shape[2])
        for slot, lo, hi in zip(s.slot_ids.tolist(), starts[:-1], starts[1:]):
            if slot >= 0:
                r = int(ranks[slot])
                y[lo:hi, cols] += float(scales[slot]) * (
                    x[lo:hi].float() @ s.A[slot, :r].float().T @ s.B[slot, :r].float()
                )
                rows[lo:hi] = True
        adapted.append(rows)
    return y, adapted


@pytest.mark.parametrize("split", (None, 4, 8, 16, "sm_80", "rank_groups"))
@pytest.mark.parametrize("h_outs", [(4096, 1024, 1024), (11008, 11008)], ids=("qkv_gqa", "gate_up"))
def test_sliced_equals_reference_of_every_slice(h_outs, split, monkeypatch):
    """q|k|v or gate|up in one launch: each slice its own pools and slot ids (an adapter may skip
    a member: −1), its own columns of one y; every slice equals its reference, nothing else moves.
    sm_80: the A100's kernel (no clusters), as in test_sm80_code_path_on_this_device; rank_groups:
    4 clusters of 8 per item wherever the GPU holds the grid at once (decode tiles)."""
    groups = None
    if split == "sm_80":
        monkeypatch.setattr(sgmv_plan, "kernel_arch", lambda index: 80)
        split = None
    if split == "rank_groups":
        split, groups = 8, 4
    rng = np.random.default_rng(len(h_outs) * 10 + (split or 0) + (groups or 0))
    dtype = torch.bfloat16 if split == 8 else torch.float16
    first = make_pool(dtype, 4096, h_outs[0], "mixed", seed=3)
    pools = [first] + [make_pool(dtype, 4096, h, "mixed", seed=4 + k, ranks=first[2]) for k, h in enumerate(h_outs[1:])]
    offsets = PAD + np.cumsum([0, *h_outs[:-1]])
    failures = []
    for workload in WORKLOADS:
        for batch in (1, 7, 16, 64, 300):
            segs = make_segments(workload, batch, rng)
            tokens = sum(n for _, n in segs)
            indptr = torch.tensor(np.cumsum([0] + [n for _, n in segs]), dtype=torch.int32, device="cuda")
            slot_ids = [
                torch.tensor(
                    [s if k == 0 or rng.random() < 0.7 else -1 for s, _ in segs], dtype=torch.int32, device="cuda"
                )
                for k in range(len(h_outs))
            ]
            slices = [LoraSlice(A, B, ids, int(off)) for (A, B, _, _), ids, off in zip(pools, slot_ids, offsets)]
            x = torch.randn(tokens, 4096, device="cuda", dtype=dtype)
            y0 = (torch.randn(tokens, sum(h_outs) + 2 * PAD, device="cuda") * 0.05).to(dtype)
            y_ref, adapted = slice_reference(x, slices, segs, first[2].cpu(), first[3].cpu(), y0)
            y = sgmv.add_lora_sliced(y0.clone(), x, slices, indptr, first[2], first[3], split=split, groups=groups)
            case = f"{h_outs} split={split} {workload} B={batch}"
            for s, rows, h in zip(slices, adapted, h_outs):
                cols = slice(s.y_offset, s.y_offset + h)
                if not torch.equal(y[~rows, cols], y0[~rows, cols]):
                    failures.append(f"{case} slice at {s.y_offset}: wrote rows it does not adapt")
                delta, ref = y[rows, cols].float() - y0[rows, cols].float(), y_ref[rows, cols] - y0[rows, cols].float()
                if rows.any() and not (err := rel_err(delta, ref)) < TOL:
                    failures.append(f"{case} slice at {s.y_offset}: rel err {err:.2e}")
            if not torch.equal(y[:, :PAD], y0[:, :PAD]) or not torch.equal(y[:, -PAD:], y0[:, -PAD:]):
                failures.append(f"{case}: wrote outside the slices")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize(
    "arch,tokens,batch", [(None, 64, 40), (80, 32, 16), (None, 4, 3)], ids=("own", "sm_80", "rank_groups")
)
def test_cuda_graph_capture_and_replay(arch, tokens, batch, monkeypatch):
    """sm_80: a grid small enough for split-K through L2, whose counters carry over from replay
    to replay; rank_groups: few items at rank 128, whose clusters count in on those counters."""
    if arch:
        monkeypatch.setattr(sgmv_plan, "kernel_arch", lambda index: arch)
    dtype, h = torch.float16, 4096
    rng = np.random.default_rng(1)
    A, B, ranks, scales = make_pool(dtype, h, h, "mixed", seed=1)
    x = torch.empty(tokens, h, device="cuda", dtype=dtype)
    y = torch.empty(tokens, h + 2 * PAD, device="cuda", dtype=dtype)
    v = torch.empty(tokens, 128, device="cuda")
    indptr = torch.zeros(tokens + 1, dtype=torch.int32, device="cuda")
    slot_ids = torch.full((tokens,), -1, dtype=torch.int32, device="cuda")
    sgmv.add_lora(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=PAD, v=v)  # compile outside capture
    plan = sgmv_plan.launch_plan(
        sgmv_shapes.FUSED, tokens, x=x, y=y, A=A, B=B, indptr=indptr, slot_ids=slot_ids, ranks=ranks, scales=scales
    )
    assert ("grouped" in plan.name) == (batch == 3), plan.name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgmv.add_lora(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=PAD, v=v)
    for workload in ("distinct", "skewed", "identical"):
        segs = make_segments(workload, batch, rng)  # fewer rows than tokens: the last rows have no segment
        rows = sum(n for _, n in segs)
        segs += [(-1, 0)] * (tokens - len(segs))  # same nseg every replay: pad with empty segments
        starts = np.cumsum([0] + [n for _, n in segs])
        indptr.copy_(torch.tensor(starts, dtype=torch.int32))
        slot_ids.copy_(torch.tensor([s for s, _ in segs], dtype=torch.int32))
        x.copy_(torch.randn(tokens, h, device="cuda", dtype=dtype))
        y0 = (torch.randn(tokens, h + 2 * PAD, device="cuda") * 0.05).to(dtype)
        y.copy_(y0)
        graph.replay()
        _, y_ref, adapted = reference(x, A, B, segs, ranks.cpu(), scales.cpu(), y0)
        assert rows <= tokens and torch.equal(y[~adapted], y0[~adapted])
        assert rel_err(y[adapted].float() - y0[adapted].float(), (y_ref - y0.float())[adapted]) < TOL, workload


@pytest.mark.parametrize("lead", (3, 16, 21, 40))
def test_rows_outside_every_segment_untouched(lead):
    """indptr need not start at row 0 nor end at the last row: those rows belong to no segment."""
    rng = np.random.default_rng(lead)
    A, B, ranks, scales = make_pool(torch.float16, 4096, 4096, "mixed", seed=lead)
    for batch in (1, 5, 17, 300):
        segs = make_segments("distinct" if batch < 20 else "skewed", batch, rng)
        tail = int(rng.integers(0, 20))
        tokens = lead + sum(n for _, n in segs) + tail
        indptr = torch.tensor(lead + np.cumsum([0] + [n for _, n in segs]), dtype=torch.int32, device="cuda")
        slot_ids = torch.tensor([s for s, _ in segs], dtype=torch.int32, device="cuda")
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.float16)
        y0 = (torch.randn(tokens, 4096, device="cuda") * 0.05).half()
        y_ref = lora_ref(y0.float(), x, A, B, indptr, slot_ids, ranks, scales)
        y = sgmv.add_lora(y0.clone(), x, A, B, indptr, slot_ids, ranks, scales)
        outside = torch.ones(tokens, dtype=torch.bool, device="cuda")
        outside[lead : tokens - tail] = False
        assert torch.equal(y[outside], y0[outside]), (lead, batch, tail)
        assert rel_err(y.float() - y0.float(), y_ref - y0.float()) < TOL, (lead, batch)
