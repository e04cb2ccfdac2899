// The expand half of SGMV: y[rows, share] += scale * v @ B[slot] on tensor cores.
//
// The output columns are permuted so B feeds the MMAs straight from 16-byte
// global loads: lane (g, q) loads 8 consecutive columns of 4 rows of B, so in
// n-tile j logical column n is physical column 8n + j; the accumulator then holds
// 16 consecutive columns of each row, written back with 16-byte stores.
#pragma once
#include "args.cuh"
#include "dtype.cuh"
#include "segments.cuh"

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
// issued together so a step costs one memory round trip, not one per chunk
// (past KC, expand_step loads the rest KC chunks at a time).
template <int MT, int KC>
struct StepLoads {
  uint4 y[MT][2][2];  // [row tile][row g / g+8][columns 16q.. / 16q+8..]
  uint4 b[KC][4];     // per chunk kk: B rows 16kk + 2q, 2q+1, 2q+8, 2q+9, columns 8g..
};

// A lane's addresses in every expand step: y at row pc.start + g, column 16q, and B[slot]
// at row 2q, column 8g, each plus the step's first column. Other rows are element offsets
// fixed per kernel, so a step's loads and stores cost an add each, not a 64-bit product
// (after v the expand is a chain of dependent instructions). ops/sgmv.py bounds the
// offsets to int.
template <class T>
struct ExpandLanes {
  T* y;
  const T* b;
  int y_stride, h_out;
  __device__ __forceinline__ ExpandLanes(const SgmvArgs& a, const Piece& pc) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    y = static_cast<T*>(a.y) + (long long)(pc.start + g) * a.y_stride + 16 * q;
    b = static_cast<const T*>(a.B) + (long long)pc.slot * a.b_slot + (long long)(2 * q) * a.h_out + 8 * g;
    y_stride = static_cast<int>(a.y_stride), h_out = a.h_out;
  }
};

template <class T>
__device__ __forceinline__ void load_b_k16(uint4 (&br)[4], const ExpandLanes<T>& ln, int rank, int kk, int cb,
                                           int cend) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int dk = kk * 16 + (i & 1) + (i >> 1) * 8;  // row 2q + dk
    br[i] = ldg16_stream(ln.b + cb + dk * ln.h_out, 2 * q + dk < rank && cb + 8 * g < cend);
  }
}

// Calls f(mt, h, hf, row, col) for each 16-byte piece of a step's y tile the lane owns:
// 8 consecutive columns of one row.
template <int MT, class F>
__device__ __forceinline__ void for_y_pieces(int cb, F f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) f(mt, h, hf, mt * 16 + h * 8 + g, cb + 16 * q + 8 * hf);
}

// The lane's 16-byte piece (mt, h, hf) of the y tile at step column cb.
template <class T>
__device__ __forceinline__ T* y_piece(const ExpandLanes<T>& ln, int cb, int mt, int h, int hf) {
  return ln.y + cb + (mt * 16 + h * 8) * ln.y_stride + 8 * hf;
}

template <class T, int MT, int KC>
__device__ __forceinline__ void load_step(StepLoads<MT, KC>& st, const ExpandLanes<T>& ln, const Piece& pc, int cb,
                                          int cend) {
  for_y_pieces<MT>(cb, [&](int mt, int h, int hf, int row, int col) {
    st.y[mt][h][hf] = ldg16(y_piece(ln, cb, mt, h, hf), row < pc.rows && col < cend);
  });
#pragma unroll
  for (int kk = 0; kk < KC; ++kk) load_b_k16(st.b[kk], ln, pc.rank, kk, cb, cend);  // masked past the rank
}

// acc += vh[:, 16kk..] @ B rows 16kk.. (columns permuted: see the top of this file).
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
__device__ __forceinline__ void store_step(const ExpandLanes<T>& ln, const Piece& pc, const uint4 (&yv)[MT][2][2],
                                           const float (&acc)[MT][8][4], int cb, int cend) {
  for_y_pieces<MT>(cb, [&](int mt, int h, int hf, int row, int col) {
    if (row >= pc.rows || col >= cend) return;
    const unsigned* old = &yv[mt][h][hf].x;
    uint4 out;
    unsigned* o = &out.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = DType<T>::unpack(old[i]);
      o[i] = DType<T>::pack(f.x + pc.scale * acc[mt][2 * i][2 * h + hf],
                            f.y + pc.scale * acc[mt][2 * i + 1][2 * h + hf]);
    }
    stg16(y_piece(ln, cb, mt, h, hf), out);
  });
}

// B chunks past the step's first KC that expand_step loads at once: KC, or one in 8-warp blocks
// (two spill in sliced rank-128 kernels).
__host__ __device__ constexpr int rest_chunks(int W, int KC) { return W == 8 ? 1 : KC; }

// 64-column steps in the block's column share cs.
__device__ __forceinline__ int expand_steps(int2 cs) { return (cs.y - cs.x + 63) / 64; }

// One 64-column step at column cb: acc = vh @ B[:, cb..] from the step's loads `st`
// (rank 128: the chunks past KC loaded here, KG at a time), then y += scale * acc.
template <class T, int RMAX, int MT, int KG, int KC>
__device__ __forceinline__ void expand_step(const ExpandLanes<T>& ln, const Piece& pc, int cb, int cend,
                                            const T (*vh)[Tile<T, RMAX, MT>::RP], const StepLoads<MT, KC>& st) {
  const int ksteps = (pc.rank + 15) / 16;
  float acc[MT][8][4] = {};
#pragma unroll
  for (int kk = 0; kk < KC; ++kk) {
    if (kk >= ksteps) break;
    mma_k16<T, RMAX, MT>(acc, st.b[kk], vh, kk);
  }
  // One round trip per KG chunks, not per chunk (H200, rank 128 Identical B=16: -1.5 µs)
#pragma unroll
  for (int k0 = KC; k0 < RMAX / 16; k0 += KG) {
    if (k0 >= ksteps) break;
    uint4 br[KG][4];
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) load_b_k16(br[kk], ln, pc.rank, k0 + kk, cb, cend);  // masked past the rank
#pragma unroll
    for (int kk = 0; kk < KG; ++kk)
      if (k0 + kk < ksteps) mma_k16<T, RMAX, MT>(acc, br[kk], vh, k0 + kk);
  }
  store_step(ln, pc, st.y, acc, cb, cend);
}

// y[rows, cs] += scale * vh @ B[slot][:, cs] over this block's column share cs, warp w
// taking steps w, w + W, ...; `cur` holds the loads of the warp's first step, issued
// before v was ready. PIPE (as registers allow): step s + 1 is loaded before step s is
// computed.
template <class T, int RMAX, int MT, int W, bool PIPE, int KC>
__device__ __forceinline__ void expand_tile(const ExpandLanes<T>& ln, const Piece& pc, int2 cs,
                                            const T (*vh)[Tile<T, RMAX, MT>::RP], StepLoads<MT, KC> cur) {
  const int w = threadIdx.x >> 5, nsteps = expand_steps(cs);
  for (int s = w; s < nsteps; s += W) {
    const int cb = cs.x + s * 64;
    // A warp's last step computes no further addresses: with v ready, the expand is a chain
    // of dependent instructions (decode: one step per warp), not a wait for memory.
    const bool more = s + W < nsteps;
    StepLoads<MT, KC> next;
    if (PIPE && more) load_step(next, ln, pc, cb + W * 64, cs.y);
    expand_step<T, RMAX, MT, rest_chunks(W, KC)>(ln, pc, cb, cs.y, vh, cur);
    if (!more) break;
    if (PIPE) cur = next;
    else load_step(cur, ln, pc, cb + W * 64, cs.y);
  }
}

// The loads of a warp's steps 1..DEPTH-1 (steps w + d * W) into ring[d], for expand_ring.
template <class T, int MT, int KC, int W, int DEPTH>
__device__ __forceinline__ void load_ring(StepLoads<MT, KC> (&ring)[DEPTH], const ExpandLanes<T>& ln,
                                          const Piece& pc, int2 cs) {
  const int w = threadIdx.x >> 5, nsteps = expand_steps(cs);
#pragma unroll
  for (int d = 1; d < DEPTH; ++d)
    if (w + d * W < nsteps) load_step(ring[d], ln, pc, cs.x + (w + d * W) * 64, cs.y);
}

// expand_tile's schedule with DEPTH steps' loads in flight, unrolled over a ring of DEPTH
// buffers (ring[d] holds step w + d * W, load_ring): a buffer is refilled as soon as its
// step is stored, with no register copy that would first wait for the next step's loads.
template <class T, int RMAX, int MT, int W, int DEPTH, int KC>
__device__ __forceinline__ void expand_ring(const ExpandLanes<T>& ln, const Piece& pc, int2 cs,
                                            const T (*vh)[Tile<T, RMAX, MT>::RP], StepLoads<MT, KC> (&ring)[DEPTH]) {
  const int w = threadIdx.x >> 5, nsteps = expand_steps(cs);
  for (int s0 = w; s0 < nsteps; s0 += DEPTH * W) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int s = s0 + d * W, cb = cs.x + s * 64;
      if (s >= nsteps) return;
      expand_step<T, RMAX, MT, rest_chunks(W, KC)>(ln, pc, cb, cs.y, vh, ring[d]);
      if (s + DEPTH * W < nsteps) load_step(ring[d], ln, pc, cb + DEPTH * W * 64, cs.y);
    }
  }
}
