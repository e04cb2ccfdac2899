// Asynchronous global -> shared copies (sm_80+), 16 bytes a thread, and the group waits.
// Only attention.cu uses these; tests/cpu_cuda/ stands in for this header (and dtype.cuh) to
// run that kernel's source on the CPU.
#pragma once

// 16 bytes from global `src` into shared `dst`, through L2 only (each K/V byte is read once);
// zeros instead, reading nothing, when !ok (masked tokens, chunks past the head dim).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Returns once at most N of this thread's committed groups are still in flight; the thread's
// own copies of the others are then visible to it.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Bytes of dynamic shared memory this launch got.
__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(n));
  return n;
}
