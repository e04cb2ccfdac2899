// fp16 / bf16 traits: conversions, packing and the m16n8k16 tensor-core MMA.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <class T> struct DType;

template <> struct DType<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(unsigned w) {
    return __half22float2(*reinterpret_cast<__half2*>(&w));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <> struct DType<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(unsigned w) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// Eight packed fp16 / bf16 values (16 bytes) as floats.
template <class T>
__device__ __forceinline__ void unpack8(uint4 w, float (&f)[8]) {
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = DType<T>::unpack(u[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// v (float or the activation dtype) <-> float.
__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// 16-byte read-only load, or zeros when the lane has nothing to read.
__device__ __forceinline__ uint4 ldg16(const void* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// 16-byte store. Spelled out: from ExpandLanes' addresses the compiler split some plain
// uint4 stores into four 4-byte ones (trace_runs/variants_expand_lanes.json).
__device__ __forceinline__ void stg16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Adapter weights (A, B): each line is read once per call, so it is marked first to go
// from L2 (evict_first) and skips L1: other tenants' lines (activations, the KV cache)
// stay. Measured on the H200 behind the benchmark's write flush: -3 to -10% from 16 MiB
// of weights up (likely the later misses evict these clean lines, not dirty ones). A miss
// fetches the whole 128-byte line (.L2::128B), which the lane's neighbours read anyway:
// -0.1 to -0.45 µs at ranks 16 and 32 (trace_runs/
// variants_l2_prefetch_size.json; 256 bytes the same, but r64 B=1 +0.1).
__device__ __forceinline__ uint4 ldg16_stream(const void* p, bool ok) {
  // Predicated inside the asm: as a branch around each load it cost ~15 instructions (the
  // policy recreated in each branch) on the latency-bound path to the first A load
  // (H200: -0.1 to -0.7 µs from rank 32 up; trace_runs/variants_stream_predicated.json).
  uint4 r;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm("{\n .reg .pred q;\n setp.ne.b32 q, %6, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
      " mov.b32 %3, 0;\n @q ld.global.nc.L1::no_allocate.L2::cache_hint.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n}\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "l"(policy), "r"(static_cast<int>(ok)));
  return r;
}
