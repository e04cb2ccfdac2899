// Runs kernels/attention.cu's paged_decode_kernel on the CPU through cuda_shim.h (built and called
// by tests/test_paged_decode_cpu.py; attention.cu is copied next to the stand-in headers).
#include <algorithm>
#include <random>

#include "cuda_shim.h"
#include "attention.cu"

alignas(16) uint4 smem[232448 / 16];

template <class T, int D, int W, int S>
static void launch(const DecodeArgs& a, int seqs, unsigned seed) {
  shim::dyn_smem = smem_bytes<D, W, S>();
  std::vector<dim3> blocks;
  for (int z = 0; z < a.splits; ++z)
    for (int y = 0; y < a.kv_heads; ++y)
      for (int x = 0; x < seqs; ++x) blocks.push_back({unsigned(x), unsigned(y), unsigned(z)});
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(seed));  // any split may finish last
  const dim3 grid{unsigned(seqs), unsigned(a.kv_heads), unsigned(a.splits)}, block{32 * W, 1, 1};
  for (const dim3& b : blocks) {
    std::memset(smem, 0xff, sizeof smem);  // NaN everywhere a block reads before it writes
    shim::run_block(grid, b, block, [&] { paged_decode_kernel<T, D, W, S>(a); });
  }
}

// The configurations ops/paged_decode.py launches on sm_90 and sm_80, and two more of its variants.
#define CASE(D, W, S)                                                  \
  if (d == D && w == W && s == S) {                                    \
    if (bf16) launch<__nv_bfloat16, D, W, S>(*a, seqs, seed);          \
    else launch<__half, D, W, S>(*a, seqs, seed);                      \
    return 0;                                                          \
  }

extern "C" int run(const DecodeArgs* a, int seqs, int bf16, int d, int w, int s, int defer, unsigned seed) {
  shim::defer_copies = defer;
  CASE(64, 4, 4)
  CASE(96, 4, 3)
  CASE(128, 4, 3)
  CASE(128, 2, 2)
  CASE(128, 8, 2)
  CASE(256, 4, 3)
  CASE(256, 4, 2)
  return 1;
}

extern "C" unsigned smem_size(int d, int w, int s) {
#define SMEM(D, W, S) \
  if (d == D && w == W && s == S) return smem_bytes<D, W, S>();
  SMEM(64, 4, 4) SMEM(96, 4, 3) SMEM(128, 4, 3) SMEM(128, 2, 2) SMEM(128, 8, 2) SMEM(256, 4, 3) SMEM(256, 4, 2)
  return 0;
}
