// The shrink half of SGMV: a block's split-K partial of v = x @ A[slot].T on tensor
// cores, and the sum of the cluster's partials in distributed shared memory.
//
// A dot product does not care in which order k is summed, so each lane's 8
// consecutive k of x and of A fill its fragment slots of two MMAs straight from
// 16-byte global loads.
#pragma once
#include "args.cuh"
#include "cluster.cuh"
#include "dtype.cuh"
#include "exchange.cuh"
#include "segments.cuh"

// The block's partial of rank columns [n0, n0 + NG) (its warps' partials summed in the same
// fixed order as in shrink_partial) stored into every peer's part, rows
// [crank * rows, (crank + 1) * rows), counted by the peer's mbarrier `bar`.
template <int M, int NG, int SPLIT, int W, int RMAX>
__device__ __forceinline__ void push_partial(const float* red, float (*part)[RMAX], int rows, int n0, int crank,
                                             unsigned long long* bar) {
  constexpr int Q = NG / 4;
  for (int e = threadIdx.x; e < rows * Q * SPLIT; e += 32 * W) {
    const int c = e % SPLIT, row = e / SPLIT / Q, col = e / SPLIT % Q * 4;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int ww = 0; ww < W; ++ww) {
      const float4 p = *reinterpret_cast<const float4*>(&red[(ww * M + row) * NG + col]);
      s.x += p.x, s.y += p.y, s.z += p.z, s.w += p.w;
    }
    st_async_f4(dsmem_addr(&part[crank * rows + row][n0 + col], c), s, dsmem_addr(bar, c));
  }
}

// r1, r2: a lane's loads of a whole-line pair (shrink_partial); afterwards its own row's two
// steps. The partner lane differs in the lowest bit of g (lane ^ 4).
__device__ __forceinline__ void exchange_pair(uint4& r1, uint4& r2, int e) {
  const uint4 send = e ? r1 : r2, keep = e ? r2 : r1;
  r2.x = __shfl_xor_sync(0xffffffffu, send.x, 4);
  r2.y = __shfl_xor_sync(0xffffffffu, send.y, 4);
  r2.z = __shfl_xor_sync(0xffffffffu, send.z, 4);
  r2.w = __shfl_xor_sync(0xffffffffu, send.w, 4);
  r1 = keep;
}

// Shrink partial of this block's k-share: part[m][n] = sum_k x[m][k] * A[n][k].
// PUSH kernels (sgmv_body): the first pass waits at the cluster barrier the block arrived
// at on entry; with `push` the partial goes to the peers (push_partial) instead of part.
// H: x row halves (of 8) loaded per row tile; with 1, rows 8..15 are zeros (items of at
// most 8 rows, MT 1) and their loads' registers carry more of A. Rank groups (sgmv_body): the
// columns [lo, lo + RS) only, in passes of RS's tile.
template <class T, int RMAX, int MT, int W, int U, int H, int SPLIT, bool PUSH, int RS = RMAX>
__device__ __forceinline__ void shrink_partial(const SgmvArgs& a, const Piece& pc, int2 ks, float (*part)[RMAX],
                                               float* red, bool push, int crank, unsigned long long* bar,
                                               int lo = 0) {
  using TL = Tile<T, RS, MT, W>;
  constexpr int NTG = TL::NTG, M = TL::M;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int nsteps = (ks.y - ks.x + 31) / 32;
  const T* x = static_cast<const T*>(a.x) + (long long)pc.start * a.x_stride;
  const T* A = static_cast<const T*>(a.A) + (long long)pc.slot * a.a_slot;
  // A lane's 16 bytes of A fill its MMA slots only for its own row g, so one load reads half
  // a line of each of 8 rows. Rank 64 (decode, clusters of 8 or 16) pairs steps: lanes
  // g = 2p + e read row 2p at step u + e, then row 2p + 1 at step u + 1 - e (u even), each a
  // whole line of 4 rows, and trade halves (exchange_pair): half the requests for the same
  // bytes (H200 Distinct B16 -0.3 to -0.4, B32 -0.8 to -1.0 us in four runs). Not at ranks
  // 16 and 32, where whole lines gained nothing and the exchange cost r16 B1 +0.55, nor 128
  // (+0.03 to +0.15), nor in clusters of 4 (spills; trace_runs/
  // variants_full_lines.json, variants_whole_lines_ab.json).
  constexpr bool WHOLE = MT == 1 && RS == 64 && SPLIT >= 8;
  const int hi = RS == RMAX ? pc.rank : min(pc.rank, lo + RS);
  for (int n0 = lo; n0 < hi; n0 += NTG * 8) {
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
            xv[u][mt][h] = h < H ? ldg16(x + (long long)row * a.x_stride + k, kin && row < pc.rows)
                                 : make_uint4(0u, 0u, 0u, 0u);
          }
        const bool pair = WHOLE && ((u & 1) || u + 1 < U);
        const int sa = pair ? s0 + (u & ~1) + ((u & 1) ^ (g & 1)) : s, ka = ks.x + sa * 32 + q * 8;
#pragma unroll
        for (int nt = 0; nt < NTG; ++nt) {
          const int n = n0 + nt * 8 + (pair ? (g & ~1) + (u & 1) : g);
          av[u][nt] = ldg16_stream(A + (long long)n * a.h_in + ka, sa < nsteps && ka < ks.y && n < hi);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (WHOLE && !(u & 1) && u + 1 < U)
#pragma unroll
          for (int nt = 0; nt < NTG; ++nt) exchange_pair(av[u][nt], av[u + 1][nt], g & 1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NTG; ++nt) {
            const uint4 &lo = xv[u][mt][0], &hi = xv[u][mt][1], &b = av[u][nt];
            DType<T>::mma(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
            DType<T>::mma(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
          }
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
    if (PUSH && n0 == lo) cluster_wait();  // every peer has started and initialised its mbarrier
    if (push) {
      push_partial<M, NG, SPLIT, W>(red, part, pc.rows, n0, crank, bar);
    } else {
      for (int e = threadIdx.x; e < pc.rows * NG; e += 32 * W) {
        float s = 0.f;
#pragma unroll
        for (int ww = 0; ww < W; ++ww) s += red[ww * M * NG + e];
        part[e / NG][n0 + e % NG] = s;
      }
    }
    __syncthreads();
  }
}

// v tile = sum over the SPLIT blocks' partials, partial c of element (m, n..n+3) read by
// `peer(c, m, n)`; lands in vh (activation dtype, MMA operand) and optionally in v.
// Indexed by compile-time quads per row, and one loop per source (reduce_partials), so
// the few threads on this latency-bound path run no division and no untaken loads.
// LOW: columns start at cols.x, not 0 (rank groups).
template <class T, int RMAX, int MT, int SPLIT, int W, class VT, bool LOW, class Peer>
__device__ __forceinline__ void reduce_rows(const SgmvArgs& a, const Piece& pc, int crank,
                                            T (*vh)[Tile<T, RMAX, MT>::RP], bool keep_vh, int2 cols, Peer peer) {
  constexpr int Q = RMAX / 4;
  VT* v = static_cast<VT*>(a.v);
  // Rows past the piece are left as they are: an MMA row only feeds its own output row,
  // and those are never stored (Distinct: 1 row in 16, so 1/16 of the remote reads).
  for (int e = threadIdx.x; e < pc.rows * Q; e += 32 * W) {
    const int m = e / Q, n = e % Q * 4;
    if ((LOW && n < cols.x) || n >= cols.y) continue;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < SPLIT; ++c) {
      const float4 p = peer(c, m, n);
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

// The partials are read from this block's part (one block, or the copies the peers pushed),
// from the peers' shared memory, or (GX) from the global workspace; v's columns [cols.x, cols.y).
template <class T, int RMAX, int MT, int SPLIT, int W, class VT, bool GX, bool LOW>
__device__ __forceinline__ void reduce_partials(const SgmvArgs& a, const Piece& pc, int crank,
                                                float (*part)[RMAX], T (*vh)[Tile<T, RMAX, MT>::RP],
                                                bool keep_vh, bool push, int xitem, int2 cols) {
  constexpr int M = Tile<T, RMAX, MT>::M;
  auto local = [&](int c, int m, int n) { return *reinterpret_cast<const float4*>(&part[c * pc.rows + m][n]); };
  auto remote = [&](int c, int m, int n) { return ld_dsmem_f4(dsmem_addr(&part[m][n], c)); };
  auto global = [&](int c, int m, int n) { return peer_partial<M, RMAX, SPLIT>(a.xpart, xitem, c, m, n); };
  if constexpr (GX) reduce_rows<T, RMAX, MT, SPLIT, W, VT, LOW>(a, pc, crank, vh, keep_vh, cols, global);
  else if (SPLIT == 1 || push) reduce_rows<T, RMAX, MT, SPLIT, W, VT, LOW>(a, pc, crank, vh, keep_vh, cols, local);
  else reduce_rows<T, RMAX, MT, SPLIT, W, VT, LOW>(a, pc, crank, vh, keep_vh, cols, remote);
}
