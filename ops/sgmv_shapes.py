"""Which SGMV kernel instantiation and grid shape serve a call: the template names, and the
cluster widths / split-K widths measured on the H200 (`ops.sgmv` launches them)."""
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
    # B = 40..255: -0.8 to -13 µs against 4; benchmarks/results/trace_runs/variants_rank_split.json).
    # Not ranks 32 (4 as fast or up to 5 µs faster) nor 128 (4 best at B = 48, 64, 255; 8 at 128)
    (16, 64): ((16, 4, 2.1), (8, 4, float("inf"))),
    # 32-row prefill items: every block gathers its peers' 32-row partials, so wide clusters
    # cost more than they stream (benchmarks/sgmv_variants.py, e.g. r64 one adapter 512
    # tokens: 35.4 µs in 16-block clusters, 24.3 in 8, 26.9 in 4)
    32: ((8, 4, 1.5), (4, 4, float("inf"))),
}
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



def kernel_name(mode: int, dtype: torch.dtype, max_rank: int, tokens: int, arch: int, split: int = SPLIT,
                warps: int = 4, sliced: bool = False):
    """(template instantiation, blocks per item, rows per item, warps per block) for one call shape;
    sliced: the fused kernel over several slices (add_lora_sliced)."""
    rmax = _rmax(max_rank)
    if rmax is None:
        raise ValueError(f"max_rank {max_rank} > {_RMAX[-1]}")
    mt = 2 if mode == FUSED and tokens >= _BIG_TILE_TOKENS else 1
    if mode == SHRINK and arch < 90:
        split = 1  # the standalone shrink sums split-K partials across a cluster: sm_90 only
    if mode != FUSED or mt != 1 or arch < 90:
        warps = 4  # 8-warp blocks: decode tiles of the fused cluster kernel only
    cluster = "cluster_" if split > 1 and mode != EXPAND and arch >= 90 else ""
    name = f"sgmv_{'sliced_' if sliced else ''}{cluster}kernel<{_CTYPE[dtype]}, {rmax}, {mt}, {split}, {mode}, float, {warps}>"
    return name, split, 16 * mt, warps


def _rmax(max_rank: int) -> int | None:
    """The rank tile of the kernels for a pool of this max rank (None: too large)."""
    return next((r for r in _RMAX if max_rank <= r), None)


def all_kernel_names(arch: int) -> list[str]:
    """Every instantiation the wrappers can ask for on `arch` (CI compiles them all)."""
    fused_splits = _FORCEABLE_SPLITS if arch >= 90 else (1, *_FORCEABLE_SPLITS)  # 1: large sm_80 grids
    shapes = [(m, dt, r, t, split, w, sl) for m in (SHRINK, EXPAND, FUSED) for dt in _CTYPE for r in _RMAX
              for t in (1, _BIG_TILE_TOKENS) for split in (fused_splits if m == FUSED else (SPLIT,))
              for w in _FORCEABLE_WARPS for sl in ((False, True) if m == FUSED else (False,))]
    return sorted({kernel_name(m, dt, r, t, arch, split, w, sl)[0] for m, dt, r, t, split, w, sl in shapes})


def _fused_shapes(rows: int, max_rank: int, arch: int):
    """add_lora's (blocks per item, warps, most blocks per SM) for items of `rows` rows, first choice first."""
    if arch < 90:
        return (*((s, 4, min(per_sm, GX_PER_SM[rows])) for s, per_sm in _GX_SHAPES), (1, 4, float("inf")))
    return _FUSED_SHAPES.get((rows, _rmax(max_rank)), _FUSED_SHAPES[rows])


def fused_shape(items: int, rows: int, max_rank: int, arch: int, sms: int) -> tuple[int, int]:
    """(blocks per item, warps per block) of add_lora for a grid of `items` work items of `rows` rows."""
    return next((s, w) for s, w, per_sm in _fused_shapes(rows, max_rank, arch) if items * s <= per_sm * sms)


def fused_kernel_names(dtype: torch.dtype, max_rank: int, arch: int) -> list[str]:
    """Every fused kernel (one slice or several) the defaults can pick for a pool of this dtype and max rank."""
    names = set()
    for tokens in (1, _BIG_TILE_TOKENS):
        rows = kernel_name(FUSED, dtype, max_rank, tokens, arch)[2]
        names |= {kernel_name(FUSED, dtype, max_rank, tokens, arch, s, w, sliced)[0]
                  for s, w, _ in _fused_shapes(rows, max_rank, arch) for sliced in (False, True)}
    return sorted(names)
