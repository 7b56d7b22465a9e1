// Hopper's bulk copies (cp.async.bulk, sm_90): one instruction moves a whole contiguous run of
// global memory into shared memory and reports its bytes to a shared-memory barrier
// (mbarrier) when they land. A block's threads spread the copies of one batch between them,
// one thread announces the batch's byte count, and everyone waits on the barrier's phase.
// The issuing threads spend one instruction per copy rather than one per 16 bytes (cp.async),
// and hold no registers for the copies in flight.
//
// Sizes and addresses (both sides) must be multiples of 16 bytes. On older GPUs kBulkCopies
// is false and callers keep their cp.async path; these functions then compile to nothing.
#pragma once

#include <cstdint>

namespace flashdelta::detail::cuda {
namespace {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkCopies = true;
#else
constexpr bool kBulkCopies = false;
#endif

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// One arrival per phase (the announcing thread's); the caller makes the initialisation
// visible with a block barrier before any use.
__device__ __forceinline__ void init_landing_barrier(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// The announcing thread's arrival: the current phase completes once `bytes` have landed.
// Copies may land before or after it.
__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint32_t bytes,
                                          uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(shared_address(smem)),
      "l"(gmem), "r"(bytes), "r"(shared_address(bar))
      : "memory");
#endif
}

// Waits until the phase of the given parity (0 for the barrier's first use, then 1, 0, ...)
// has completed.
__device__ __forceinline__ void wait_landed(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned addr = shared_address(bar);
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
#endif
}

// Orders this thread's earlier ordinary shared-memory writes (stores, cp.async once landed)
// before later accesses of the same memory in the async proxy: bulk copies into it, wgmma
// reading it. Follow it with a block barrier.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace
}  // namespace flashdelta::detail::cuda
