// SGMV: per segment of rows, v = x @ A[slot].T (shrink) and y += scale * v @ B[slot] (expand).
//
// One work item = one segment's rows inside an M-row block (segments.cuh).
// SPLIT blocks share an item: in the shrink each reads 1/SPLIT of h_in
// (split-K), in the expand each writes 1/SPLIT of h_out. The fused kernel runs
// the SPLIT blocks as one thread-block cluster (sm_90): partial sums of v meet
// in distributed shared memory, so shrink + expand is one launch and v never
// leaves the chip.
//
// Tensor cores do all the products (mma m16n8k16, fp32 accumulate), fed
// straight from 16-byte global loads without shared-memory staging:
// - shrink: a dot product does not care in which order k is summed, so each
//   lane's 8 consecutive k of x and of A fill its fragment slots of two MMAs.
// - expand: the output columns are permuted instead. Lane (g, q) loads 8
//   consecutive columns of 4 rows of B, so in n-tile j logical column n is
//   physical column 8n + j; the accumulator then holds 16 consecutive columns
//   of each row, written back with 16-byte stores.
// Rows beyond the piece and ranks beyond the adapter's rank are never loaded.
#include "cluster.cuh"
#include "dtype.cuh"
#include "segments.cuh"

enum Mode { SHRINK = 0, EXPAND = 1, FUSED = 2 };

#ifdef SGMV_TRACE
// benchmarks/sgmv_trace.py only: per block, the global time (ns) at entry and at the
// end, and the SM clock cycles since entry at each phase boundary warp 0 passes.
__device__ long long sgmv_trace[4096][10];
__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define TRACE_START const long long trace_c0 = clock64(); if (threadIdx.x == 0) sgmv_trace[blockIdx.x][0] = global_ns();
#define TRACE(i) if (threadIdx.x == 0) sgmv_trace[blockIdx.x][i] = clock64() - trace_c0;
#define TRACE_END if (threadIdx.x == 0) sgmv_trace[blockIdx.x][9] = global_ns();
#else
#define TRACE_START
#define TRACE(i)
#define TRACE_END
#endif

struct SgmvArgs {
  const void* x;
  void* y;  // already offset to the first output column
  void* v;  // may be null in FUSED mode
  const void* A;
  const void* B;
  const int* indptr;
  const int* slot_ids;
  const int* ranks;
  const float* scales;
  long long x_stride, y_stride, v_stride;  // row strides, elements
  long long a_slot, b_slot;                // pool slot strides, elements
  int nseg, tokens, h_in, h_out, max_rank, prefetch, slots;
};

__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <class T, int RMAX, int MT, int W = 4>
struct Tile {
  static constexpr int M = 16 * MT;                      // rows per item
  static constexpr int NTG = cmin(RMAX / 8, 8 / MT);     // rank n-tiles per shrink pass
  static constexpr int RP = RMAX + 8;                    // padded vh row: no bank conflicts
  static constexpr int RED_BYTES = W * M * NTG * 8 * 4;  // per-warp partials of one pass
  static constexpr int VH_BYTES = M * RP * 2;
  static constexpr int SCRATCH = cmax(RED_BYTES, VH_BYTES);
  // k16 chunks of B an expand step loads at once, as registers allow
  static constexpr int KC = RMAX <= (W == 8 ? 32 : 64) ? RMAX / 16 : 2;
  static constexpr int STEP_LOADS = 4 * MT + 4 * KC;  // 16-byte loads per lane of one expand step
};

// Prefetch rows [0, nrows) x columns [c0, c1) of a row-major matrix into L2, so
// every DRAM request of the block is in flight from its first microsecond.
template <class T>
__device__ __forceinline__ void prefetch_rows(const T* base, long long stride, int nrows, int c0, int c1) {
  const int lines = ((c1 - c0) * int(sizeof(T)) + 127) / 128;
  for (int idx = threadIdx.x; idx < nrows * lines; idx += blockDim.x) {
    const T* row = base + (long long)(idx / lines) * stride + c0;
    prefetch_l2(reinterpret_cast<const char*>(row) + (idx % lines) * 128);
  }
}

// Block `part` of SPLIT equal, `unit`-aligned shares of [0, n).
__device__ __forceinline__ int2 share(int n, int unit, int part, int SPLIT) {
  const int per = ((n + unit - 1) / unit + SPLIT - 1) / SPLIT * unit;
  return make_int2(min(n, part * per), min(n, part * per + per));
}

// Shrink partial of this block's k-share: part[m][n] = sum_k x[m][k] * A[n][k].
template <class T, int RMAX, int MT, int W, int U>
__device__ __forceinline__ void shrink_partial(const SgmvArgs& a, const Piece& pc, int2 ks,
                                               float (*part)[RMAX], float* red) {
  using TL = Tile<T, RMAX, MT, W>;
  constexpr int NTG = TL::NTG, M = TL::M;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int nsteps = (ks.y - ks.x + 31) / 32;
  const T* x = static_cast<const T*>(a.x) + (long long)pc.start * a.x_stride;
  const T* A = static_cast<const T*>(a.A) + (long long)pc.slot * a.a_slot;
  for (int n0 = 0; n0 < pc.rank; n0 += NTG * 8) {
    float acc[MT][NTG][4] = {};
    // A warp takes U consecutive 64-byte steps of each row: whole 128-byte lines.
    for (int s0 = w * U; s0 < nsteps; s0 += W * U) {
      uint4 xv[U][MT][2], av[U][NTG];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int s = s0 + u, k = ks.x + s * 32 + q * 8;
        const bool kin = s < nsteps && k < ks.y;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = mt * 16 + h * 8 + g;
            xv[u][mt][h] = ldg16(x + (long long)row * a.x_stride + k, kin && row < pc.rows);
          }
#pragma unroll
        for (int nt = 0; nt < NTG; ++nt) {
          const int n = n0 + nt * 8 + g;
          av[u][nt] = ldg16(A + (long long)n * a.h_in + k, kin && n < pc.rank);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NTG; ++nt) {
            const uint4 &lo = xv[u][mt][0], &hi = xv[u][mt][1], &b = av[u][nt];
            DType<T>::mma(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
            DType<T>::mma(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
          }
    }
    // Sum the warps' partials of this rank group in a fixed order (deterministic).
    constexpr int NG = NTG * 8;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTG; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = mt * 16 + g + (c >> 1) * 8, col = nt * 8 + 2 * q + (c & 1);
          red[(w * M + row) * NG + col] = acc[mt][nt][c];
        }
    __syncthreads();
    for (int e = threadIdx.x; e < pc.rows * NG; e += 32 * W) {
      float s = 0.f;
#pragma unroll
      for (int ww = 0; ww < W; ++ww) s += red[ww * M * NG + e];
      part[e / NG][n0 + e % NG] = s;
    }
    __syncthreads();
  }
}

// v tile = sum over the SPLIT blocks' partials (distributed shared memory when
// SPLIT > 1); lands in vh (activation dtype, MMA operand) and optionally in v.
template <class T, int RMAX, int MT, int SPLIT, int W, class VT>
__device__ __forceinline__ void reduce_partials(const SgmvArgs& a, const Piece& pc, int crank,
                                                float (*part)[RMAX], T (*vh)[Tile<T, RMAX, MT>::RP],
                                                bool keep_vh) {
  const int rr = (pc.rank + 15) & ~15, quads = rr / 4;
  VT* v = static_cast<VT*>(a.v);
  // Rows past the piece are left as they are: an MMA row only feeds its own output row,
  // and those are never stored (Distinct: 1 row in 16, so 1/16 of the remote reads).
  for (int e = threadIdx.x; e < pc.rows * quads; e += 32 * W) {
    const int m = e / quads, n = (e % quads) * 4;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < SPLIT; ++c) {
      const float4 p = SPLIT > 1 ? ld_dsmem_f4(dsmem_addr(&part[m][n], c))
                                 : *reinterpret_cast<const float4*>(&part[m][n]);
      s.x += p.x, s.y += p.y, s.z += p.z, s.w += p.w;
    }
    const float sv[4] = {s.x, s.y, s.z, s.w};
    if (keep_vh) {
#pragma unroll
      for (int i = 0; i < 4; ++i) vh[m][n + i] = DType<T>::from_float(sv[i]);
    }
    if (v != nullptr && e % SPLIT == crank) {
      VT* out = v + (long long)(pc.start + m) * a.v_stride + n;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (n + i < pc.rank) store_float(out + i, sv[i]);
    }
  }
}

// Standalone expand: the v tile comes from global memory.
template <class T, int RMAX, int MT, int W, class VT>
__device__ __forceinline__ void load_v(const SgmvArgs& a, const Piece& pc, T (*vh)[Tile<T, RMAX, MT>::RP]) {
  const int rr = (pc.rank + 15) & ~15;
  const VT* v = static_cast<const VT*>(a.v) + (long long)pc.start * a.v_stride;
  for (int e = threadIdx.x; e < Tile<T, RMAX, MT>::M * rr; e += 32 * W) {
    const int m = e / rr, n = e % rr;
    const float val = m < pc.rows && n < pc.rank ? load_as_float(v + (long long)m * a.v_stride + n) : 0.f;
    vh[m][n] = DType<T>::from_float(val);
  }
}

// The loads of one 64-column expand step that need no v: the y tile (read-
// modify-write) and B's first KC k16 chunks (every chunk up to rank 64), all
// issued together so a step costs one memory round trip, not one per chunk.
template <int MT, int KC>
struct StepLoads {
  uint4 y[MT][2][2];  // [row tile][row g / g+8][columns 16q.. / 16q+8..]
  uint4 b[KC][4];     // per chunk kk: B rows 16kk + 2q, 2q+1, 2q+8, 2q+9, columns 8g..
};

template <class T>
__device__ __forceinline__ void load_b_k16(uint4 (&br)[4], const T* B, int h_out, int rank, int kk, int cb, int cend) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = kk * 16 + 2 * q + (i & 1) + (i >> 1) * 8, col = cb + 8 * g;
    br[i] = ldg16(B + (long long)k * h_out + col, k < rank && col < cend);
  }
}

template <class T, int MT>
__device__ __forceinline__ void load_y(uint4 (&yv)[MT][2][2], const SgmvArgs& a, const Piece& pc, int cb, int cend) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const T* y = static_cast<const T*>(a.y) + (long long)pc.start * a.y_stride;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = mt * 16 + h * 8 + g, col = cb + 16 * q + 8 * hf;
        yv[mt][h][hf] = ldg16(y + (long long)row * a.y_stride + col, row < pc.rows && col < cend);
      }
}

template <class T, int MT, int KC>
__device__ __forceinline__ void load_step(StepLoads<MT, KC>& st, const SgmvArgs& a, const Piece& pc, int cb, int cend) {
  load_y<T, MT>(st.y, a, pc, cb, cend);
  const T* B = static_cast<const T*>(a.B) + (long long)pc.slot * a.b_slot;
#pragma unroll
  for (int kk = 0; kk < KC; ++kk) load_b_k16(st.b[kk], B, a.h_out, pc.rank, kk, cb, cend);  // masked past the rank
}

// acc += vh[:, 16kk..] @ B rows 16kk.. (columns permuted: see the top of the file).
template <class T, int RMAX, int MT>
__device__ __forceinline__ void mma_k16(float (&acc)[MT][8][4], const uint4 (&br)[4],
                                        const T (*vh)[Tile<T, RMAX, MT>::RP], int kk) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const unsigned *r0 = &br[0].x, *r1 = &br[1].x, *r2 = &br[2].x, *r3 = &br[3].x;
  unsigned b0[8], b1[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // pair up k = 2q, 2q+1 (and +8) of one column
    b0[2 * i] = __byte_perm(r0[i], r1[i], 0x5410);
    b0[2 * i + 1] = __byte_perm(r0[i], r1[i], 0x7632);
    b1[2 * i] = __byte_perm(r2[i], r3[i], 0x5410);
    b1[2 * i + 1] = __byte_perm(r2[i], r3[i], 0x7632);
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r = mt * 16 + g, k = kk * 16 + 2 * q;
    const unsigned a0 = *reinterpret_cast<const unsigned*>(&vh[r][k]);
    const unsigned a1 = *reinterpret_cast<const unsigned*>(&vh[r + 8][k]);
    const unsigned a2 = *reinterpret_cast<const unsigned*>(&vh[r][k + 8]);
    const unsigned a3 = *reinterpret_cast<const unsigned*>(&vh[r + 8][k + 8]);
#pragma unroll
    for (int j = 0; j < 8; ++j) DType<T>::mma(acc[mt][j], a0, a1, a2, a3, b0[j], b1[j]);
  }
}

// y = y + scale * acc, rounded once; each lane owns 16 consecutive columns of two rows.
template <class T, int MT>
__device__ __forceinline__ void store_step(const SgmvArgs& a, const Piece& pc, const uint4 (&yv)[MT][2][2],
                                           const float (&acc)[MT][8][4], int cb, int cend) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  T* y = static_cast<T*>(a.y) + (long long)pc.start * a.y_stride;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = mt * 16 + h * 8 + g, col = cb + 16 * q + 8 * hf;
        if (row >= pc.rows || col >= cend) continue;
        const unsigned* old = &yv[mt][h][hf].x;
        uint4 out;
        unsigned* o = &out.x;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = DType<T>::unpack(old[i]);
          o[i] = DType<T>::pack(f.x + pc.scale * acc[mt][2 * i][2 * h + hf],
                                f.y + pc.scale * acc[mt][2 * i + 1][2 * h + hf]);
        }
        *reinterpret_cast<uint4*>(y + (long long)row * a.y_stride + col) = out;
      }
}

// y[rows, cs] += scale * vh @ B[slot][:, cs] over this block's column share cs;
// `cur` holds the loads of the warp's first step, issued before v was ready.
// PIPE (as registers allow): step s + 1 is loaded before step s is computed.
template <class T, int RMAX, int MT, int W, bool PIPE>
__device__ __forceinline__ void expand_tile(const SgmvArgs& a, const Piece& pc, int2 cs,
                                            const T (*vh)[Tile<T, RMAX, MT>::RP],
                                            StepLoads<MT, Tile<T, RMAX, MT, W>::KC> cur) {
  constexpr int KC = Tile<T, RMAX, MT, W>::KC;
  const int w = threadIdx.x >> 5;
  const int ksteps = (pc.rank + 15) / 16, nsteps = (cs.y - cs.x + 63) / 64;
  const T* B = static_cast<const T*>(a.B) + (long long)pc.slot * a.b_slot;
  for (int s = w; s < nsteps; s += W) {
    const int cb = cs.x + s * 64;
    StepLoads<MT, KC> next;
    if (PIPE) load_step<T, MT>(next, a, pc, cb + W * 64, cs.y);  // masked off past the share
    float acc[MT][8][4] = {};
#pragma unroll
    for (int kk = 0; kk < KC; ++kk) {
      if (kk >= ksteps) break;
      mma_k16<T, RMAX, MT>(acc, cur.b[kk], vh, kk);
    }
#pragma unroll
    for (int kk = KC; kk < RMAX / 16; ++kk) {  // rank 128: the rest chunk by chunk
      if (kk >= ksteps) break;
      uint4 br[4];
      load_b_k16(br, B, a.h_out, pc.rank, kk, cb, cs.y);
      mma_k16<T, RMAX, MT>(acc, br, vh, kk);
    }
    store_step<T, MT>(a, pc, cur.y, acc, cb, cs.y);
    if (PIPE) cur = next;
    else load_step<T, MT>(cur, a, pc, cb + W * 64, cs.y);
  }
}

// Only where few blocks share the chip (the host decides): L2 prefetch of
// every row the block will touch, issued before the adapter's rank is known
// (up to the pool's max rank), so DRAM latency overlaps the index loads.
template <class T, int MODE>
__device__ __forceinline__ void prefetch_piece(const SgmvArgs& a, const Piece& pc, int2 ks, int2 cs) {
  if (MODE != EXPAND) {
    prefetch_rows(static_cast<const T*>(a.A) + (long long)pc.slot * a.a_slot, a.h_in, a.max_rank, ks.x, ks.y);
    prefetch_rows(static_cast<const T*>(a.x) + (long long)pc.start * a.x_stride, a.x_stride, pc.rows, ks.x, ks.y);
  }
  if (MODE != SHRINK) {
    prefetch_rows(static_cast<const T*>(a.B) + (long long)pc.slot * a.b_slot, a.h_out, a.max_rank, cs.x, cs.y);
    prefetch_rows(static_cast<const T*>(a.y) + (long long)pc.start * a.y_stride, a.y_stride, pc.rows, cs.x, cs.y);
  }
}

template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__device__ __forceinline__ void sgmv_body(const SgmvArgs& a) {
  using TL = Tile<T, RMAX, MT, W>;
  constexpr bool CLUSTER = SPLIT > 1 && MODE != EXPAND;
  __shared__ __align__(16) float part[TL::M][RMAX];
  __shared__ __align__(16) unsigned char scratch[TL::SCRATCH];  // red, later vh
  auto vh = reinterpret_cast<T(*)[TL::RP]>(scratch);

  __shared__ IndexStage index;

  TRACE_START
  const int crank = blockIdx.x % SPLIT;
  StagedLoads<32 * W> staged;  // in flight during the segment search
  staged.issue(a.slot_ids, a.nseg, a.ranks, a.scales, a.slots);
  const int segs_before = find_segment(a.indptr, a.nseg, a.tokens, TL::M, blockIdx.x / SPLIT);
  staged.store(index);
  __syncthreads();
  Piece pc;  // the whole cluster finds the same item, so it returns together
  if (!find_piece(a.indptr, a.slot_ids, index, TL::M, blockIdx.x / SPLIT, segs_before, pc)) return;
  TRACE(1)
  const int2 ks = share(a.h_in, 32, crank, SPLIT), cs = share(a.h_out, 64, crank, SPLIT);
  if (a.prefetch) prefetch_piece<T, MODE>(a, pc, ks, cs);
  if (!adapter_rank(a.ranks, a.scales, index, a.max_rank, pc)) return;
  TRACE(2)
  constexpr bool PIPE = MT == 1 && RMAX <= (W == 8 ? 16 : 32);  // as registers allow
  // 16-byte loads in flight per lane, as the register cap allows
  constexpr int BUDGET = W == 8 ? 16 : MT == 1 && SPLIT <= 4 ? 32 : 24;
  // Decode tiles, where registers allow: the expand's first loads (B does not depend on v)
  // fly with the shrink's. (Streaming all of B beside A through shared memory was slower:
  // benchmarks/results/trace_runs.)
  constexpr bool EARLY = MODE == EXPAND || (MODE == FUSED && MT == 1 && 2 * TL::STEP_LOADS <= BUDGET);
  StepLoads<MT, TL::KC> first;
  const int first_col = cs.x + (threadIdx.x >> 5) * 64;
  if (EARLY) load_step<T, MT>(first, a, pc, first_col, cs.y);
  if (MODE == EXPAND) {
    load_v<T, RMAX, MT, W, VT>(a, pc, vh);
  } else {
    constexpr int LOADS = BUDGET - (EARLY ? TL::STEP_LOADS : 0);
    constexpr int U = cmax(1, cmin(8, LOADS / (2 * MT + TL::NTG)));
    shrink_partial<T, RMAX, MT, W, U>(a, pc, ks, part, reinterpret_cast<float*>(scratch));
    TRACE(3)
    // The arrive's release waits for every earlier access of the thread, loads included:
    // the expand's loads are issued after it, so they fly while the cluster gathers.
    if (CLUSTER) cluster_arrive();  // this block's partial is released to the cluster
    if (MODE == FUSED && !EARLY) load_step<T, MT>(first, a, pc, first_col, cs.y);
    if (CLUSTER) cluster_wait();  // every block's partial is visible
    TRACE(4)
    reduce_partials<T, RMAX, MT, SPLIT, W, VT>(a, pc, crank, part, vh, MODE == FUSED);
    if (CLUSTER) cluster_arrive_relaxed();  // done reading the peers' partials
    TRACE(5)
  }
  if (MODE != SHRINK) {
    __syncthreads();
    TRACE(6)
    expand_tile<T, RMAX, MT, W, PIPE>(a, pc, cs, vh, first);
    TRACE(7)
  }
  if (CLUSTER) cluster_wait();  // peers may still read our partials until here
  TRACE(8)
  TRACE_END
}

// Blocks per SM the registers must allow: 3 for 4-warp blocks (ops/sgmv.py sizes
// decode grids to at most ~2.1 blocks per SM, so no second wave), 2 for 32-row tiles
// and for 8-warp blocks (forced only: the sweep's).
#define MINB (W == 8 || MT == 2 ? 2 : 3)

// W warps per block: 4 (the defaults), or 8 (each warp's share of an item halves).
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__global__ void __launch_bounds__(32 * W, MINB) sgmv_kernel(const SgmvArgs a) {
  static_assert(MODE == EXPAND || SPLIT == 1, "split-K needs the cluster kernel");
  sgmv_body<T, RMAX, MT, SPLIT, MODE, VT, W>(a);
}

#if __CUDA_ARCH__ >= 900
template <class T, int RMAX, int MT, int SPLIT, int MODE, class VT, int W>
__global__ void __launch_bounds__(32 * W, MINB) __cluster_dims__(SPLIT, 1, 1) sgmv_cluster_kernel(const SgmvArgs a) {
  sgmv_body<T, RMAX, MT, SPLIT, MODE, VT, W>(a);
}
#endif
