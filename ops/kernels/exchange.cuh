// Split-K partials exchanged through global memory, for GPUs without thread-block clusters
// (sm_80): the SPLIT blocks of an item store their partials of v in a workspace, count
// themselves in on the item's counter and wait for the count; every block then sums all
// SPLIT partials from L2. A block spins on its peers, so ops/sgmv.py launches this only for
// grids the GPU holds at once.
#pragma once

// Offset (floats) of row m, column n of block c's partial for item `xitem` in the workspace.
template <int M, int RMAX, int SPLIT>
__device__ __forceinline__ long long xpart_at(int xitem, int c, int m, int n) {
  return ((static_cast<long long>(xitem) * SPLIT + c) * M + m) * RMAX + n;
}

// Counters only grow: each launch adds kPerLaunch to the counter of each item it computes (each
// of the SPLIT blocks kPerLaunch / SPLIT, whatever SPLIT that launch uses), so a block's launch
// is its ticket rounded down to a multiple of kPerLaunch (which divides 2^32).
constexpr unsigned kPerLaunch = 16;

// Every thread, after the partial is in `part` (rows < rows, columns < rr) and a __syncthreads.
template <int M, int RMAX, int SPLIT, int W>
__device__ __forceinline__ void exchange_partial(float* xpart, unsigned* xcount, const float (*part)[RMAX], int rows,
                                                 int rr, int xitem, int crank) {
  constexpr int Q = RMAX / 4;
  for (int e = threadIdx.x; e < rows * Q; e += 32 * W) {
    const int m = e / Q, n = e % Q * 4;
    if (n < rr)
      *reinterpret_cast<float4*>(xpart + xpart_at<M, RMAX, SPLIT>(xitem, crank, m, n)) =
          *reinterpret_cast<const float4*>(&part[m][n]);
  }
  __threadfence();  // each thread's stores are visible before the block counts itself in
  __syncthreads();
  if (threadIdx.x == 0) {
    static_assert(kPerLaunch % SPLIT == 0, "every block adds the same share");
    const unsigned ticket = atomicAdd(xcount + xitem, kPerLaunch / SPLIT), base = ticket - ticket % kPerLaunch;
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(xcount + xitem) : "memory");
    } while (seen - base < kPerLaunch);
  }
  __syncthreads();
}

// A peer's partial, read from L2 (loads after the wait above).
template <int M, int RMAX, int SPLIT>
__device__ __forceinline__ float4 peer_partial(const float* xpart, int xitem, int c, int m, int n) {
  return __ldcg(reinterpret_cast<const float4*>(xpart + xpart_at<M, RMAX, SPLIT>(xitem, c, m, n)));
}
