// The kernel's argument block (mirrored by ops/sgmv.py's _Args) and the tile shapes.
#pragma once

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
  int nseg, tokens, h_in, h_out, max_rank, slots;
  float* xpart;      // sm_80 split-K: partials workspace (exchange.cuh); null with clusters
  unsigned* xcount;  // and its per-item counters
};

// The second and third slices of a sliced add-on (sgmv.cu); the first is SgmvArgs' own. Fields
// in 32 bits where they fit (ops/sgmv.py checks), as the kernel holds them in registers.
struct SliceArgs {
  const void* A;
  const void* B;
  const int* slot_ids;
  int y_shift;  // elements from SgmvArgs' y to the slice's first output column
  int b_slot;
  int h_out;
};

struct SgmvSlices {  // mirrored by ops/sgmv.py's _Slices
  SgmvArgs base;
  SliceArgs more[2];
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
  // k16 chunks of B an expand step loads at once, as registers allow (sgmv_body may take more)
  static constexpr int KC = RMAX <= (W == 8 ? 32 : 64) ? RMAX / 16 : 2;
};
