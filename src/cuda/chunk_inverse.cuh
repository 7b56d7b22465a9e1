// T = (I + A)^-1 for the strictly lower kChunk x kChunk matrix A of a chunk (float32, shared
// memory), used by the forward (cuda/chunk_prepare.cuh) and by the backward's recomputation
// (cuda/backward_chunk.cu): the diagonal 16 x 16 blocks by forward substitution (a warp each,
// a lane per column), then T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ. The sequential part is
// 16 steps; a row-by-row substitution over the chunk takes 64 (in the backward's records it
// was 15% of the kernel's samples, with the barrier after it). Two orders for the blocks
// off the diagonal:
// - by distance I - J (invert_unit_lower): every thread takes a share of each distance, on
//   the CUDA cores, with two block barriers per distance;
// - by column block (invert_unit_lower_by_columns): each warp walks halves of column blocks
//   down, its sums on the tensor cores, with no block barrier between the diagonal blocks and
//   the end: in three tf32 products (hi x hi + hi x lo + lo x hi: float32 to ~2^-21), or in
//   one where T is rounded to bfloat16 next anyway (the forward's opt-in
//   ChunkParams::inverse_one_product; bench/NOTES.md (at)).
#pragma once

#include <cuda_runtime.h>

#include "cuda/chunk_params.h"
#include "cuda/mma.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kInverseBlocks = kChunk / kSubChunk;

// The products sum_M A_IM T_MJ before T_II multiplies them: of one distance I - J, or of
// each warp's current column half.
struct InverseScratch {
  alignas(16) float x[kInverseBlocks - 1][kSubChunk][kSubChunk + 4];
};

// The blocks above the diagonal as zeros and the diagonal blocks T_II, between two block
// barriers.
template <int kThreads>
__device__ void invert_diagonal_blocks(const float* a, int lda, float* t, int ldt) {
  static_assert(kThreads / 32 >= kInverseBlocks, "a warp per diagonal block");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __syncthreads();
  constexpr int kQuadsPerRow = kChunk / 4;
  for (int e = tid; e < kChunk * kQuadsPerRow; e += kThreads) {
    const int r = e / kQuadsPerRow, q = e % kQuadsPerRow;
    if (4 * q / kSubChunk > r / kSubChunk)
      *reinterpret_cast<float4*>(&t[r * ldt + 4 * q]) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (warp < kInverseBlocks && lane < kSubChunk) {
    const int b = kSubChunk * warp;
    // Stored after the substitution (reads before stores: cuda/device_io.cuh).
    float x[kSubChunk];
#pragma unroll
    for (int i = 0; i < kSubChunk; ++i) {
      float acc = i == lane ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc -= a[(b + i) * lda + b + m] * x[m];
      x[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < kSubChunk; ++i) t[(b + i) * ldt + b + lane] = x[i];
  }
  __syncthreads();
}

// Writes all of t (zeros above the diagonal), reading a's entries below the diagonal only.
// t and its row stride ldt (floats) allow 16-byte accesses. Block-wide: kThreads threads,
// at least kInverseBlocks warps; starts and ends with a barrier.
template <int kThreads>
__device__ void invert_unit_lower(const float* a, int lda, float* t, int ldt, InverseScratch& s) {
  const int tid = threadIdx.x;
  invert_diagonal_blocks<kThreads>(a, lda, t, ldt);
  // Off the diagonal, by distance d = I - J; a thread computes 4 adjacent columns of a row.
  constexpr int kQuads = kSubChunk * kSubChunk / 4;
  for (int d = 1; d < kInverseBlocks; ++d) {
    const int units = (kInverseBlocks - d) * kQuads;
    for (int e = tid; e < units; e += kThreads) {
      const int I = d + e / kQuads, J = I - d, i = e % kQuads / 4, j = 4 * (e % 4);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int m = kSubChunk * J; m < kSubChunk * I; ++m) {
        const float am = a[(kSubChunk * I + i) * lda + m];
        const float4 tm = *reinterpret_cast<const float4*>(&t[m * ldt + kSubChunk * J + j]);
        acc.x += am * tm.x, acc.y += am * tm.y, acc.z += am * tm.z, acc.w += am * tm.w;
      }
      *reinterpret_cast<float4*>(&s.x[e / kQuads][i][j]) = acc;
    }
    __syncthreads();
    for (int e = tid; e < units; e += kThreads) {
      const int I = d + e / kQuads, J = I - d, i = e % kQuads / 4, j = 4 * (e % 4);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int m = 0; m <= i; ++m) {
        const float tm = t[(kSubChunk * I + i) * ldt + kSubChunk * I + m];
        const float4 x = *reinterpret_cast<const float4*>(&s.x[e / kQuads][m][j]);
        acc.x -= tm * x.x, acc.y -= tm * x.y, acc.z -= tm * x.z, acc.w -= tm * x.w;
      }
      *reinterpret_cast<float4*>(&t[(kSubChunk * I + i) * ldt + kSubChunk * J + j]) = acc;
    }
    __syncthreads();
  }
}

// The same contract as invert_unit_lower (ldt a multiple of 4 floats; warps past the fourth
// wait at the barriers). The columns of T below the diagonal blocks split into six
// independent items, a column block J < 3 and a half of its 16 columns each: warps 0 and 1
// take block 0's halves (three blocks down, 12 k-steps), warps 2 and 3 blocks 1 and 2 of
// their half (2 + 1 blocks, 8 k-steps). An item computes T_IJ for I = J + 1 .. 3 in order:
// X = sum_{J <= M < I} A_IM T_MJ by m16n8k8 tf32 products (its T_MJ are the diagonal block
// and its own earlier results), X to the warp's scratch, then T_IJ = -T_II X in float32,
// four columns of a row per lane. kFloat32Products: each product as three (operands split
// hi + lo), else one on the operands rounded to tf32.
template <int kThreads, bool kFloat32Products = true>
__device__ void invert_unit_lower_by_columns(const float* a, int lda, float* t, int ldt,
                                             InverseScratch& s) {
  static_assert(kThreads / 32 >= kInverseBlocks, "four warps share the six column halves");
  constexpr int kLdx = 12;  // a warp's X: 16 rows x 8 columns, rows 48 bytes apart
  static_assert(sizeof(InverseScratch) >= sizeof(float) * kInverseBlocks * kSubChunk * kLdx);
  invert_diagonal_blocks<kThreads>(a, lda, t, ldt);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  if (warp < kInverseBlocks) {
    float* x = &s.x[0][0][0] + warp * kSubChunk * kLdx;
    const int half = 8 * (warp % 2);
    for (int J = warp / 2; J <= (warp < 2 ? 0 : 2); ++J) {
      const int j0 = kSubChunk * J + half;  // the item's 8 columns
      for (int I = J + 1; I < kInverseBlocks; ++I) {
        const int i0 = kSubChunk * I;
        Acc acc;
        for (int k0 = kSubChunk * J; k0 < i0; k0 += 8) {
          const float* ar = a + (i0 + g) * lda + k0 + c;
          const float* br = t + (k0 + c) * ldt + j0 + g;
          if constexpr (kFloat32Products) {
            uint32_t ah[4], al[4];
            split_tf32(ar[0], ah[0], al[0]);
            split_tf32(ar[8 * lda], ah[1], al[1]);
            split_tf32(ar[4], ah[2], al[2]);
            split_tf32(ar[8 * lda + 4], ah[3], al[3]);
            uint32_t bh0, bl0, bh1, bl1;
            split_tf32(br[0], bh0, bl0);
            split_tf32(br[4 * ldt], bh1, bl1);
            mma_tf32(acc, ah, bh0, bh1);
            mma_tf32(acc, ah, bl0, bl1);
            mma_tf32(acc, al, bh0, bh1);
          } else {
            const uint32_t ah[4] = {to_tf32(ar[0]), to_tf32(ar[8 * lda]), to_tf32(ar[4]),
                                    to_tf32(ar[8 * lda + 4])};
            mma_tf32(acc, ah, to_tf32(br[0]), to_tf32(br[4 * ldt]));
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) x[acc_row(e) * kLdx + acc_col(e)] = acc.d[e];
        __syncwarp();
        // Row i, columns c0 .. c0 + 3 of T_IJ = -T_II X; T_II's entries right of its diagonal
        // are zeros, so every lane runs all 16 terms (no divergence).
        const int i = lane / 2, c0 = 4 * (lane % 2);
        const float* tii = t + (i0 + i) * ldt + i0;
        float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int m = 0; m < kSubChunk; ++m) {
          const float tm = tii[m];
          const float4 xm = *reinterpret_cast<const float4*>(x + m * kLdx + c0);
          r.x -= tm * xm.x, r.y -= tm * xm.y, r.z -= tm * xm.z, r.w -= tm * xm.w;
        }
        *reinterpret_cast<float4*>(t + (i0 + i) * ldt + j0 + c0) = r;
        __syncwarp();  // x is rewritten and T_IJ read as an operand by the next I
      }
    }
  }
  __syncthreads();
}

}  // namespace
}  // namespace flashdelta::detail::cuda
