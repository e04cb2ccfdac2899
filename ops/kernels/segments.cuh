// Maps a work item to the rows it owns: one segment's rows inside one block of M rows.
//
// Items are the merge of two sorted lists, segment starts indptr[0..nseg) and
// row-block starts M, 2M, ... (not 0: rows before indptr[0] belong to no
// segment, and the first segment's item covers row 0 when indptr[0] is 0):
// every item begins where a segment or a row block begins and ends at the next
// boundary of either. So there are at most nseg + ceil(tokens / M) - 1 items,
// a number the host knows without reading indptr, and no item spans two
// adapters or more than M rows. An item finds its place with a 32-way search
// over indptr (one load round per 32x).
#pragma once

struct Piece {
  int start;  // first row
  int rows;   // 1..M
  int slot;
  int rank;
  float scale;
};

__device__ __forceinline__ int merge_corank(const int* indptr, int nseg, int nblk, int M, int p1) {
  // Largest i in [lo, hi] whose first p1 merged elements hold i segment starts: indptr[i-1]
  // <= the first row-block start not among them, (p1 - i + 1) * M (ties put segment starts
  // first). nblk: row-block starts in the list.
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
        ok = j >= nblk || __ldg(indptr + c - 1) <= (j + 1) * M;
      }
      below += __popc(__ballot_sync(0xffffffffu, ok));
    }
    lo += below * step;
    hi = min(hi, lo + step - 1);
  }
  return lo;
}

// The first kStaged segments' slot ids and pool slots' ranks (and with SCALES, scales),
// staged in shared memory: their loads are issued at entry, beside the segment search's, so
// the lookups that depend on its answer (slot, then rank and scale) read shared memory
// instead of paying two more DRAM round trips. Larger indices read global memory.
constexpr int kStaged = 512;

struct IndexStage {
  int slot[kStaged];
  int rank[kStaged];
  float scale[kStaged];
};

template <int THREADS, bool SCALES>
struct StagedLoads {
  static constexpr int N = kStaged / THREADS;  // entries per thread and array
  int slot[N], rank[N];
  float scale[SCALES ? N : 1];

  __device__ __forceinline__ void issue(const int* slot_ids, int nseg, const int* ranks, const float* scales,
                                        int slots) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int i = threadIdx.x + j * THREADS;
      slot[j] = i < nseg ? __ldg(slot_ids + i) : -1;
      rank[j] = i < slots ? __ldg(ranks + i) : 0;
      if constexpr (SCALES) scale[j] = scales && i < slots ? __ldg(scales + i) : 0.f;
    }
  }
  // Every thread, then a __syncthreads before the first lookup.
  __device__ __forceinline__ void store(IndexStage& st) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int i = threadIdx.x + j * THREADS;
      st.slot[i] = slot[j], st.rank[i] = rank[j];
      if constexpr (SCALES) st.scale[i] = scale[j];
    }
  }
};

// Entry i of a staged array, or of its global original past kStaged.
template <class V>
__device__ __forceinline__ V staged_or_global(const V (&staged)[kStaged], const V* global, int i) {
  return i < kStaged ? staged[i] : __ldg(global + i);
}

// Segments before `item`'s end: one past the index of the segment it belongs to.
__device__ __forceinline__ int find_segment(const int* indptr, int nseg, int tokens, int M, int item) {
  return merge_corank(indptr, nseg, (tokens + M - 1) / M - 1, M, item + 1);
}

// Rows [start, end) of the segment the item belongs to, i = find_segment(...): loaded before
// the staged index lands (with one row block there is no search, so no load of indptr yet).
__device__ __forceinline__ int2 segment_rows(const int* indptr, int i) {
  const int seg = max(i - 1, 0);
  return make_int2(__ldg(indptr + seg), __ldg(indptr + seg + 1));
}

// Every warp calls this (all lanes), with i = find_segment(...) and rows = segment_rows(i);
// false means the item has nothing to do. Fills start, rows and slot; rank and scale come
// from adapter_rank.
__device__ __forceinline__ bool find_piece(const int* slot_ids, const IndexStage& st, int M, int item, int i,
                                           int2 rows, Piece& pc) {
  const int j = item + 1 - i;  // row-block starts up to the item's: the last is j * M
  const int seg = max(i - 1, 0), seg_start = rows.x, seg_end = rows.y;
  const int slot = staged_or_global(st.slot, slot_ids, seg);  // staged (or one load)
  if (i == 0 || slot < 0) return false;  // rows before the first segment / no adapter
  const bool from_block = j > 0 && j * M >= seg_start;
  if (from_block && j * M == seg_start) return false;  // the segment's own item has it
  const int start = from_block ? j * M : seg_start;
  const int end = min(seg_end, (start / M + 1) * M);
  pc.start = start, pc.rows = end - start, pc.slot = slot;
  return end > start;
}

// STAGED_SCALES: as StagedLoads' SCALES; without, the scale is loaded here, on its own.
template <bool STAGED_SCALES>
__device__ __forceinline__ bool adapter_rank(const int* ranks, const float* scales, const IndexStage& st,
                                             int max_rank, Piece& pc) {
  pc.rank = min(staged_or_global(st.rank, ranks, pc.slot), max_rank);
  if (!scales) pc.scale = 0.f;  // the shrink has none
  else pc.scale = STAGED_SCALES ? staged_or_global(st.scale, scales, pc.slot) : __ldg(scales + pc.slot);
  return pc.rank > 0;
}
