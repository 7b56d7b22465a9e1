// T = (I + A)^-1 for the strictly lower kChunk x kChunk matrix A of a chunk (float32, shared
// memory), used by the forward (cuda/chunk_prepare.cu) and by the backward's recomputation
// (cuda/backward_chunk.cu): the diagonal 16 x 16 blocks by forward substitution (a warp each,
// a lane per column), then T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ in order of I - J. The
// sequential part is 16 steps; a row-by-row substitution over the chunk takes 64 (in the
// backward's records it was 15% of the kernel's samples, with the barrier after it).
#pragma once

#include <cuda_runtime.h>

#include "cuda/chunk_params.h"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kInverseBlocks = kChunk / kSubChunk;

// The products sum_M A_IM T_MJ of one distance I - J, before T_II multiplies them.
struct InverseScratch {
  alignas(16) float x[kInverseBlocks - 1][kSubChunk][kSubChunk + 4];
};

// Writes all of t (zeros above the diagonal), reading a's entries below the diagonal only.
// t and its row stride ldt (floats) allow 16-byte accesses. Block-wide: kThreads threads,
// at least kInverseBlocks warps; starts and ends with a barrier.
template <int kThreads>
__device__ void invert_unit_lower(const float* a, int lda, float* t, int ldt, InverseScratch& s) {
  static_assert(kThreads / 32 >= kInverseBlocks, "a warp per diagonal block");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __syncthreads();
  // The blocks above the diagonal are zeros; the others are all written below.
  constexpr int kQuadsPerRow = kChunk / 4;
  for (int e = tid; e < kChunk * kQuadsPerRow; e += kThreads) {
    const int r = e / kQuadsPerRow, q = e % kQuadsPerRow;
    if (4 * q / kSubChunk > r / kSubChunk)
      *reinterpret_cast<float4*>(&t[r * ldt + 4 * q]) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (warp < kInverseBlocks && lane < kSubChunk) {
    const int b = kSubChunk * warp;
    float x[kSubChunk];
#pragma unroll
    for (int i = 0; i < kSubChunk; ++i) {
      float acc = i == lane ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc -= a[(b + i) * lda + b + m] * x[m];
      x[i] = acc;
      t[(b + i) * ldt + b + lane] = acc;
    }
  }
  __syncthreads();
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

}  // namespace
}  // namespace flashdelta::detail::cuda
