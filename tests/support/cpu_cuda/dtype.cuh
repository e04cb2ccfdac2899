// CPU stand-in for kernels/dtype.cuh (what attention.cu uses): fp16 / bf16 storage, packing,
// the m16n8k16 MMA as a warp-wide exchange of fragments (fp32 products and sums).
#pragma once
#include "cuda_shim.h"

struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };

inline float f16_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline uint16_t float_to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
inline float bf16_to_float(uint16_t h) {
  const unsigned u = static_cast<unsigned>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
  unsigned u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

template <class T> struct DType;

template <uint16_t (*TO)(float), float (*FROM)(uint16_t)>
struct Traits {
  static unsigned pack(float lo, float hi) { return TO(lo) | (static_cast<unsigned>(TO(hi)) << 16); }
  static float lo(unsigned w) { return FROM(w & 0xffff); }
  static float hi(unsigned w) { return FROM(w >> 16); }
  // D = A . B + C on the warp's fragments (PTX's m16n8k16 layouts).
  static void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    auto& mine = shim::cur->mma[shim::self()];
    mine = {a0, a1, a2, a3, b0, b1};
    shim::wait(shim::warp_bar(), 32);
    const int base = shim::self() / 32 * 32, g = shim::lane() / 4, q = shim::lane() % 4;
    auto A = [&](int row, int k) {  // lane (row % 8, k % 8 / 2) holds it
      const auto& f = shim::cur->mma[base + row % 8 * 4 + k % 8 / 2];
      const unsigned w = f[(row >= 8) + 2 * (k >= 8)];
      return k % 2 ? hi(w) : lo(w);
    };
    auto B = [&](int k, int col) {
      const auto& f = shim::cur->mma[base + col * 4 + k % 8 / 2];
      const unsigned w = f[4 + (k >= 8)];
      return k % 2 ? hi(w) : lo(w);
    };
    float d[4];
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * q + i % 2;
      float sum = 0.f;
      for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
      d[i] = c[i] + sum;
    }
    shim::wait(shim::warp_bar(), 32);
    for (int i = 0; i < 4; ++i) c[i] = d[i];
  }
};

template <> struct DType<__half> : Traits<float_to_f16, f16_to_float> {};
template <> struct DType<__nv_bfloat16> : Traits<float_to_bf16, bf16_to_float> {};

inline uint4 ldg16(const void* p, bool ok) { return ok ? *static_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0); }
