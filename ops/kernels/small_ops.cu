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

// out = weight * T(h * rsqrt(mean(h^2) + eps)) after h = T(h + delta) (ADD). One block a row,
// 16-byte accesses, the row held in registers between the two passes: hidden a multiple of 8,
// at most 256 threads x 8 x kNormVecs (checked by the wrapper). A scalar loop took ~10 µs a
// launch at 32 rows (H200 profile): 16 dependent round trips per pass.
constexpr int kNormVecs = 4;

template <class T, bool ADD>
__global__ void __launch_bounds__(256) rms_norm_kernel(const NormArgs a) {
  __shared__ float s_part[8];
  const long long row = blockIdx.x;
  T* h = static_cast<T*>(a.h) + row * a.h_stride;
  const T* delta = static_cast<const T*>(a.delta) + row * a.delta_stride;
  const int vecs = a.hidden / 8;
  float v[kNormVecs][8];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * 256;
    if (i < vecs) {
      float x[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(h + 8 * i), x);
      if constexpr (ADD) {
        float d[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(delta + 8 * i), d);
        uint4 packed;
        unsigned* pw = reinterpret_cast<unsigned*>(&packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pw[j] = DType<T>::pack(x[2 * j] + d[2 * j], x[2 * j + 1] + d[2 * j + 1]);
          const float2 r = DType<T>::unpack(pw[j]);
          x[2 * j] = r.x;
          x[2 * j + 1] = r.y;
        }
        *reinterpret_cast<uint4*>(h + 8 * i) = packed;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[k][j] = x[j];
        ss = fmaf(x[j], x[j], ss);
      }
    }
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
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * 256;
    if (i < vecs) {
      float wf[8];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(w + 8 * i)), wf);
      uint4 packed;
      unsigned* pw = reinterpret_cast<unsigned*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 n = DType<T>::unpack(DType<T>::pack(v[k][2 * j] * inv, v[k][2 * j + 1] * inv));
        pw[j] = DType<T>::pack(wf[2 * j] * n.x, wf[2 * j + 1] * n.y);
      }
      *reinterpret_cast<uint4*>(out + 8 * i) = packed;
    }
  }
}

struct SiluMulArgs {
  const void* gate_up;  // [tokens, 2 * inter]: gate | up
  void* out;            // [tokens, inter]
  long long total;      // tokens * inter
  int inter;
};

// out = T(T(act(gate)) * up) over [gate | up] rows, act in fp32.
template <class T, class Act>
__device__ __forceinline__ void gated_mul(const SiluMulArgs& a, Act act) {
  const T* in = static_cast<const T*>(a.gate_up);
  T* out = static_cast<T*>(a.out);
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < a.total; i += static_cast<long long>(gridDim.x) * 256) {
    const long long t = i / a.inter, c = i % a.inter;
    const float s = DType<T>::to_float(DType<T>::from_float(act(DType<T>::to_float(in[t * 2 * a.inter + c]))));
    out[i] = DType<T>::from_float(s * DType<T>::to_float(in[t * 2 * a.inter + a.inter + c]));
  }
}

// As F.silu(gate) * up rounds.
template <class T>
__global__ void __launch_bounds__(256) silu_mul_kernel(const SiluMulArgs a) {
  gated_mul<T>(a, [](float g) { return g / (1.f + __expf(-g)); });
}

// As F.gelu(gate, approximate="tanh") * up rounds (Gemma's GeGLU); 0.79788... = sqrt(2 / pi).
template <class T>
__global__ void __launch_bounds__(256) gelu_tanh_mul_kernel(const SiluMulArgs a) {
  gated_mul<T>(a, [](float g) { return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))); });
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

// RoPE (half rotation) on q and k in place, then k and v into the cache: one block of 512 a token.
// x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them.
template <class T, int D>
__global__ void __launch_bounds__(512) rope_kv_kernel(const RopeKvArgs a) {
  constexpr int H = D / 2;
  const long long t = blockIdx.x;
  T* row = static_cast<T*>(a.qkv) + t * a.qkv_stride;
  const T* cs = static_cast<const T*>(a.cos) + t * D;
  const T* sn = static_cast<const T*>(a.sin) + t * D;
  const long long slot = a.slots[t];
  const int roped = (a.heads + a.kv_heads) * H;
  auto f = [](T v) { return DType<T>::to_float(v); };
  auto r = [](float v) { return DType<T>::to_float(DType<T>::from_float(v)); };
#pragma unroll 4
  for (int i = threadIdx.x; i < roped; i += 512) {
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
  for (int i = threadIdx.x; i < a.kv_heads * D; i += 512) vc[i] = v[i];
}
