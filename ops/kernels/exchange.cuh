// Work items shared by blocks that are not (all) one cluster meet in global memory: split-K
// partials on GPUs without thread-block clusters (sm_80; exchange_partial), and the columns of
// v summed by the clusters of a rank-grouped item (sm_90; share_v). Each block stores its
// part, counts itself in on the item's counter and waits for the count; then reads the whole
// from L2. A block spins on its peers, so ops/sgmv.py launches this only for grids the GPU
// holds at once.
#pragma once
#include "args.cuh"

// Offset (floats) of row m, column n of block c's partial for item `xitem` in the workspace.
template <int M, int RMAX, int SPLIT>
__device__ __forceinline__ long long xpart_at(int xitem, int c, int m, int n) {
  return ((static_cast<long long>(xitem) * SPLIT + c) * M + m) * RMAX + n;
}

// Counters only grow: each launch adds kPerLaunch to the counter of each item it computes (each
// of the item's BLOCKS blocks kPerLaunch / BLOCKS, whatever BLOCKS that launch has), so a block's
// launch is its ticket rounded down to a multiple of kPerLaunch (which divides 2^32).
constexpr unsigned kPerLaunch = 64;

// Every thread, after its stores for the peers: they are visible to every block of the item
// once this returns, and the other blocks' to this one.
template <int BLOCKS>
__device__ __forceinline__ void count_in(unsigned* xcount, int xitem) {
  __threadfence();  // each thread's stores are visible before the block counts itself in
  __syncthreads();
  if (threadIdx.x == 0) {
    static_assert(kPerLaunch % BLOCKS == 0, "every block adds the same share");
    const unsigned ticket = atomicAdd(xcount + xitem, kPerLaunch / BLOCKS), base = ticket - ticket % kPerLaunch;
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(xcount + xitem) : "memory");
    } while (seen - base < kPerLaunch);
  }
  __syncthreads();
}

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
  count_in<SPLIT>(xcount, xitem);
}

// A peer's partial, read from L2 (loads after the wait above).
template <int M, int RMAX, int SPLIT>
__device__ __forceinline__ float4 peer_partial(const float* xpart, int xitem, int c, int m, int n) {
  return __ldcg(reinterpret_cast<const float4*>(xpart + xpart_at<M, RMAX, SPLIT>(xitem, c, m, n)));
}

// Every thread of the BLOCKS blocks of a rank-grouped item, each cluster's vh holding v's columns
// [cols.x, cols.y) (its own, identical in its blocks): one block per cluster (`writer`) stores
// them in the item's v in the workspace, and every block loads back all columns below rr.
template <class T, int M, int RMAX, int BLOCKS, int W>
__device__ __forceinline__ void share_v(float* xpart, unsigned* xcount, T (*vh)[Tile<T, RMAX, 1>::RP], int rows,
                                        int2 cols, int rr, int xitem, bool writer) {
  constexpr int Q = RMAX / 8;  // 16-byte pieces per row
  T* v = reinterpret_cast<T*>(xpart) + static_cast<long long>(xitem) * M * RMAX;
  __syncthreads();  // this block's columns are in vh
  if (writer)
    for (int e = threadIdx.x; e < rows * Q; e += 32 * W) {
      const int m = e / Q, n = e % Q * 8;
      if (n >= cols.x && n < cols.y)
        *reinterpret_cast<uint4*>(v + m * RMAX + n) = *reinterpret_cast<const uint4*>(&vh[m][n]);
    }
  count_in<BLOCKS>(xcount, xitem);
  for (int e = threadIdx.x; e < rows * Q; e += 32 * W) {
    const int m = e / Q, n = e % Q * 8;
    if (n < rr) *reinterpret_cast<uint4*>(&vh[m][n]) = __ldcg(reinterpret_cast<const uint4*>(v + m * RMAX + n));
  }
}
