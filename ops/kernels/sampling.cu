// The random draw of app/engine/sampler.py for the sampled rows of a step, one block a row, no
// sort: s = (z − max z)·(1/T); the top-k floor (the k-th largest s) and the top-p floor (the
// smallest s whose larger values hold < p of the mass top-k kept) are each found by bisecting the
// 32-bit order-preserving key of s (32 passes over the row, which stays in L1/L2); then the
// inverse-CDF draw in vocabulary order: the first token whose cumulative exp(s) exceeds u · total.
// What the torch ops compute, up to float64 rounding of the sums (summed here in another order).
// Every sum is float64 in a fixed order (each thread's elements in turn, then a fixed tree or a
// sequential scan), so a row's token depends on that row alone, and a CUDA-graph replay draws what
// an eager launch draws.

struct SampleArgs {
  const float* z;               // [rows, vocab] logits, rows z_stride apart
  const unsigned char* greedy;  // [rows] bool: the row keeps its argmax (left as it is in tokens)
  const float* inv_t;           // [rows] 1 / temperature
  const long long* k;           // [rows] top-k, 0: off (0 < k < vocab otherwise)
  const double* p;              // [rows] top-p, 1: off
  const double* u;              // [rows] the row's uniform in (0, 1)
  long long* tokens;            // [rows] in: the argmax; out: the draw of each sampled row
  long long z_stride;
  int vocab;
};

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// Floats in the order of their unsigned keys (−0 counted as +0: equal values, equal keys).
__device__ __forceinline__ unsigned key_of(float s) {
  const unsigned b = __float_as_uint(s + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float value_of(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Add {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};

// The block's reduction of v, in every thread. Butterflies give every lane the same value (each
// pair adds the same two operands), so the result is one fixed function of the inputs.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* part) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // part may still be read by the previous reduction
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  v = part[threadIdx.x & 31];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Row {
  const float* __restrict__ z;
  float max, inv_t;
  int vocab;
  __device__ float s(float zj) const { return (zj - max) * inv_t; }
};

// f(s_j) for the thread's elements j = threadIdx.x + i·kThreads in increasing i (a fixed order).
// kLoads loads are issued before any is used: a pass over an L2-resident row is bound by load
// latency, not bandwidth, so loads in flight set its speed.
constexpr int kLoads = 8;

template <class F>
__device__ __forceinline__ void each_strided(const Row& row, F f) {
  for (int j0 = threadIdx.x; j0 < row.vocab; j0 += kLoads * kThreads) {
    float z[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int j = j0 + i * kThreads;
      z[i] = j < row.vocab ? row.z[j] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i)
      if (j0 + i * kThreads < row.vocab) f(row.s(z[i]));
  }
}

// f(j, s_j) for j in [lo, hi) in order, loads issued kLoads at a time.
template <class F>
__device__ __forceinline__ void each_contiguous(const Row& row, int lo, int hi, F f) {
  for (int j0 = lo; j0 < hi; j0 += kLoads) {
    float z[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) z[i] = j0 + i < hi ? row.z[j0 + i] : 0.f;
#pragma unroll
    for (int i = 0; i < kLoads; ++i)
      if (j0 + i < hi) f(j0 + i, row.s(z[i]));
  }
}

// The largest key K with count(key ≥ K) ≥ k: the key of the k-th largest s.
__device__ unsigned kth_key(const Row& row, long long k, long long* part) {
  unsigned K = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned cand = K | (1u << bit);
    long long n = 0;
    each_strided(row, [&](float s) { n += key_of(s) >= cand; });
    if (block_reduce(n, Add(), part) >= k) K = cand;
  }
  return K;
}

// Σ exp(s) over the s ≥ floor whose key is ≥ cand, in every thread.
__device__ double mass_from(const Row& row, float floor, unsigned cand, double* part) {
  double m = 0.0;
  each_strided(row, [&](float s) {
    if (!(s < floor) && key_of(s) >= cand) m += static_cast<double>(expf(s));
  });
  return block_reduce(m, Add(), part);
}

// The largest key K with mass(key ≥ K) ≥ p · mass(all kept): the smallest s whose larger values
// hold less than p of the mass (torch: the last token whose mass before it, sorted, is < p · total).
__device__ unsigned top_p_key(const Row& row, float floor, double p, double* part) {
  const double target = p * mass_from(row, floor, 0u, part);
  unsigned K = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned cand = K | (1u << bit);
    if (mass_from(row, floor, cand, part) >= target) K = cand;
  }
  return K;
}

// The first token in vocabulary order whose cumulative mass exceeds u · total. Thread t sums its
// contiguous chunk; a sequential scan (per warp, then over warps) gives each chunk its start E_t, so
// E is non-decreasing and the chunks' intervals [E_t, E_t+1) split [0, total) with one owner of x.
__device__ void draw(const Row& row, float floor, double u, long long* token, double* scan) {
  const int chunk = (row.vocab + kThreads - 1) / kThreads;
  const int lo = min(row.vocab, threadIdx.x * chunk), hi = min(row.vocab, lo + chunk);
  double c = 0.0;
  each_contiguous(row, lo, hi, [&](int, float s) {
    if (!(s < floor)) c += static_cast<double>(expf(s));
  });
  double* start = scan;            // [kThreads] each chunk's start within its warp, then overall
  double* warp_start = scan + kThreads;  // [kWarps + 1], the last: the total
  __syncthreads();
  start[threadIdx.x] = c;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < threadIdx.x + 32; ++i) {
      const double ci = start[i];
      start[i] = acc;
      acc += ci;
    }
    warp_start[threadIdx.x >> 5] = acc;  // the warp's total until the scan below
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      const double tw = warp_start[w];
      warp_start[w] = acc;
      acc += tw;
    }
    warp_start[kWarps] = acc;
  }
  __syncthreads();
  const int t = threadIdx.x, next = t + 1;
  const double e = warp_start[t >> 5] + start[t];
  const double e_next = next < kThreads ? warp_start[next >> 5] + start[next] : warp_start[kWarps];
  const double x = u * warp_start[kWarps];  // < the total: u < 1
  if (!(e <= x && x < e_next)) return;
  double acc = e;
  int last = lo;
  bool found = false;
  each_contiguous(row, lo, hi, [&](int j, float s) {
    const double w = !(s < floor) ? static_cast<double>(expf(s)) : 0.0;
    if (found || !(w > 0.0)) return;
    last = j;
    acc += w;
    found = acc > x;
  });
  *token = last;  // the first whose cumulative mass exceeds x (the last of mass if rounding says none)
}

extern "C" __global__ void __launch_bounds__(kThreads) sample_rows_kernel(const SampleArgs a) {
  __shared__ double scan[kThreads + kWarps + 1];
  __shared__ double dpart[kWarps];
  __shared__ float fpart[kWarps];
  __shared__ long long npart[kWarps];
  const int r = blockIdx.x;
  if (a.greedy[r]) return;
  Row row{a.z + r * a.z_stride, 0.f, 1.f, a.vocab};
  float m = __int_as_float(0xff800000);
  each_strided(row, [&](float z) { m = fmaxf(m, z); });  // max 0 and inv_t 1 here: s(z) = z
  row.max = block_reduce(m, Max(), fpart);
  row.inv_t = a.inv_t[r];
  float floor = __int_as_float(0xff800000);
  if (a.k[r] > 0) floor = value_of(kth_key(row, a.k[r], npart));
  if (a.p[r] < 1.0) floor = fmaxf(floor, value_of(top_p_key(row, floor, a.p[r], dpart)));
  draw(row, floor, a.u[r], a.tokens + r, scan);
}
