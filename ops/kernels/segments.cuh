// Maps a work item to the rows it owns: one segment's rows inside one block of M rows.
//
// Items are the merge of two sorted lists, segment starts indptr[0..nseg) and
// row-block starts 0, M, 2M, ...: every item begins where a segment or a row
// block begins and ends at the next boundary of either. So there are at most
// nseg + ceil(tokens / M) items, a number the host knows without reading
// indptr, and no item spans two adapters or more than M rows. An item finds
// its place with a 32-way search over indptr (one load round per 32x).
#pragma once

struct Piece {
  int start;  // first row
  int rows;   // 1..M
  int slot;
  int rank;
  float scale;
};

__device__ __forceinline__ int merge_corank(const int* indptr, int nseg, int nblk, int M, int p1) {
  // Largest i in [lo, hi] whose first p1 merged elements hold i segment starts:
  // indptr[i-1] <= row-block start (p1 - i) * M (ties put segment starts first).
  // Each lane tests K candidates at once, so up to 128 segments take one load round.
  constexpr int K = 4;
  const int lane = threadIdx.x & 31;
  int lo = max(0, p1 - nblk), hi = min(nseg, p1);
  while (lo < hi) {
    const int step = (hi - lo + 32 * K - 1) / (32 * K);
    int below = 0;  // the predicate holds on a prefix of the candidates: count them
#pragma unroll
    for (int t = 0; t < K; ++t) {
      const int c = lo + (lane * K + t + 1) * step;
      bool ok = false;
      if (c <= hi) {
        const int j = p1 - c;
        ok = j >= nblk || __ldg(indptr + c - 1) <= j * M;
      }
      below += __popc(__ballot_sync(0xffffffffu, ok));
    }
    lo += below * step;
    hi = min(hi, lo + step - 1);
  }
  return lo;
}

// Every warp calls this (all lanes); false means the item has nothing to do.
// Fills start, rows and slot; rank and scale come from adapter_rank, one
// dependent load later, so the caller can start prefetching in between.
__device__ __forceinline__ bool find_piece(const int* indptr, const int* slot_ids, int nseg, int tokens,
                                           int M, int item, Piece& pc) {
  const int nblk = (tokens + M - 1) / M;
  const int i = merge_corank(indptr, nseg, nblk, M, item + 1);
  const int j = item + 1 - i;
  // Issue the three loads together: each is a DRAM round trip after an L2 flush.
  const int seg = max(i - 1, 0);
  const int seg_start = __ldg(indptr + seg), seg_end = __ldg(indptr + seg + 1);
  const int slot = __ldg(slot_ids + seg);
  if (i == 0 || slot < 0) return false;  // rows before the first segment / no adapter
  const bool from_block = j > 0 && (j - 1) * M >= seg_start;
  if (from_block && (j - 1) * M == seg_start) return false;  // the segment's own item has it
  const int start = from_block ? (j - 1) * M : seg_start;
  const int end = min(seg_end, (start / M + 1) * M);
  pc.start = start, pc.rows = end - start, pc.slot = slot;
  return end > start;
}

__device__ __forceinline__ bool adapter_rank(const int* ranks, const float* scales, int max_rank, Piece& pc) {
  pc.rank = min(__ldg(ranks + pc.slot), max_rank);
  pc.scale = scales ? __ldg(scales + pc.slot) : 0.f;  // the shrink has no scales
  return pc.rank > 0;
}
