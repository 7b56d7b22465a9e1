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

// Orders this thread's earlier ordinary shared-memory writes before later bulk copies into
// the same memory (the copies run in the async proxy); follow it with a block barrier.
__device__ __forceinline__ void fence_before_bulk_writes() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Rows [0, rows) x columns [0, cols) of a row-major float32 source (row length ld) into the
// first cols floats of dst's rows by one bulk copy per row, completing on `bar`; the rest of
// dst's kHeight x kWidth block (rows past `rows`, columns past `cols`) set to zero by ordinary
// stores, fenced against later copies (a block barrier must still come between). Returns the
// bytes the copies bring, for the batch's expect_bytes. Lane 0 of warp w issues rows w, w +
// kWarps, ...: a copy takes its addresses from uniform registers, so copies from several lanes
// of a warp are issued one lane after another (a loop in the SASS), and rows by thread would
// put them all on the first warps. Needs 16-byte rows on both sides: base 16-byte aligned and
// ld, cols multiples of 4 (bulk_rows_fit); kLd * 4 a multiple of 16. The caller orders its
// earlier ordinary writes to dst before the copies (fence_before_bulk_writes and a barrier).
template <int kThreads, int kWidth, int kHeight, int kLd>
__device__ __forceinline__ uint32_t bulk_stage_rows(const float* base, int64_t ld, int rows,
                                                    int cols, float (*dst)[kLd], uint64_t* bar) {
  static_assert(kLd % 4 == 0 && kWidth % 4 == 0 && kWidth <= kLd, "16-byte rows");
  constexpr int kWarps = kThreads / 32;
  if (threadIdx.x % 32 == 0)
    for (int m = static_cast<int>(threadIdx.x / 32); m < rows; m += kWarps)
      bulk_copy(&dst[m][0], base + m * ld, static_cast<uint32_t>(cols) * 4u, bar);
  if (rows < kHeight || cols < kWidth) {
    constexpr int kRuns = kWidth / 4;
    for (int idx = threadIdx.x; idx < kHeight * kRuns; idx += kThreads) {
      const int m = idx / kRuns, q = idx % kRuns * 4;
      if (m >= rows || q >= cols)
        *reinterpret_cast<float4*>(&dst[m][q]) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    fence_before_bulk_writes();  // these zeros before the next step's copies to the same rows
  }
  return static_cast<uint32_t>(rows) * static_cast<uint32_t>(cols) * 4u;
}

// Whether bulk_stage_rows may copy these rows.
__device__ __forceinline__ bool bulk_rows_fit(const float* base, int64_t ld, int cols) {
  return kBulkCopies && (reinterpret_cast<uintptr_t>(base) & 15) == 0 && ld % 4 == 0 &&
         cols % 4 == 0;
}

}  // namespace
}  // namespace flashdelta::detail::cuda
