// The small per-layer ops of a Llama step, one launch each, rounding where HF's torch code
// rounds (each torch op's fp32 result cast to the activation dtype), so the GPU path computes
// what the eager torch ops compute up to the last ulp of fp32 exp / rsqrt.
#include "dtype.cuh"

struct NormArgs {
  void* h;             // [tokens, hidden] residual stream, rows h_stride apart (updated in place with ADD)
  const void* delta;   // [tokens, hidden] added to h first (ADD), rows delta_stride apart
  const void* weight;  // [hidden]
  void* out;           // [tokens, hidden] contiguous
  long long h_stride, delta_stride;
  int hidden;
  float eps;
};

// out = weight * T(h * rsqrt(mean(h^2) + eps)) after h = T(h + delta) (ADD). One block a row.
template <class T, bool ADD>
__global__ void __launch_bounds__(256) rms_norm_kernel(const NormArgs a) {
  __shared__ float s_part[8];
  const long long row = blockIdx.x;
  T* h = static_cast<T*>(a.h) + row * a.h_stride;
  const T* delta = static_cast<const T*>(a.delta) + row * a.delta_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < a.hidden; i += 256) {
    float v = DType<T>::to_float(h[i]);
    if constexpr (ADD) {
      const T r = DType<T>::from_float(v + DType<T>::to_float(delta[i]));
      h[i] = r;
      v = DType<T>::to_float(r);
    }
    ss = fmaf(v, v, ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % 32 == 0) s_part[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) total += s_part[w];
  const float inv = rsqrtf(total / a.hidden + a.eps);
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * a.hidden;
  for (int i = threadIdx.x; i < a.hidden; i += 256) {
    const T n = DType<T>::from_float(DType<T>::to_float(h[i]) * inv);
    out[i] = DType<T>::from_float(DType<T>::to_float(w[i]) * DType<T>::to_float(n));
  }
}

struct SiluMulArgs {
  const void* gate_up;  // [tokens, 2 * inter]: gate | up
  void* out;            // [tokens, inter]
  long long total;      // tokens * inter
  int inter;
};

// out = T(T(silu(gate)) * up), as F.silu(gate) * up rounds.
template <class T>
__global__ void __launch_bounds__(256) silu_mul_kernel(const SiluMulArgs a) {
  const T* in = static_cast<const T*>(a.gate_up);
  T* out = static_cast<T*>(a.out);
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < a.total; i += static_cast<long long>(gridDim.x) * 256) {
    const long long t = i / a.inter, c = i % a.inter;
    const float g = DType<T>::to_float(in[t * 2 * a.inter + c]);
    const float s = DType<T>::to_float(DType<T>::from_float(g / (1.f + __expf(-g))));
    out[i] = DType<T>::from_float(s * DType<T>::to_float(in[t * 2 * a.inter + a.inter + c]));
  }
}

struct RopeKvArgs {
  void* qkv;                // [tokens, (heads + 2 * kv_heads) * D]: q | k | v, rows qkv_stride apart
  const void* cos;          // [tokens, D]
  const void* sin;          // [tokens, D]
  void* k_cache;            // [blocks * block_size, kv_heads, D]
  void* v_cache;
  const int* slots;         // [tokens] flat cache slot; < 0: not written (padding rows)
  long long qkv_stride;
  int heads, kv_heads;
};

// RoPE (half rotation) on q and k in place, then k and v into the cache: one block a token.
// x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them.
template <class T, int D>
__global__ void __launch_bounds__(128) rope_kv_kernel(const RopeKvArgs a) {
  constexpr int H = D / 2;
  const long long t = blockIdx.x;
  T* row = static_cast<T*>(a.qkv) + t * a.qkv_stride;
  const T* cs = static_cast<const T*>(a.cos) + t * D;
  const T* sn = static_cast<const T*>(a.sin) + t * D;
  const long long slot = a.slots[t];
  const int roped = (a.heads + a.kv_heads) * H;
  auto f = [](T v) { return DType<T>::to_float(v); };
  auto r = [](float v) { return DType<T>::to_float(DType<T>::from_float(v)); };
  for (int i = threadIdx.x; i < roped; i += 128) {
    const int head = i / H, d = i % H;
    T* x = row + head * D;
    const float lo = f(x[d]), hi = f(x[d + H]);
    const T new_lo = DType<T>::from_float(r(lo * f(cs[d])) + r(-hi * f(sn[d])));
    const T new_hi = DType<T>::from_float(r(hi * f(cs[d + H])) + r(lo * f(sn[d + H])));
    x[d] = new_lo;
    x[d + H] = new_hi;
    if (head >= a.heads && slot >= 0) {
      T* k = static_cast<T*>(a.k_cache) + (slot * a.kv_heads + head - a.heads) * D;
      k[d] = new_lo;
      k[d + H] = new_hi;
    }
  }
  if (slot < 0) return;
  const T* v = row + (a.heads + a.kv_heads) * D;
  T* vc = static_cast<T*>(a.v_cache) + slot * a.kv_heads * D;
  for (int i = threadIdx.x; i < a.kv_heads * D; i += 128) vc[i] = v[i];
}
