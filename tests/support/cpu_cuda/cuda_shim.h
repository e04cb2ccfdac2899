// Just enough of CUDA to run a kernel's source on the CPU, for tests: every thread of a block is
// a fiber (ucontext) of one OS thread, switched only where CUDA threads meet (__syncthreads, warp
// shuffles, the warp-wide MMA), so a block runs deterministically; blocks run one after another.
// Memory is the host's: device pointers are host pointers, shared memory one static buffer.
#pragma once
#include <ucontext.h>

#include <math.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace shim {

struct Copy {
  void* dst;
  const void* src;
  bool ok;
};

struct Fiber {
  ucontext_t ctx;
  dim3 tid;
  bool done = false;
  std::vector<Copy> open;                 // cp.async copies not yet committed
  std::vector<std::vector<Copy>> groups;  // committed, not yet landed (oldest first)
};

struct Barrier {
  int arrived = 0;
  unsigned gen = 0;
};

struct Block {
  dim3 bid, grid, block;
  std::vector<Fiber> fibers;
  int current = 0, live = 0;
  ucontext_t sched;
  Barrier block_bar;
  std::vector<Barrier> warp_bar;
  std::vector<unsigned> slots;             // one 32-bit word a thread (shuffles)
  std::vector<std::vector<unsigned>> mma;  // a[4], b[2] per thread
  std::function<void()> body;
};

inline Block* cur = nullptr;
inline unsigned dyn_smem = 0;
inline bool defer_copies = false;  // cp.async lands at its wait (true) or at once (false)

constexpr size_t kStack = 1 << 16;
inline std::vector<std::unique_ptr<char[]>> stacks;  // reused by every block

inline void yield() { swapcontext(&cur->fibers[cur->current].ctx, &cur->sched); }

inline void wait(Barrier& b, int count) {
  const unsigned gen = b.gen;
  if (++b.arrived == count) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  while (b.gen == gen) yield();
}

inline int self() { return cur->current; }
inline int lane() { return self() % 32; }
inline Barrier& warp_bar() { return cur->warp_bar[self() / 32]; }

inline void trampoline() {
  cur->body();
  cur->fibers[cur->current].done = true;
  --cur->live;
  swapcontext(&cur->fibers[cur->current].ctx, &cur->sched);
}

// Runs body() as every thread of block `bid`.
inline void run_block(dim3 grid, dim3 bid, dim3 block, std::function<void()> body) {
  Block b;
  b.bid = bid, b.grid = grid, b.block = block, b.body = std::move(body);
  const int n = block.x * block.y * block.z;
  b.fibers.resize(n);
  b.warp_bar.resize((n + 31) / 32);
  b.slots.resize(n);
  b.mma.assign(n, std::vector<unsigned>(6));
  b.live = n;
  cur = &b;
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    if (static_cast<int>(stacks.size()) <= i) stacks.emplace_back(new char[kStack]);
    f.tid = {static_cast<unsigned>(i % block.x), static_cast<unsigned>(i / block.x % block.y),
             static_cast<unsigned>(i / (block.x * block.y))};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i].get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
  }
  while (b.live > 0)
    for (int i = 0; i < n; ++i)
      if (!b.fibers[i].done) {
        b.current = i;
        swapcontext(&b.sched, &b.fibers[i].ctx);
      }
  cur = nullptr;
}

template <class V>
inline V shfl(V v, int src) {
  static_assert(sizeof(V) == 4);
  unsigned w;
  std::memcpy(&w, &v, 4);
  cur->slots[self()] = w;
  wait(warp_bar(), 32);
  w = cur->slots[self() / 32 * 32 + (src & 31)];
  wait(warp_bar(), 32);
  std::memcpy(&v, &w, 4);
  return v;
}

}  // namespace shim

#define threadIdx (shim::cur->fibers[shim::cur->current].tid)
#define blockIdx (shim::cur->bid)
#define blockDim (shim::cur->block)
#define gridDim (shim::cur->grid)

inline void __syncthreads() { shim::wait(shim::cur->block_bar, shim::cur->live); }
inline void __threadfence() {}
inline void __trap() {
  std::fprintf(stderr, "__trap\n");
  std::abort();
}
template <class V> inline V __shfl_sync(unsigned, V v, int src) { return shim::shfl(v, src); }
template <class V> inline V __shfl_xor_sync(unsigned, V v, int mask) { return shim::shfl(v, shim::lane() ^ mask); }
template <class V> inline V __ldg(const V* p) { return *p; }
template <class V> inline V __ldcg(const V* p) { return *p; }
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long xy = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= ((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
using std::max;
using std::min;
