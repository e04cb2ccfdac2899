// Paged decode attention: one query token per sequence against that sequence's KV blocks,
// read through its block table (no gather into a padded copy).
//
// Grid (seqs, kv_heads, splits), 128 threads. A block serves the G query heads that share one
// KV head (GQA: each K/V row is read once for all of them) over the partitions numbered
// blockIdx.z, blockIdx.z + splits, ... (ceil(context / splits) tokens each, rounded up to 16,
// at most kPart, so every split has work on short contexts too): its block-table entries
// staged in shared memory (the row lookups then cost no DRAM round trip), scores into shared memory,
// its softmax stats, then the V sum, merged into running (max, sum, acc) as flash-decoding
// does. A sliding window narrows the span to the context's last `window` tokens; soft-capping
// bends each score before the softmax. The grid depends on the batch shape only, never on the context lengths, so one CUDA
// graph serves any lengths. With one split the block writes the output; with several each
// writes an unnormalised partial and paged_decode_reduce merges them.
#include "dtype.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))

struct DecodeArgs {
  const void* q;            // [seqs, heads, D] rows q_stride elements apart
  void* out;                // [seqs, heads, D] rows out_stride elements apart
  const void* k_cache;      // [blocks, block_size, kv_heads, D]
  const void* v_cache;
  const int* block_tables;  // [seqs, table_stride]
  const int* context_lens;  // [seqs]; 0: the row is padding, its output is zeros
  float* part_acc;          // [seqs, heads, splits, D]
  float* part_ml;           // [seqs, heads, splits, 2]: running max, sum
  long long q_stride, out_stride;
  int table_stride, heads, kv_heads, block_size, splits;
  float scale;
  int window;     // > 0: only the last `window` tokens of the context (sliding-window layers)
  float softcap;  // > 0: score = softcap * tanh(score / softcap) (Gemma 2)
};

constexpr int kPart = 512;  // tokens whose scores a block holds at once
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// K / V rows in flight per lane: more where few query heads leave registers free
template <int G> __device__ constexpr int unroll() { return G <= 2 ? 8 : 4; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Cache row of token `tok` (absolute), its block looked up in the staged entries from block `first` on.
__device__ __forceinline__ long long kv_row(const int* staged, int first, int tok, int block_size) {
  return static_cast<long long>(staged[tok / block_size - first]) * block_size + tok % block_size;
}

template <class T, int D, int G>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeArgs a) {
  constexpr int LPT = D / 8;   // lanes per K row: 16 bytes each
  constexpr int TPW = 32 / LPT;  // K rows per warp at once
  constexpr int VL = D / 4;    // lanes per V row: 8 bytes each
  constexpr int VPW = 32 / VL;   // V rows per warp at once
  __shared__ float s_score[G][kPart];
  __shared__ float s_acc[kWarps * VPW][G][D];
  __shared__ float s_max[G], s_sum[G];
  __shared__ int s_table[kPart + 1];
  constexpr int kUnroll = unroll<G>();

  const int seq = blockIdx.x, kvh = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ctx = __ldg(a.context_lens + seq);
  const int head0 = kvh * G;
  const int* table = a.block_tables + static_cast<long long>(seq) * a.table_stride;
  const long long row_elems = static_cast<long long>(a.kv_heads) * D;
  const T* kc = static_cast<const T*>(a.k_cache) + kvh * D;
  const T* vc = static_cast<const T*>(a.v_cache) + kvh * D;

  const int piece = lane % LPT;
  float qf[G][8];
  {
    const T* q = static_cast<const T*>(a.q) + seq * a.q_stride + head0 * D + piece * 8;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      unpack8<T>(ldg16(q + g * D, ctx > 0), qf[g]);
#pragma unroll
      for (int j = 0; j < 8; ++j) qf[g][j] *= a.scale;
    }
  }
  float run_max[G], run_sum[G], acc[G][4];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    run_max[g] = NEG_INF;
    run_sum[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[g][j] = 0.f;
  }
  const int vpiece = lane % VL, vrow = lane / VL;

  const int lo = a.window > 0 ? max(0, ctx - a.window) : 0;  // first visible token
  const int span = ctx - lo;
  const int part = min(kPart, ((span + a.splits - 1) / a.splits + 15) / 16 * 16);
  for (int rel = blockIdx.z * part; rel < span; rel += a.splits * part) {
    const int start = lo + rel, n = min(span - rel, part);
    const int first = start / a.block_size, entries = (start + n - 1) / a.block_size - first + 1;
    for (int i = threadIdx.x; i < entries; i += kThreads) s_table[i] = __ldg(table + first + i);
    __syncthreads();
    // Scores of this partition: a K row is LPT lanes' 16-byte pieces; their dot products meet
    // by shuffles inside the LPT-lane group.
    for (int base = warp * TPW; base < n; base += kWarps * TPW * kUnroll) {
      uint4 kw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = base + u * kWarps * TPW + lane / LPT;
        const bool ok = t < n;
        const long long row = ok ? kv_row(s_table, first, start + t, a.block_size) : 0;
        kw[u] = ldg16(kc + row * row_elems + piece * 8, ok);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = base + u * kWarps * TPW + lane / LPT;
        float kf[8];
        unpack8<T>(kw[u], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float dot = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) dot = fmaf(qf[g][j], kf[j], dot);
#pragma unroll
          for (int o = LPT / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
          if (a.softcap > 0.f) dot = a.softcap * tanhf(dot / a.softcap);
          if (piece == 0 && t < n) s_score[g][t] = dot;
        }
      }
    }
    __syncthreads();
    // Softmax stats against the running max: weights exp(s - new max) replace the scores.
    for (int g = warp; g < G; g += kWarps) {
      float m = NEG_INF;
      for (int i = lane; i < n; i += 32) m = fmaxf(m, s_score[g][i]);
      m = fmaxf(warp_max(m), run_max[g]);
      float l = 0.f;
      for (int i = lane; i < n; i += 32) {
        const float e = __expf(s_score[g][i] - m);
        s_score[g][i] = e;
        l += e;
      }
      l = warp_sum(l);
      if (lane == 0) {
        s_max[g] = m;
        s_sum[g] = l;
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m = s_max[g], alpha = __expf(run_max[g] - m);  // exp(-inf) = 0 on the first partition
      run_sum[g] = run_sum[g] * alpha + s_sum[g];
      run_max[g] = m;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[g][j] *= alpha;
    }
    // V: a row is VL lanes' 8-byte pieces; each lane sums its 4 columns over its rows.
    for (int base = warp * VPW; base < n; base += kWarps * VPW * kUnroll) {
      uint2 vw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = base + u * kWarps * VPW + vrow;
        const bool ok = t < n;
        const long long row = ok ? kv_row(s_table, first, start + t, a.block_size) : 0;
        vw[u] = ok ? __ldg(reinterpret_cast<const uint2*>(vc + row * row_elems + vpiece * 4)) : make_uint2(0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = base + u * kWarps * VPW + vrow;
        if (t < n) {
          const float2 lo = DType<T>::unpack(vw[u].x), hi = DType<T>::unpack(vw[u].y);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float p = s_score[g][t];
            acc[g][0] = fmaf(p, lo.x, acc[g][0]);
            acc[g][1] = fmaf(p, lo.y, acc[g][1]);
            acc[g][2] = fmaf(p, hi.x, acc[g][2]);
            acc[g][3] = fmaf(p, hi.y, acc[g][3]);
          }
        }
      }
    }
    __syncthreads();  // s_score and s_max are rewritten by the next partition
  }

  const int grp = warp * VPW + vrow;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s_acc[grp][g][vpiece * 4 + j] = acc[g][j];
    if (threadIdx.x == 0) {  // every thread holds the same running stats; shared: read by head below
      s_max[g] = run_max[g];
      s_sum[g] = run_sum[g];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < kWarps * VPW; ++r) sum += s_acc[r][g][d];
    const int head = head0 + g;
    if (a.splits == 1) {
      const float v = s_sum[g] > 0.f ? sum / s_sum[g] : 0.f;
      static_cast<T*>(a.out)[seq * a.out_stride + head * D + d] = DType<T>::from_float(v);
    } else {
      const long long part = (static_cast<long long>(seq) * a.heads + head) * a.splits + blockIdx.z;
      a.part_acc[part * D + d] = sum;
      if (d == 0) {
        a.part_ml[2 * part] = s_max[g];
        a.part_ml[2 * part + 1] = s_sum[g];
      }
    }
  }
}

// Merges the splits' partials: grid (seqs, heads), D threads.
template <class T, int D>
__global__ void __launch_bounds__(D) paged_decode_reduce(const DecodeArgs a) {
  const int seq = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const long long base = (static_cast<long long>(seq) * a.heads + head) * a.splits;
  float m = NEG_INF;
  for (int p = 0; p < a.splits; ++p)
    if (a.part_ml[2 * (base + p) + 1] > 0.f) m = fmaxf(m, a.part_ml[2 * (base + p)]);
  float l = 0.f, acc = 0.f;
  for (int p = 0; p < a.splits; ++p) {
    const float lp = a.part_ml[2 * (base + p) + 1];
    if (lp > 0.f) {
      const float w = __expf(a.part_ml[2 * (base + p)] - m);
      l = fmaf(lp, w, l);
      acc = fmaf(a.part_acc[(base + p) * D + d], w, acc);
    }
  }
  static_cast<T*>(a.out)[seq * a.out_stride + head * D + d] = DType<T>::from_float(l > 0.f ? acc / l : 0.f);
}
