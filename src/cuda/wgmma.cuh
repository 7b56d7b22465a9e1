// Warpgroup tensor-core products on Hopper (sm_90a): wgmma.mma_async m64n64k16 with bfloat16
// (or float16) operands and float32 accumulators, the left operand from registers and the
// right one from shared memory through a matrix descriptor. The right operands are record tiles
// (cuda/chunk_records.cuh): 64 rows of 128 bytes with the 128-byte swizzle, 1024-byte aligned.
//
// Register layouts (PTX ISA, "Register fragments and shared memory matrix layouts" of
// wgmma): warp w of the warpgroup holds rows 16 w .. 16 w + 15 of the m64 operands. Its left
// fragment for a k16 step is that of mma.sync m16n8k16 (mma.cuh), and its m64n64 accumulator
// is 8 tiles laid out as mma.sync's 16x8 C tiles (Acc), tile j for columns 8 j .. 8 j + 7. So
// a warp's rows keep the layout they have under mma.sync, and the two paths share their
// epilogues.
//
// Ordering: wgmma_fence() before a batch whose registers other instructions wrote, then the
// products, wgmma_commit(), and wgmma_wait<N>() before the accumulators (or the left
// fragments' registers) are touched again; hold_registers() keeps the compiler from moving
// accumulators across those points. The shared-memory operands must have landed for the
// async proxy: bulk copies completed on an mbarrier have.
#pragma once

#include <cstdint>

#include "cuda/mma.cuh"

namespace flashdelta::detail::cuda {

// Whether this compilation pass emits wgmma (sm_90a's architecture-specific features); the
// callers fall back to mma.sync elsewhere.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
inline constexpr bool kWgmmaCompiled = true;
#else
inline constexpr bool kWgmmaCompiled = false;
#endif

// The descriptor of a 128-byte-swizzled operand in shared memory, made once per matrix: at(b)
// describes the operand starting b bytes in (its tile plus the k-step's unswizzled offset),
// by a 32-bit add to the start-address field (shared addresses stay below 2^18, so the
// field never carries). K-major (k contiguous in each 128-byte row, one row per n): rows 128
// bytes apart, groups of 8 rows 1024 bytes apart (the stride offset); the leading offset is
// unused. N-major (n contiguous in each row, one row per k): groups of 8 k rows 1024 bytes
// apart, and the leading offset steps to the next 64 columns (unused at n64).
struct SwizzledOperand {
  uint32_t lo;  // start address / 16 and the leading offset

  __device__ explicit SwizzledOperand(const void* base)
      : lo((smem_address(base) & 0x3FFFFu) >> 4 | (8192u >> 4) << 16) {}
  __device__ uint64_t at(uint32_t bytes) const {
    constexpr uint32_t kStride = 1024 >> 4, kSwizzle128 = 1u << 30;
    return static_cast<uint64_t>(kStride | kSwizzle128) << 32 | (lo + (bytes >> 4));
  }
};

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups of this warp are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// An empty asm that reads and writes every accumulator: the compiler keeps them in place
// (no copies or reloads) across the point where it stands.
template <int N>
__device__ __forceinline__ void hold_registers(Acc (&acc)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[j].d[e])::"memory");
}

// The 32 accumulator operands of an m64n64 product, d[0].d[0] .. d[7].d[3] as %0 .. %31.
#define FLASHDELTA_WGMMA_N64_ACCUMULATORS(d)                                               \
  "+f"(d[0].d[0]), "+f"(d[0].d[1]), "+f"(d[0].d[2]), "+f"(d[0].d[3]), "+f"(d[1].d[0]),     \
      "+f"(d[1].d[1]), "+f"(d[1].d[2]), "+f"(d[1].d[3]), "+f"(d[2].d[0]), "+f"(d[2].d[1]), \
      "+f"(d[2].d[2]), "+f"(d[2].d[3]), "+f"(d[3].d[0]), "+f"(d[3].d[1]), "+f"(d[3].d[2]), \
      "+f"(d[3].d[3]), "+f"(d[4].d[0]), "+f"(d[4].d[1]), "+f"(d[4].d[2]), "+f"(d[4].d[3]), \
      "+f"(d[5].d[0]), "+f"(d[5].d[1]), "+f"(d[5].d[2]), "+f"(d[5].d[3]), "+f"(d[6].d[0]), \
      "+f"(d[6].d[1]), "+f"(d[6].d[2]), "+f"(d[6].d[3]), "+f"(d[7].d[0]), "+f"(d[7].d[1]), \
      "+f"(d[7].d[2]), "+f"(d[7].d[3])
#define FLASHDELTA_WGMMA_M64N64K16(types)                                                  \
  "{\n"                                                                                    \
  ".reg .pred accumulate;\n"                                                               \
  "setp.ne.b32 accumulate, 1, 0;\n"                                                        \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." types " "                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "      \
  "{%32, %33, %34, %35}, %36, accumulate, %37, 1, %38;\n"                                  \
  "}\n"

// d[64 x 64] += sign a[64 x 16] . B[16 x 64], B = X^T for a K-major tile X (kNMajor false:
// X's rows are the 64 columns n, its 16 k contiguous) or B itself N-major (kNMajor true:
// rows are k, the 64 n contiguous). kSign is +1 or -1 (the left operand negated). Both
// operands bfloat16, or with kF16 both float16 (the A_qk product of ChunkParams::aqk_f16).
template <bool kNMajor, int kSign = 1, bool kF16 = false>
__device__ __forceinline__ void wgmma_m64n64k16(Acc (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  static_assert(kSign == 1 || kSign == -1);
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16)
    asm volatile(FLASHDELTA_WGMMA_M64N64K16("f16.f16")
                 : FLASHDELTA_WGMMA_N64_ACCUMULATORS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kSign),
                   "n"(kNMajor ? 1 : 0));
  else
    asm volatile(FLASHDELTA_WGMMA_M64N64K16("bf16.bf16")
                 : FLASHDELTA_WGMMA_N64_ACCUMULATORS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kSign),
                   "n"(kNMajor ? 1 : 0));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}
#undef FLASHDELTA_WGMMA_M64N64K16
#undef FLASHDELTA_WGMMA_N64_ACCUMULATORS

}  // namespace flashdelta::detail::cuda
