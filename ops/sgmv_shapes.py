"""Which SGMV kernel instantiation and grid shape serve a call: the template names, and the
cluster widths / split-K widths measured on the H200 (`ops.sgmv_plan` launches them)."""

import torch

SHRINK, EXPAND, FUSED = 0, 1, 2
SPLIT = 8  # blocks sharing one work item: split-K in the shrink, split-N in the expand
# add_lora on sm_90, measured on the H200 (benchmarks/sgmv.py's sweep, 2026-12-01):
# blocks of 4 warps, in clusters of 16 while the grid fits ~two blocks per SM at that
# width (up to 17 items, e.g. 17 distinct adapters), of 8 while it fits at 8 (34 items),
# else of 4. 8-warp blocks, best before the index arrays were staged in shared memory,
# now tie or lose. (cluster width, warps, most blocks per SM), by rows per item (and rank tile):
_FUSED_SHAPES = {
    16: ((16, 4, 2.1), (8, 4, 2.1), (4, 4, float("inf"))),
    # rank 64 decode: clusters of 8 at every larger grid too, several waves of them (Distinct
    # B = 40..255: -0.8 to -13 µs against 4; trace_runs/variants_rank_split.json).
    # Not ranks 32 (4 as fast or up to 5 µs faster) nor 128 (4 best at B = 48, 64, 255; 8 at 128)
    (16, 64): ((16, 4, 2.1), (8, 4, float("inf"))),
    # 32-row prefill items: every block gathers its peers' 32-row partials, so wide clusters
    # cost more than they stream (benchmarks/sgmv_variants.py, e.g. r64 one adapter 512
    # tokens: 35.4 µs in 16-block clusters, 24.3 in 8, 26.9 in 4)
    32: ((8, 4, 1.5), (4, 4, float("inf"))),
}
# Rank groups (sm_90, kernels/sgmv.cu): G clusters per item, each summing 1/G of v's ranks, for
# decode grids of few items at rank tiles 64 and 128, where one cluster per item leaves most SMs
# idle: (groups, cluster width, most items, fewest rows per item on average). Measured on the
# H200 (trace_runs/variants_groups.json): rank 128 Identical B=16 17.5 ->
# 13.5 µs, at h_in 11008 22.1 -> 15.1, Distinct B=3 14.1 -> 13.3; from 6 items on no gain. Rank 64
# Identical B=16 11.9 -> 10.8 and B=64 (4 items) 12.0 -> 11.5, but one-row items lose (Distinct
# B=2 10.2 -> 10.7; and Uniform B=16, 4 rows per item, 10.7 -> 11.5): their partials are small, so
# a cluster exchanges them cheaply. Rank 32 loses everywhere (Identical B=16 10.1 -> 10.9;
# variants_groups_r32.json, variants_groups_r64.json). Sliced launches count the items of all
# slices (gate|up r128 one adapter B=16 24.3 -> 16.4 µs; benchmarks/results/sgmv_sliced_h200.json
# holds the 16.4).
_GROUPED = {64: ((4, 8, 4, 8),), 128: ((4, 16, 4, 1),)}
_FORCEABLE_GROUPS = (2, 4)
# add_lora before sm_90: split-K over blocks whose partials meet in L2 (kernels/exchange.cuh).
# The blocks of an item wait for each other, so only grids the GPU holds at once: at most
# GX_PER_SM blocks per SM by rows per item (the registers allow 3 and 2: MINB in sgmv.cu).
# (split, most blocks per SM), by grid size, as measured with the A100's kernels on the H200
# (benchmarks/sgmv.py --arch 80; 16 beat 8 by 0.3-0.8 µs at Distinct B=1 and 16; no A100
# measured); past them one block per item:
GX_PER_SM = {16: 2.5, 32: 2.0}
_GX_SHAPES = ((16, 2.0), (8, 2.5), (4, 2.5))
_FORCEABLE_SPLITS, _FORCEABLE_WARPS = (4, 8, 16), (4, 8)
_RMAX = (16, 32, 64, 128)
_BIG_TILE_TOKENS = 256  # fused, from here on 32-row items: adapters re-read from L2 half as often
_CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def kernel_name(
    mode: int,
    dtype: torch.dtype,
    max_rank: int,
    tokens: int,
    arch: int,
    split: int = SPLIT,
    warps: int = 4,
    sliced: bool = False,
    groups: int = 1,
):
    """(template instantiation, blocks per item, rows per item, warps per block) for one call shape;
    sliced: the fused kernel over several slices (add_lora_sliced); groups: clusters per item
    (rank groups: the fused kernels of decode rows at rank tiles 64 and 128, 4-warp blocks in
    clusters of 8 or 16, sm_90: the instantiations CI compiles)."""
    rmax = _rmax(max_rank)
    if rmax is None:
        raise ValueError(f"max_rank {max_rank} > {_RMAX[-1]}")
    mt = 2 if mode == FUSED and tokens >= _BIG_TILE_TOKENS else 1
    if mode == SHRINK and arch < 90:
        split = 1  # the standalone shrink sums split-K partials across a cluster: sm_90 only
    if mode != FUSED or mt != 1 or arch < 90:
        warps = 4  # 8-warp blocks: decode tiles of the fused cluster kernel only
    if groups > 1:
        if (
            (mode, mt, warps) != (FUSED, 1, 4)
            or arch < 90
            or split not in (8, 16)
            or rmax not in _GROUPED
            or groups not in _FORCEABLE_GROUPS
        ):
            raise ValueError(f"rank groups: not for this call shape (rank tile {rmax}, split {split}, {groups} groups)")
        kind = "sliced_grouped" if sliced else "grouped"
        return f"sgmv_{kind}_kernel<{_CTYPE[dtype]}, {rmax}, 1, {split}, {mode}, float, 4, {groups}>", split, 16, 4
    cluster = "cluster_" if split > 1 and mode != EXPAND and arch >= 90 else ""
    name = f"sgmv_{'sliced_' if sliced else ''}{cluster}kernel<{_CTYPE[dtype]}, {rmax}, {mt}, {split}, {mode}, float, {warps}>"
    return name, split, 16 * mt, warps


def _rmax(max_rank: int) -> int | None:
    """The rank tile of the kernels for a pool of this max rank (None: too large)."""
    return next((r for r in _RMAX if max_rank <= r), None)


def all_kernel_names(arch: int) -> list[str]:
    """Every instantiation the wrappers can ask for on `arch` (CI compiles them all)."""
    fused_splits = _FORCEABLE_SPLITS if arch >= 90 else (1, *_FORCEABLE_SPLITS)  # 1: large sm_80 grids
    shapes = [
        (m, dt, r, t, split, w, sl)
        for m in (SHRINK, EXPAND, FUSED)
        for dt in _CTYPE
        for r in _RMAX
        for t in (1, _BIG_TILE_TOKENS)
        for split in (fused_splits if m == FUSED else (SPLIT,))
        for w in _FORCEABLE_WARPS
        for sl in ((False, True) if m == FUSED else (False,))
    ]
    grouped = (
        [
            (FUSED, dt, r, 1, split, 4, sl, g)
            for dt in _CTYPE
            for r in _GROUPED
            for split in (8, 16)
            for g in _FORCEABLE_GROUPS
            for sl in (False, True)
        ]
        if arch >= 90
        else []
    )
    return sorted({kernel_name(m, dt, r, t, arch, *rest)[0] for m, dt, r, t, *rest in shapes + grouped})


def _fused_shapes(rows: int, max_rank: int, arch: int):
    """add_lora's (blocks per item, warps, most blocks per SM) for items of `rows` rows, first choice first."""
    if arch < 90:
        return (*((s, 4, min(per_sm, GX_PER_SM[rows])) for s, per_sm in _GX_SHAPES), (1, 4, float("inf")))
    return _FUSED_SHAPES.get((rows, _rmax(max_rank)), _FUSED_SHAPES[rows])


def _groupings(rows: int, max_rank: int, arch: int):
    """The rank groupings add_lora may pick for this call shape: (groups, split, most items, fewest rows per item)."""
    return _GROUPED.get(_rmax(max_rank), ()) if arch >= 90 and rows == 16 else ()


def fused_shape(items: int, rows: int, max_rank: int, arch: int, sms: int, tokens: int = 0) -> tuple[int, int, int]:
    """(blocks per item, warps per block, rank groups) of add_lora for a grid of `items` work items
    of `rows` rows over `tokens` rows (a sliced grid: the items and the rows of all slices)."""
    for g, s, most, min_rows in _groupings(rows, max_rank, arch):
        if items <= most and tokens >= min_rows * items:
            return s, 4, g
    return next((s, w, 1) for s, w, per_sm in _fused_shapes(rows, max_rank, arch) if items * s <= per_sm * sms)


def fused_kernel_names(dtype: torch.dtype, max_rank: int, arch: int) -> list[str]:
    """Every fused kernel (one slice or several) the defaults can pick for a pool of this dtype and max rank."""
    names = set()
    for tokens in (1, _BIG_TILE_TOKENS):
        rows = kernel_name(FUSED, dtype, max_rank, tokens, arch)[2]
        names |= {
            kernel_name(FUSED, dtype, max_rank, tokens, arch, s, w, sliced)[0]
            for s, w, _ in _fused_shapes(rows, max_rank, arch)
            for sliced in (False, True)
        }
        names |= {
            kernel_name(FUSED, dtype, max_rank, tokens, arch, s, 4, sliced, g)[0]
            for g, s, _, _ in _groupings(rows, max_rank, arch)
            for sliced in (False, True)
        }
    return sorted(names)
