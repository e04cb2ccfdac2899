// Paged decode attention: one query token per sequence against that sequence's KV blocks,
// read through its block table (no gather into a padded copy).
//
// Grid (seqs, kv_heads, splits), WARPS warps a block. A block serves the G <= 8 query heads that
// share one KV head, so each K/V byte is read once for all of them. The context's 16-token
// tiles are dealt round-robin to the splits x WARPS warps of the (sequence, KV head); each warp
// streams its tiles through its own STAGES-deep ring of shared memory (cp.async, 16 bytes a
// lane, no block-wide barrier in the loop) and keeps a flash-decoding running max, sum and
// output in registers. The math is on tensor cores (mma m16n8k16, fp32 accumulate), transposed
// so that the tile's 16 tokens are the MMA rows and the (padded) 8 heads its columns:
//   S^T[16 tokens x 8 heads] = K[16 x D] . Q^T   (K straight from its 16-byte chunks: a lane's
//                                                 fragment takes D in an order Q's fragment shares)
//   O^T[D x 8 heads]        += V^T[D x 16] . P^T  (V's chunks transposed by byte permutes)
// so a lane's softmax statistics and output columns are the same two heads. At the end the
// block's warps merge in shared memory; with several splits each block stores its partial and
// the block that counts in last merges them and resets its counter (one launch, no second
// kernel). A sliding window narrows the tiles to the context's last `window` tokens;
// soft-capping bends each score before the softmax. The grid depends on the batch shape only,
// never on the context lengths, so one CUDA graph serves any lengths.
#include "dtype.cuh"
#include "cp_async.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define FULL_MASK 0xffffffffu

struct DecodeArgs {
  const void* q;            // [seqs, heads, D] rows q_stride elements apart
  void* out;                // [seqs, heads, D] rows out_stride elements apart
  const void* k_cache;      // [blocks, block_size, kv_heads, D]
  const void* v_cache;
  const int* block_tables;  // [seqs, table_stride]
  const int* context_lens;  // [seqs]; 0: the row is padding, its output is zeros
  float* part_acc;          // [seqs, heads, splits, D]: unnormalised sums (splits > 1)
  float* part_ml;           // [seqs, heads, splits, 2]: max (log2 units), sum
  int* counters;            // [seqs * kv_heads], zeros between launches (splits > 1)
  long long q_stride, out_stride;
  int table_stride, heads, kv_heads, group, block_size, splits;
  float scale;
  int window;     // > 0: only the last `window` tokens of the context (sliding-window layers)
  float softcap;  // > 0: score = softcap * tanh(score / softcap) (Gemma 2)
};

constexpr int kTile = 16;   // tokens a warp takes at once: the MMA's rows
constexpr int kHeads = 8;   // query heads a block can serve: the MMA's columns
constexpr float kLog2e = 1.4426950408889634f;

// A lane's share of one tile, in 16-byte chunks. K: rows g and g + 8 (g = lane / 4), chunks
// 4j + lane % 4. V: tokens 2q, 2q + 1, 2q + 8, 2q + 9 (q = lane % 4), chunk 8r + g in round r.
template <int D>
struct Tile {
  static_assert(D % 32 == 0 && D <= 256, "head dim: a multiple of 32, at most 256");
  static constexpr int KJ = D / 32;            // K chunk columns a lane holds (2 MMA k-steps each)
  static constexpr int NK = 2 * KJ;            // K chunks a lane holds
  static constexpr int VR = (D + 63) / 64;     // V rounds: 8 lane groups x 8 values
  static constexpr int NV = 4 * VR;            // V chunks a lane holds
  static constexpr int CH = NK + NV;           // chunks a lane holds
  static constexpr int MT = 4 * VR;            // O^T's 16-row MMA tiles
};

template <int D, int WARPS, int STAGES>
__host__ __device__ constexpr unsigned smem_bytes() {
  const unsigned ring = WARPS * STAGES * Tile<D>::CH * 32 * 16;
  const unsigned merge = (WARPS * kHeads * (D + 2) + 1) * 4;  // partial outputs, max, sum; a flag
  return ring > merge ? ring : merge;
}

// Copies of one tile (first token tok0, cache row row0) into this lane's chunks buf[c * 32];
// tokens outside [lo, ctx) and chunks past D land as zeros (so masked V rows add 0, not NaN).
template <class T, int D>
__device__ __forceinline__ void issue_tile(uint4* buf, const T* kc, const T* vc, long long row0, long long row_elems,
                                           int tok0, int lo, int ctx, int lane) {
  using F = Tile<D>;
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tok = tok0 + g + 8 * r;
    const T* src = kc + (row0 + g + 8 * r) * row_elems + q * 8;
#pragma unroll
    for (int j = 0; j < F::KJ; ++j) cp_async16(buf + (r * F::KJ + j) * 32, src + j * 32, tok >= lo && tok < ctx);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = 2 * q + (i & 1) + 8 * (i >> 1), tok = tok0 + t;
    const T* src = vc + (row0 + t) * row_elems + g * 8;
#pragma unroll
    for (int r = 0; r < F::VR; ++r)
      cp_async16(buf + (F::NK + 4 * r + i) * 32, src + r * 64, tok >= lo && tok < ctx && 8 * r + g < D / 8);
  }
}

// S^T = K . Q^T for one tile: s[0], s[1] token g, heads 2q, 2q + 1; s[2], s[3] token g + 8.
// K-step 2j's A fragment is words x, y of the lane's K chunks 4j + q (rows g, g + 8), step
// 2j + 1's words z, w; Q's B fragments (qf) were cut from Q's chunks the same way.
template <class T, int D>
__device__ __forceinline__ void score_tile(float (&s)[4], const uint4* buf, const unsigned (&qf)[D / 16][2]) {
  using F = Tile<D>;
  float odd[4] = {0.f, 0.f, 0.f, 0.f};  // two accumulators: half the dependent MMA chain
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = 0.f;
#pragma unroll
  for (int j = 0; j < F::KJ; ++j) {
    const uint4 k0 = buf[j * 32], k8 = buf[(F::KJ + j) * 32];
    DType<T>::mma(s, k0.x, k8.x, k0.y, k8.y, qf[2 * j][0], qf[2 * j][1]);
    DType<T>::mma(odd, k0.z, k8.z, k0.w, k8.w, qf[2 * j + 1][0], qf[2 * j + 1][1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += odd[i];
}

struct Softmax {
  float qk_scale;  // scale * log2(e), or scale / softcap before the tanh
  float post;      // softcap * log2(e) after the tanh; 0: no soft-capping
  int lo, ctx;     // visible tokens [lo, ctx)
};

// Online softmax over one tile for this lane's heads 2q, 2q + 1 (running max m in log2 units,
// agreed by the warp; this lane's running sum l), acc rescaled; returns P^T's B fragment:
// lane (g, q) needs P[head g][tokens 2q, 2q + 1] (b0) and [2q + 8, 2q + 9] (b1), which lanes
// 8q + g / 2 and 8q + 4 + g / 2 hold as half g % 2 of their packed (s[0], s[1]) / (s[2], s[3]).
template <class T, int MT>
__device__ __forceinline__ uint2 softmax_tile(float (&s)[4], int tok0, const Softmax& sm, float (&m)[2], float (&l)[2],
                                              float (&acc)[MT][4], int lane) {
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = tok0 + g + 8 * (i / 2);
    float x = s[i] * sm.qk_scale;
    if (sm.post != 0.f) x = sm.post * tanhf(x);
    s[i] = tok >= sm.lo && tok < sm.ctx ? x : NEG_INF;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = fmaxf(s[h], s[h + 2]);
#pragma unroll
    for (int o = 4; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    const float mn = fmaxf(m[h], mx), base = mn == NEG_INF ? 0.f : mn;  // all masked so far: weights 0
    const float alpha = exp2f(m[h] - base);
    s[h] = exp2f(s[h] - base);
    s[h + 2] = exp2f(s[h + 2] - base);
    l[h] = fmaf(l[h], alpha, s[h] + s[h + 2]);
    m[h] = mn;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      acc[t][h] *= alpha;
      acc[t][h + 2] *= alpha;
    }
  }
  const unsigned w01 = DType<T>::pack(s[0], s[1]), w23 = DType<T>::pack(s[2], s[3]);
  const int src = 8 * q + g / 2;
  const unsigned sel = (g & 1) ? 0x7632u : 0x5410u;
  uint2 b;
  b.x = __byte_perm(__shfl_sync(FULL_MASK, w01, src), __shfl_sync(FULL_MASK, w01, src + 4), sel);
  b.y = __byte_perm(__shfl_sync(FULL_MASK, w23, src), __shfl_sync(FULL_MASK, w23, src + 4), sel);
  return b;
}

// O^T += V^T . P^T for one tile. Round r's chunks (tokens 2q, 2q + 1, 2q + 8, 2q + 9; values
// 8(8r + g) ..) make MMA tiles 4r + w: row g is value 2w (the low halves of word w), row g + 8
// value 2w + 1 (the high halves), token pairs joined by byte permutes.
template <class T, int D>
__device__ __forceinline__ void pv_tile(float (&acc)[Tile<D>::MT][4], const uint4* buf, uint2 b) {
  using F = Tile<D>;
#pragma unroll
  for (int r = 0; r < F::VR; ++r) {
    const uint4 v0 = buf[(F::NK + 4 * r) * 32], v1 = buf[(F::NK + 4 * r + 1) * 32];
    const uint4 v8 = buf[(F::NK + 4 * r + 2) * 32], v9 = buf[(F::NK + 4 * r + 3) * 32];
    const unsigned x0[4] = {v0.x, v0.y, v0.z, v0.w}, x1[4] = {v1.x, v1.y, v1.z, v1.w};
    const unsigned x8[4] = {v8.x, v8.y, v8.z, v8.w}, x9[4] = {v9.x, v9.y, v9.z, v9.w};
#pragma unroll
    for (int w = 0; w < 4; ++w)
      DType<T>::mma(acc[4 * r + w], __byte_perm(x0[w], x1[w], 0x5410), __byte_perm(x0[w], x1[w], 0x7632),
                    __byte_perm(x8[w], x9[w], 0x5410), __byte_perm(x8[w], x9[w], 0x7632), b.x, b.y);
  }
}

// Merge of n (max, sum, output) partials: partial i's max at m[i * ms], sum at l[i * ms], 4
// output values at o[i * os]; from L2 (other blocks' stores) when `global`.
struct Merged {
  float4 o;
  float m, l;
};

template <bool GLOBAL>
__device__ __forceinline__ float ld(const float* p) { return GLOBAL ? __ldcg(p) : *p; }

template <bool GLOBAL>
__device__ __forceinline__ Merged merge(const float* m, const float* l, const float* o, int n, int ms, int os) {
  Merged r{make_float4(0.f, 0.f, 0.f, 0.f), NEG_INF, 0.f};
  for (int i = 0; i < n; ++i)
    if (ld<GLOBAL>(l + i * ms) > 0.f) r.m = fmaxf(r.m, ld<GLOBAL>(m + i * ms));
  for (int i = 0; i < n; ++i) {
    const float li = ld<GLOBAL>(l + i * ms);
    if (!(li > 0.f)) continue;
    const float w = exp2f(ld<GLOBAL>(m + i * ms) - r.m);
    const float4 oi = GLOBAL ? __ldcg(reinterpret_cast<const float4*>(o + i * os)) : *reinterpret_cast<const float4*>(o + i * os);
    r.l = fmaf(li, w, r.l);
    r.o = make_float4(fmaf(oi.x, w, r.o.x), fmaf(oi.y, w, r.o.y), fmaf(oi.z, w, r.o.z), fmaf(oi.w, w, r.o.w));
  }
  return r;
}

// out[seq, head, d .. d + 3] = o / l (zeros where l is 0).
template <class T, int D>
__device__ __forceinline__ void store_out(const DecodeArgs& a, int seq, int head, int d, const Merged& r) {
  const float inv = r.l > 0.f ? 1.f / r.l : 0.f;
  uint2 w;
  w.x = DType<T>::pack(r.o.x * inv, r.o.y * inv);
  w.y = DType<T>::pack(r.o.z * inv, r.o.w * inv);
  *reinterpret_cast<uint2*>(static_cast<T*>(a.out) + seq * a.out_stride + head * D + d) = w;
}

// This warp's (max, sum, output) of heads 2q, 2q + 1 into shared memory: so[warp][head][d],
// sm / sl[warp][head]. Lane (g, q) holds values 8(8r + g) .. + 7 of both heads: value 2w + e
// is acc[4r + w][h + 2e].
template <int D, int MT>
__device__ __forceinline__ void stash_warp(float* so, float* sm, float* sl, const float (&acc)[MT][4],
                                           const float (&m)[2], float (&l)[2], int warp, int lane) {
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int o = 4; o < 32; o *= 2) l[h] += __shfl_xor_sync(FULL_MASK, l[h], o);
    float* row = so + (warp * kHeads + 2 * q + h) * D;
#pragma unroll
    for (int r = 0; r < MT / 4; ++r) {
      if (8 * r + g >= D / 8) continue;
      float4* dst = reinterpret_cast<float4*>(row + 8 * (8 * r + g));
      dst[0] = make_float4(acc[4 * r][h], acc[4 * r][h + 2], acc[4 * r + 1][h], acc[4 * r + 1][h + 2]);
      dst[1] = make_float4(acc[4 * r + 2][h], acc[4 * r + 2][h + 2], acc[4 * r + 3][h], acc[4 * r + 3][h + 2]);
    }
    if (g == 0) {
      sm[warp * kHeads + 2 * q + h] = m[h];
      sl[warp * kHeads + 2 * q + h] = l[h];
    }
  }
}

template <class T, int D, int WARPS, int STAGES>
__global__ void __launch_bounds__(32 * WARPS, 1) paged_decode_kernel(const DecodeArgs a) {
  using F = Tile<D>;
  extern __shared__ uint4 smem[];
  if (dynamic_smem_size() < smem_bytes<D, WARPS, STAGES>()) __trap();  // the host's size is stale
  const int seq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int ctx = __ldg(a.context_lens + seq), G = a.group, head0 = kvh * G;
  if (ctx == 0) {  // padding row: zeros, and no split counts in
    for (int e = threadIdx.x; split == 0 && e < G * D / 4; e += 32 * WARPS)
      store_out<T, D>(a, seq, head0 + e / (D / 4), e % (D / 4) * 4, Merged{make_float4(0.f, 0.f, 0.f, 0.f), 0.f, 0.f});
    return;
  }
  const int lo = a.window > 0 ? max(0, ctx - a.window) : 0;
  const int t_lo = lo / kTile, t_hi = (ctx + kTile - 1) / kTile;
  // This warp's tiles: t_lo + u, t_lo + u + U, ... (a block's warps take neighbouring tiles)
  const int U = a.splits * WARPS, u = split * WARPS + warp;
  const int n_w = t_hi - t_lo > u ? (t_hi - t_lo - u + U - 1) / U : 0;

  const T* qrow = static_cast<const T*>(a.q) + seq * a.q_stride + (head0 + g) * D + q * 8;
  unsigned qf[D / 16][2];
#pragma unroll
  for (int j = 0; j < F::KJ; ++j) {
    const uint4 w = ldg16(qrow + j * 32, g < G);
    qf[2 * j][0] = w.x;
    qf[2 * j][1] = w.y;
    qf[2 * j + 1][0] = w.z;
    qf[2 * j + 1][1] = w.w;
  }
  // Block-table entries of tiles k .. k + 31 of this warp, one a lane, and of the 32 after.
  const int* table = a.block_tables + static_cast<long long>(seq) * a.table_stride;
  auto entry = [&](int k) { return k < n_w ? __ldg(table + (t_lo + u + k * U) * kTile / a.block_size) : 0; };
  int ring = entry(lane), ring_next = entry(32 + lane);
  const long long row_elems = static_cast<long long>(a.kv_heads) * D;
  const T* kc = static_cast<const T*>(a.k_cache) + kvh * D;
  const T* vc = static_cast<const T*>(a.v_cache) + kvh * D;
  uint4* stages = smem + warp * STAGES * F::CH * 32 + lane;
  auto issue = [&](int k) {
    if (k > 0 && k % 32 == 0) {
      ring = ring_next;
      ring_next = entry(k + 32 + lane);
    }
    const int page = __shfl_sync(FULL_MASK, ring, k % 32), tok0 = (t_lo + u + k * U) * kTile;
    const long long row0 = static_cast<long long>(page) * a.block_size + tok0 % a.block_size;
    issue_tile<T, D>(stages + k % STAGES * F::CH * 32, kc, vc, row0, row_elems, tok0, lo, ctx, lane);
  };

  const Softmax sm{a.softcap > 0.f ? a.scale / a.softcap : a.scale * kLog2e, a.softcap > 0.f ? a.softcap * kLog2e : 0.f,
                   lo, ctx};
  float acc[F::MT][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int t = 0; t < F::MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    if (k < n_w) issue(k);
    cp_async_commit();
  }
  for (int k = 0; k < n_w; ++k) {
    if (k + STAGES - 1 < n_w) issue(k + STAGES - 1);  // into tile k - 1's stage, read last round
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // tile k's copies have landed
    const uint4* buf = stages + k % STAGES * F::CH * 32;
    float s[4];
    score_tile<T, D>(s, buf, qf);
    const uint2 p = softmax_tile<T, F::MT>(s, (t_lo + u + k * U) * kTile, sm, m, l, acc, lane);
    pv_tile<T, D>(acc, buf, p);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its stages: the merge reuses them

  float* so = reinterpret_cast<float*>(smem);  // [WARPS][kHeads][D]
  float* smax = so + WARPS * kHeads * D;       // [WARPS][kHeads]
  float* ssum = smax + WARPS * kHeads;
  int* last = reinterpret_cast<int*>(ssum + WARPS * kHeads);
  stash_warp<D>(so, smax, ssum, acc, m, l, warp, lane);
  __syncthreads();
  const long long part0 = (static_cast<long long>(seq) * a.heads + head0) * a.splits;
  for (int e = threadIdx.x; e < G * D / 4; e += 32 * WARPS) {
    const int h = e / (D / 4), d = e % (D / 4) * 4;
    const Merged r = merge<false>(smax + h, ssum + h, so + h * D + d, WARPS, kHeads, kHeads * D);
    if (a.splits == 1) {
      store_out<T, D>(a, seq, head0 + h, d, r);
    } else {
      const long long p = part0 + h * a.splits + split;
      *reinterpret_cast<float4*>(a.part_acc + p * D + d) = r.o;
      if (d == 0) {
        a.part_ml[2 * p] = r.m;
        a.part_ml[2 * p + 1] = r.l;
      }
    }
  }
  if (a.splits == 1) return;
  // The split that counts in last merges all the partials (stores fenced before the count).
  __threadfence();
  __syncthreads();
  int* counter = a.counters + seq * a.kv_heads + kvh;
  if (threadIdx.x == 0) *last = atomicAdd(counter, 1) == a.splits - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  for (int e = threadIdx.x; e < G * D / 4; e += 32 * WARPS) {
    const int h = e / (D / 4), d = e % (D / 4) * 4;
    const long long p = part0 + h * a.splits;
    store_out<T, D>(a, seq, head0 + h, d, merge<true>(a.part_ml + 2 * p, a.part_ml + 2 * p + 1, a.part_acc + p * D + d,
                                                      a.splits, 2, D));
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
}
