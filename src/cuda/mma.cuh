// Warp-level tensor-core products for the chunkwise kernels: mma.sync m16n8k16 with bfloat16
// operands (m16n8k8 with tf32 operands for the backward) and float32 accumulators, and
// ldmatrix loads of the operand fragments from shared memory. Needs sm_80 or later (the host
// refuses older GPUs before launching).
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane l, g = l / 4, c = l % 4:
//   A 16x16: a[0] = (row g, cols 2c..2c+1), a[1] = row g + 8, a[2] = cols + 8, a[3] = both
//   B 16x8:  b[0] = (rows 2c..2c+1, col g), b[1] = rows + 8
//   C 16x8:  d[0..1] = (row g, cols 2c..2c+1), d[2..3] = row g + 8
// Shared-memory operands are row-major with a row length (ld, in elements) that is a
// multiple of 8 so every ldmatrix row address is 16-byte aligned; a row length of 8 mod 64
// elements keeps the eight rows of one 8x8 matrix in distinct banks.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace flashdelta::detail::cuda {

using bf16 = __nv_bfloat16;

// Accumulator of one 16x8 output tile.
struct Acc {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
};

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// acc += a b on mma.sync m16n8k16 with bfloat16 operands, or float16 ones with kF16.
template <bool kF16 = false>
__device__ __forceinline__ void mma_16bit(Acc& acc, const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FLASHDELTA_MMA_M16N8K16(types)                                                      \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." types                                \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                \
               : "+f"(acc.d[0]), "+f"(acc.d[1]), "+f"(acc.d[2]), "+f"(acc.d[3])             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (kF16)
    FLASHDELTA_MMA_M16N8K16("f16.f16");
  else
    FLASHDELTA_MMA_M16N8K16("bf16.bf16");
#undef FLASHDELTA_MMA_M16N8K16
#else
  __trap();
#endif
}
__device__ __forceinline__ void mma_bf16(Acc& acc, const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  mma_16bit<false>(acc, a, b0, b1);
}

// float32 rounded to nearest tf32 (10-bit mantissa): the tf32 mma reads only the top 19 bits
// of each operand, and truncating them instead would bias long sums. From sm_90 on, ties to
// even (cvt.rn): one instruction (F2FP.TF32), where ties away (cvt.rna, the only mode sm_80
// has) takes an |x| < inf test and an integer add per element. The low 13 bits of the
// result are not promised to be zero (the mma ignores them): see split_tf32.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
  r = 0;
  (void)x;
  __trap();
#endif
  return r;
}

// x as tf32 hi + lo parts, x - hi - lo within ~2^-21 |x|; hi's low bits cleared before the
// subtraction, so lo is what the mma's reading of hi leaves.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi & 0xffffe000u));
}

// mma.sync m16n8k8 with tf32 operands (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32),
// lane l, g = l / 4, c = l % 4:
//   A 16x8: a[0] = (row g, col c), a[1] = row g + 8, a[2] = col c + 4, a[3] = both
//   B 8x8:  b0 = (row c, col g), b1 = row c + 4;  C as for m16n8k16.
__device__ __forceinline__ void mma_tf32(Acc& acc, const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(acc.d[0]), "+f"(acc.d[1]), "+f"(acc.d[2]), "+f"(acc.d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0;
  __trap();
#endif
}

// Whether this pass has stmatrix (sm_90 and later).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline constexpr bool kStmatrix = true;
#else
inline constexpr bool kStmatrix = false;
#endif

// Stores four 8x8 bfloat16 matrices transposed: r[m] is this lane's pair of matrix m in the
// fragment layout (row l / 4, columns 2 (l % 4) and + 1), and lane 8 m + i gives the address
// of row i of matrix m's transpose, where fragment column i lands (16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(bf16* row, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(smem_address(row)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  (void)row, (void)r;
  __trap();
#endif
}

// A fragment of the 16x16 block at (m0, k0) of a row-major [m][k] matrix.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* s, int ld, int m0, int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4<false>(a, s + (m0 + l % 16) * ld + k0 + 8 * (l / 16));
}

// A fragment of the 16x16 block at (m0, k0) of A = X^T for a row-major [k][m] matrix X.
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const bf16* x, int ld, int m0,
                                                  int k0) {
  const int l = threadIdx.x % 32, mat = l / 8;
  ldmatrix_x4<true>(a, x + (k0 + l % 8 + 8 * (mat / 2)) * ld + m0 + 8 * (mat % 2));
}

// B fragments of two adjacent 16x8 tiles (columns n0..n0+15, rows k0..k0+15) of B = X^T for
// a row-major [n][k] matrix X: b[0], b[1] for columns n0.., b[2], b[3] for n0 + 8...
__device__ __forceinline__ void load_b_pair_nk(uint32_t (&b)[4], const bf16* x, int ld, int n0,
                                               int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4<false>(b, x + (n0 + l % 8 + 8 * (l / 16)) * ld + k0 + 8 * ((l / 8) % 2));
}

// The same for a row-major [k][n] matrix B.
__device__ __forceinline__ void load_b_pair_kn(uint32_t (&b)[4], const bf16* s, int ld, int n0,
                                               int k0) {
  const int l = threadIdx.x % 32, mat = l / 8;
  ldmatrix_x4<true>(b, s + (k0 + l % 8 + 8 * (mat % 2)) * ld + n0 + 8 * (mat / 2));
}

// Row (0..15) and column (0..7) of accumulator element e (0..3) of this lane.
__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x % 32) / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int e) { return 2 * (threadIdx.x % 4) + e % 2; }

}  // namespace flashdelta::detail::cuda
