// CPU stand-in for kernels/cp_async.cuh. With shim::defer_copies a copy lands only when a wait
// covers its group (a read before its wait sees stale bytes); without, at once (a copy into a
// stage that is still to be read overwrites it early). Tests run both.
#pragma once
#include "cuda_shim.h"

inline void cp_async_land(const shim::Copy& c) {
  if (c.ok) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}
inline shim::Fiber& cp_async_self() { return shim::cur->fibers[shim::cur->current]; }
inline void cp_async16(void* dst, const void* src, bool ok) {
  if (shim::defer_copies) cp_async_self().open.push_back({dst, src, ok});
  else cp_async_land({dst, src, ok});
}
inline void cp_async_commit() {
  auto& f = cp_async_self();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
template <int N> inline void cp_async_wait() {
  auto& f = cp_async_self();
  while (f.groups.size() > N) {
    for (const auto& c : f.groups.front()) cp_async_land(c);
    f.groups.erase(f.groups.begin());
  }
}
inline unsigned dynamic_smem_size() { return shim::dyn_smem; }
