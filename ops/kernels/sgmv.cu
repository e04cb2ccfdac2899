// SGMV: per segment of rows, v = x @ A[slot].T (shrink) and y += scale * v @ B[slot] (expand).
//
// One work item = one segment's rows inside an M-row block (segments.cuh).
// SPLIT blocks share an item: in the shrink each reads 1/SPLIT of h_in
// (split-K), in the expand each writes 1/SPLIT of h_out. The fused kernel runs
// the SPLIT blocks as one thread-block cluster (sm_90): partial sums of v meet
// in distributed shared memory, so shrink + expand is one launch and v never
// leaves the chip. Before sm_90 they meet in L2 (exchange.cuh). A grid of few
// items at a large rank (sm_90) may give each item G clusters, each summing
// 1/G of v's ranks; their columns of v then meet in L2 (rank groups, share_v).
//
// Tensor cores do all the products (mma m16n8k16, fp32 accumulate), fed
// straight from 16-byte global loads without shared-memory staging (shrink.cuh,
// expand.cuh). Rows beyond the piece and ranks beyond the adapter's rank are
// never loaded.
#include "args.cuh"
#include "cluster.cuh"
#include "dtype.cuh"
#include "expand.cuh"
#include "segments.cuh"
#include "shrink.cuh"

enum Mode { SHRINK = 0, EXPAND = 1, FUSED = 2 };

#ifdef SGMV_TRACE
// benchmarks/sgmv_trace.py only: per block, the global time (ns) at entry and at the
// end, the SM clock cycles since entry at each phase boundary warp 0 passes, and the SM.
__device__ long long sgmv_trace[4096][11];
__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int sm_id() {
  int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
#define TRACE_START                                     \
  const long long trace_c0 = clock64();                 \
  if (threadIdx.x == 0) {                               \
    sgmv_trace[blockIdx.x][0] = global_ns();            \
    sgmv_trace[blockIdx.x][10] = sm_id();               \
  }
#define TRACE(i) if (threadIdx.x == 0) sgmv_trace[blockIdx.x][i] = clock64() - trace_c0;
#define TRACE_END if (threadIdx.x == 0) sgmv_trace[blockIdx.x][9] = global_ns();
#else
#define TRACE_START
#define TRACE(i)
#define TRACE_END
#endif

// Block `part` of SPLIT equal, `unit`-aligned shares of [0, n).
__device__ __forceinline__ int2 share(int n, int unit, int part, int SPLIT) {
  const int per = ((n + unit - 1) / unit + SPLIT - 1) / SPLIT * unit;
  return make_int2(min(n, part * per), min(n, part * per + per));
}

// `item`: the work item this block's cluster (or, with SPLIT 1, this block) computes. SLICED:
// `a` is one slice's (sliced_body), its pointers held in registers, not read as constants.
// GX: split-K without clusters, the partials exchanged through global memory (exchange.cuh).
// G > 1 (rank groups): G clusters share the item; cluster g sums v's rank columns
// [g * RMAX / G, (g + 1) * RMAX / G) over all of h_in, the clusters trade their columns through
// global memory (share_v), and each of the item's G * SPLIT blocks expands 1 / (G * SPLIT) of
// h_out. For grids of few items at large ranks, whose one cluster per item would leave most
// SMs idle.
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W, bool SLICED = false, bool GX = false,
          int G = 1>
__device__ __forceinline__ void sgmv_body(const SgmvArgs& a, int item) {
  using TL = Tile<T, RMAX, MT, W>;
  using TS = Tile<T, RMAX / G, MT, W>;  // the shrink's rank tile
  constexpr bool CLUSTER = SPLIT > 1 && MODE != EXPAND && !GX;
  __shared__ __align__(16) float part[TL::M][RMAX];
  __shared__ __align__(16) unsigned char scratch[TL::SCRATCH];  // red, later vh
  auto vh = reinterpret_cast<T(*)[TL::RP]>(scratch);

  __shared__ IndexStage index;
  constexpr bool PIPE = MT == 1 && RMAX <= (W == 8 ? 16 : 32);  // as registers allow
  // 16-byte loads in flight per lane, as the register cap allows without spills (ptxas -v,
  // tests/test_kernels_compile.py); the shrink kernel alone keeps more addresses live
  // (sliced kernels hold their slice's pointers in registers: four loads fewer, or they spill)
  constexpr int BUDGET = (W == 8 ? 16 : MT == 1 && SPLIT <= 4 ? (MODE == SHRINK ? 28 : 30) : 24) - (SLICED ? 4 : 0);
  // B's k16 chunks an expand step loads at once. Rank 128 in clusters of 8 or 16 (few items,
  // latency-bound): 4, not 2, so the step's 8 chunks come in two round trips and the shrink keeps
  // the whole budget (the early loads no longer fit; H200 Identical B=16 -2 µs, Distinct B=1
  // -1.6). Not in clusters of 4 (many items): Distinct B=64 +3 µs without the early loads
  // (trace_runs/variants_r128.json).
  constexpr int KC = RMAX == 128 && MT == 1 && W == 4 && SPLIT >= 8 ? 4 : TL::KC;
  constexpr int STEP_LOADS = 4 * MT + 4 * KC;  // 16-byte loads per lane of one expand step
  // Decode tiles, where registers allow: the expand's first loads (B does not depend on v)
  // fly with the shrink's. (Streaming all of B beside A through shared memory was slower:
  // trace_runs/.)
  constexpr bool EARLY = MODE == EXPAND || (MODE == FUSED && MT == 1 && 2 * STEP_LOADS <= BUDGET);
  // Early-loading tiles push each block's partial of v into every peer (st.async, counted by
  // the peer's mbarrier) where the copies fit, so neither a cluster barrier nor a remote read
  // lies between the last partial and the expand (H200: -0.1 to -0.4 µs at ranks 16 and 32).
  // Not the others: with the expand's loads issued after the shrink, it was slower (rank 64
  // Distinct B=16: +0.6 µs; trace_runs/variants_async_push.json).
  constexpr bool PUSH = CLUSTER && EARLY && G == 1;
  // Rank 16 in clusters of 4 (4 expand steps per warp at h_out 4096): the expand's steps
  // as a ring of 2 (expand_ring), the second loaded while the cluster's partials meet (H200
  // Distinct B=64: -0.5 then -0.35 µs). Not at rank 32 (B=64: +0.5, ahead +0.8), nor with
  // fewer steps per warp (rank 16 B=32: +0.25), nor 3 deep (spills; trace_runs/
  // variants_expand_depth.json, variants_items_ring_halfx.json, variants_ring_ahead.json).
  constexpr bool RING = PIPE && W == 4 && RMAX == 16 && SPLIT == 4;
  constexpr int DEPTH = RING ? 2 : 1;
  __shared__ unsigned long long pushed;  // PUSH: the bytes the peers' partials have landed

  TRACE_START
  const int crank = blockIdx.x % SPLIT;
  // The scale is read only by the expand's last instructions: pushing kernels load it once the
  // slot is known, so the index round trip waits for 16 fewer lines (H200: -0.1 µs at B<=16,
  // -0.5 at rank 32 B=64, in two runs). Not the others: rank 64 B=16 +0.9 (trace_runs/
  // variants_init_late_scale_push.json).
  constexpr bool STAGE_SCALES = !PUSH;
  StagedLoads<32 * W, STAGE_SCALES> staged;  // in flight during the segment search
  staged.issue(a.slot_ids, a.nseg, a.ranks, a.scales, a.slots);
  const int segs_before = find_segment(a.indptr, a.nseg, a.tokens, TL::M, item);
  const int2 seg_rows = segment_rows(a.indptr, segs_before);
  // After the index loads are issued: the barrier's init fence held warp 0's back (H200: the
  // item is found at 1.0 µs instead of 1.3, B=16 ranks 16 and 32 -0.25 to -0.35 µs;
  // trace_runs/variants_init_scale_late.json, trace_init_late.json).
  if (PUSH) {
    if (threadIdx.x == 0) mbar_init(&pushed);
    cluster_arrive_relaxed();  // waited for before the first push: peers must have started
  }
  staged.store(index);
  __syncthreads();
  Piece pc;  // the whole cluster finds the same item, so it returns together
  if (!find_piece(a.slot_ids, index, TL::M, item, segs_before, seg_rows, pc)) return;
  TRACE(1)
  if (!adapter_rank<STAGE_SCALES>(a.ranks, a.scales, index, a.max_rank, pc)) return;
  TRACE(2)
  const int group = G > 1 ? blockIdx.x / SPLIT % G : 0;
  const int2 ks = share(a.h_in, 32, crank, SPLIT), cs = share(a.h_out, 64, group * SPLIT + crank, G * SPLIT);
  const bool push = PUSH && SPLIT * pc.rows <= TL::M;  // the SPLIT copies of the partial fit in part
  if (push && threadIdx.x == 0) {
    constexpr int NG = TL::NTG * 8;  // rank columns per shrink pass, each pushed whole
    mbar_expect_tx(&pushed, SPLIT * ((pc.rank + NG - 1) / NG) * pc.rows * NG * sizeof(float));
  }
  // ExpandLanes is built where each use is: one copy held through the shrink cost rank 64
  // B=16 0.4 µs (trace_runs/variants_expand_lanes_late.json).
  StepLoads<MT, KC> ring[DEPTH];  // ring[0]: the warp's first expand step
  const int first_col = cs.x + (threadIdx.x >> 5) * 64;
  if (EARLY) load_step(ring[0], ExpandLanes<T>(a, pc), pc, first_col, cs.y);
  if (MODE == EXPAND) {
    load_v<T, RMAX, MT, W, VT>(a, pc, vh);
  } else {
    constexpr int LOADS = BUDGET - (EARLY ? STEP_LOADS : 0);
    constexpr int U = cmax(1, cmin(8, LOADS / (2 * MT + TS::NTG)));
    float* red = reinterpret_cast<float*>(scratch);
    // Items of at most 8 rows (Distinct decode) load no x rows 8..15, so more of A is in
    // flight: rank 16 in clusters of 4 reads its k-share in one round, not two (H200,
    // Distinct B=64 -0.2 µs; B=32 -0.2, trace_runs/variants_halfx_rounds_blk0.json). Rank 16
    // in 4-warp blocks only: rank 32 B=64 was 0.3 µs slower (U 3 -> 4,
    // trace_runs/variants_items_ring_halfx.json), at 64 U stays, 128 and 8-warp blocks spill.
    constexpr int UH = cmax(1, cmin(8, (LOADS + 2) / (1 + TL::NTG)));
    if (MT == 1 && W == 4 && RMAX == 16 && pc.rows <= 8)
      shrink_partial<T, RMAX, MT, W, UH, 1, SPLIT, PUSH>(a, pc, ks, part, red, push, crank, &pushed);
    else
      shrink_partial<T, RMAX, MT, W, U, 2, SPLIT, PUSH, RMAX / G>(a, pc, ks, part, red, push, crank, &pushed,
                                                                    group * (RMAX / G));
    TRACE(3)
    const int xitem = blockIdx.y * (gridDim.x / SPLIT) + item;  // across slices
    if (GX) exchange_partial<TL::M, RMAX, SPLIT, W>(a.xpart, a.xcount, part, pc.rows, (pc.rank + 15) & ~15, xitem, crank);
    // The arrive's release waits for every earlier access of the thread, loads included
    // (so the expand's loads, unless EARLY, are issued after it and fly while the cluster
    // gathers), and costs a fence per warp: one warp releases the partial, which
    // shrink_partial's closing __syncthreads ordered after every warp's writes, and the
    // others arrive relaxed (H200: -0.3 to -0.6 µs at rank 64 and for prefill, same elsewhere).
    const bool pull = CLUSTER && !push;
    if (pull) {
      if (threadIdx.x >> 5 == W - 1) cluster_arrive();  // the partial is released to the cluster
      else cluster_arrive_relaxed();
    }
    if (MODE == FUSED && !EARLY) load_step(ring[0], ExpandLanes<T>(a, pc), pc, first_col, cs.y);
    if (RING) load_ring<T, MT, KC, W, DEPTH>(ring, ExpandLanes<T>(a, pc), pc, cs);
    if (pull) cluster_wait();  // every block's partial is visible
    if (push) mbar_wait(&pushed, 0);  // every block's partial has landed here
    TRACE(4)
    // v's columns this cluster sums, in the expand's 16-column steps (the rank's, rounded up)
    const int rr = (pc.rank + 15) & ~15;
    const int2 cols =
        G > 1 ? make_int2(min(rr, group * (RMAX / G)), min(rr, (group + 1) * (RMAX / G))) : make_int2(0, rr);
    reduce_partials<T, RMAX, MT, SPLIT, W, VT, GX, (G > 1)>(a, pc, crank, part, vh, MODE == FUSED, push, xitem, cols);
    if (pull) cluster_arrive_relaxed();  // done reading the peers' partials
    if (G > 1) share_v<T, TL::M, RMAX, G * SPLIT, W>(a.xpart, a.xcount, vh, pc.rows, cols, rr, xitem, crank == 0);
    TRACE(5)
  }
  if (MODE != SHRINK) {
    __syncthreads();
    TRACE(6)
    if (RING) expand_ring<T, RMAX, MT, W, DEPTH>(ExpandLanes<T>(a, pc), pc, cs, vh, ring);
    else expand_tile<T, RMAX, MT, W, PIPE>(ExpandLanes<T>(a, pc), pc, cs, vh, ring[0]);
    TRACE(7)
  }
  if (CLUSTER && !push) cluster_wait();  // peers may still read our partials until here
  TRACE(8)
  TRACE_END
}

// Blocks per SM the registers must allow: 3 for 4-warp blocks (ops/sgmv.py sizes
// decode grids to at most ~2.1 blocks per SM, 2.5 when partials meet in L2, so no second
// wave), 2 for 32-row tiles and for 8-warp blocks (forced only: the sweep's).
#define MINB (W == 8 || MT == 2 ? 2 : 3)

// W warps per block: 4 (the defaults), or 8 (each warp's share of an item halves). Without
// clusters, a fused kernel splits K over SPLIT blocks through global memory (GX).
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__global__ void __launch_bounds__(32 * W, MINB) sgmv_kernel(const SgmvArgs a) {
  static_assert(MODE != SHRINK || SPLIT == 1, "split-K shrink needs the cluster kernel");
  sgmv_body<T, RMAX, MT, SPLIT, MODE, VT, W, false, MODE == FUSED && SPLIT != 1>(a, blockIdx.x / SPLIT);
}

// A sliced add-on: the members of a fused projection (q|k|v, gate|up) in one launch, over the
// same x and segments, each slice with its own pools, slot ids and output columns. The grid's
// row blockIdx.y is the slice, so `item` stays a function of blockIdx.x (as registers allow).
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W, bool GX, int G = 1>
__device__ __forceinline__ void sliced_body(const SgmvSlices& s) {
  static_assert(MODE == FUSED, "slices: the fused add-on only");
  const SgmvArgs& b = s.base;
  const int slice = blockIdx.y;
  SgmvArgs a = b;
  if (slice > 0) {  // constant indices only: a dynamic index would copy the parameters to local memory
    const SliceArgs& m = slice == 1 ? s.more[0] : s.more[1];
    a.A = m.A, a.B = m.B, a.slot_ids = m.slot_ids, a.b_slot = m.b_slot, a.h_out = m.h_out;
    a.y = static_cast<T*>(b.y) + m.y_shift;
  }
  sgmv_body<T, RMAX, MT, SPLIT, MODE, VT, W, true, GX, G>(a, blockIdx.x / SPLIT / G);
}

template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__global__ void __launch_bounds__(32 * W, MINB) sgmv_sliced_kernel(const SgmvSlices s) {
  sliced_body<T, RMAX, MT, SPLIT, MODE, VT, W, SPLIT != 1>(s);
}

#if __CUDA_ARCH__ >= 900
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__global__ void __launch_bounds__(32 * W, MINB) __cluster_dims__(SPLIT, 1, 1) sgmv_cluster_kernel(const SgmvArgs a) {
  sgmv_body<T, RMAX, MT, SPLIT, MODE, VT, W>(a, blockIdx.x / SPLIT);
}

// The fused add-on in rank groups: G clusters per item (sgmv_body). Its blocks wait for the
// other clusters of their item, so ops/sgmv.py launches it only for grids the GPU holds at once.
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W, int G>
__global__ void __launch_bounds__(32 * W, MINB) __cluster_dims__(SPLIT, 1, 1) sgmv_grouped_kernel(const SgmvArgs a) {
  static_assert(MODE == FUSED && G > 1 && RMAX % (16 * G) == 0, "rank groups: the fused add-on, 16-column groups");
  sgmv_body<T, RMAX, MT, SPLIT, MODE, VT, W, false, false, G>(a, blockIdx.x / SPLIT / G);
}

template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__global__ void __launch_bounds__(32 * W, MINB) __cluster_dims__(SPLIT, 1, 1) sgmv_sliced_cluster_kernel(const SgmvSlices s) {
  sliced_body<T, RMAX, MT, SPLIT, MODE, VT, W, false>(s);
}

template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W, int G>
__global__ void __launch_bounds__(32 * W, MINB) __cluster_dims__(SPLIT, 1, 1) sgmv_sliced_grouped_kernel(const SgmvSlices s) {
  static_assert(MODE == FUSED && G > 1 && RMAX % (16 * G) == 0, "rank groups: the fused add-on, 16-column groups");
  sliced_body<T, RMAX, MT, SPLIT, MODE, VT, W, false, G>(s);
}
#endif
