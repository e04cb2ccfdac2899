// Thread-block-cluster primitives (sm_90): barriers and distributed shared memory.
#pragma once

// Split barrier: every thread of every block arrives, then waits. A releasing arrive
// publishes the shared-memory writes that precede it (cumulatively: also those other
// threads ordered before it with __syncthreads); wait acquires everyone else's. The
// release waits for all the thread's earlier memory accesses, loads in flight too.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
// Arrive without the release: for "done reading the peers", whose reads are complete
// once their values were used, so nothing needs to drain.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Address of `p` (this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ unsigned dsmem_addr(const void* p, unsigned rank) {
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

__device__ __forceinline__ float4 ld_dsmem_f4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
