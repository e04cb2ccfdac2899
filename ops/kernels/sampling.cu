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
  const float* z;
  float max, inv_t;
  int vocab;
  __device__ float s(int j) const { return (z[j] - max) * inv_t; }
};

// The largest key K with count(key ≥ K) ≥ k: the key of the k-th largest s.
__device__ unsigned kth_key(const Row& row, long long k, long long* part) {
  unsigned K = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned cand = K | (1u << bit);
    long long n = 0;
    for (int j = threadIdx.x; j < row.vocab; j += kThreads) n += key_of(row.s(j)) >= cand;
    if (block_reduce(n, Add(), part) >= k) K = cand;
  }
  return K;
}

// Σ exp(s) over the s ≥ floor whose key is ≥ cand, in every thread.
__device__ double mass_from(const Row& row, float floor, unsigned cand, double* part) {
  double m = 0.0;
  for (int j = threadIdx.x; j < row.vocab; j += kThreads) {
    const float s = row.s(j);
    if (!(s < floor) && key_of(s) >= cand) m += static_cast<double>(expf(s));
  }
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
  for (int j = lo; j < hi; ++j) {
    const float s = row.s(j);
    if (!(s < floor)) c += static_cast<double>(expf(s));
  }
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
  for (int j = lo; j < hi; ++j) {
    const float s = row.s(j);
    const double w = !(s < floor) ? static_cast<double>(expf(s)) : 0.0;
    if (w > 0.0) {
      last = j;
      acc += w;
      if (acc > x) break;
    }
  }
  *token = last;  // the first whose cumulative mass exceeds x (the last of mass if rounding says none)
}

extern "C" __global__ void __launch_bounds__(kThreads) sample_rows_kernel(const SampleArgs a) {
  __shared__ double scan[kThreads + kWarps + 1];
  __shared__ double dpart[kWarps];
  __shared__ float fpart[kWarps];
  __shared__ long long npart[kWarps];
  const int r = blockIdx.x;
  if (a.greedy[r]) return;
  Row row{a.z + r * a.z_stride, 0.f, a.inv_t[r], a.vocab};
  float m = __int_as_float(0xff800000);
  for (int j = threadIdx.x; j < a.vocab; j += kThreads) m = fmaxf(m, row.z[j]);
  row.max = block_reduce(m, Max(), fpart);
  float floor = __int_as_float(0xff800000);
  if (a.k[r] > 0) floor = value_of(kth_key(row, a.k[r], npart));
  if (a.p[r] < 1.0) floor = fmaxf(floor, value_of(top_p_key(row, floor, a.p[r], dpart)));
  draw(row, floor, a.u[r], a.tokens + r, scan);
}
