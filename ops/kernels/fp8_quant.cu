// Per-token (row) fp8 e4m3 quantization of a GEMM's fp16 / bf16 input (ops/fp8.py): one launch
// instead of the ~7 torch kernels of the eager form, which cost more than the fp8 GEMM saves at
// decode batch sizes when 4 projections a layer pay them. Needs sm_89+ (the e4m3 convert).
// Rounds as the torch form does: s = max(amax, 1e-12) / 448 and q = RNE(clamp(x / s, ±448)), in fp32.
#include "dtype.cuh"

struct QuantRowsArgs {
  const void* x;     // [rows, cols], rows x_stride elements apart, 16-byte aligned
  unsigned char* q;  // [rows, cols] contiguous, float8_e4m3fn
  float* scale;      // [rows]
  long long x_stride;
  int cols;          // a multiple of 8
};

constexpr float kFp8Max = 448.f;
constexpr float kMinAmax = 1e-12f;

// Two floats to two e4m3 bytes (round to nearest even, saturating at ±448): lo in the low byte.
__device__ __forceinline__ unsigned short cvt_e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// One block a row: the row's absolute maximum (first pass), then its scaled bytes (second pass,
// re-read from L1/L2: a row is at most a few tens of KB).
template <class T>
__global__ void __launch_bounds__(256) quant_rows_kernel(const QuantRowsArgs a) {
  __shared__ float s_part[8];
  __shared__ float s_scale;
  const long long row = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + row * a.x_stride;
  const int vecs = a.cols / 8;
  float amax = 0.f;
  for (int i = threadIdx.x; i < vecs; i += 256) {
    float v[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(x + 8 * i), v);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) s_part[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) m = fmaxf(m, s_part[w]);
    s_scale = fmaxf(m, kMinAmax) / kFp8Max;
    a.scale[row] = s_scale;
  }
  __syncthreads();
  const float s = s_scale;
  unsigned char* q = a.q + row * a.cols;
  for (int i = threadIdx.x; i < vecs; i += 256) {
    float v[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(x + 8 * i), v);
    uint2 packed;
    unsigned short* pw = reinterpret_cast<unsigned short*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) pw[j] = cvt_e4m3x2(v[2 * j] / s, v[2 * j + 1] / s);
    *reinterpret_cast<uint2*>(q + 8 * i) = packed;
  }
}
