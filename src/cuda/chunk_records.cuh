// Which chunks belong to which sequence, and where a chunk's workspace record lies: shared by
// the chunkwise prepare and state kernels (cuda/chunk_params.h).
#pragma once

#include "cuda/chunk_index.cuh"
#include "cuda/chunk_params.h"
#include "cuda/device_io.cuh"
#include "cuda/mma.cuh"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

// The forward's chunk numbering (cuda/chunk_index.cuh) from its parameters.
__device__ ChunkRange chunk_range(const ChunkParams& c, int64_t n) {
  return chunk_range(c.ws.chunk_start, c.chunks_per_row, n);
}
__device__ bool locate_chunk(const ChunkParams& c, int64_t chunk, ChunkRef& ref) {
  return locate_chunk(c.p, c.ws.chunk_start, c.chunks_per_row, chunk, ref);
}

// The bf16 matrices of one record, and its float run (decay, inv_q, inv_k). Each matrix is
// stored dense in tiles of 64 columns, tile after tile, each tile 64 token rows of 128 bytes
// with the 16-byte pieces of row t permuted by XOR with t % 8 (record_index). That is the
// 128-byte swizzle of the Hopper tensor cores' shared-memory operands (a tile's rows at
// address bits 7-9, its pieces at bits 4-6), and one bulk copy moves a whole matrix into
// shared memory as it lies. There ldmatrix's 8 consecutive rows at one column land in 8
// different bank groups too (loads without conflicts, rows without padding); and a
// state-kernel block's 64 columns of u are one run.
struct Record {
  bf16 *qg, *kg, *w, *u, *aqk, *tu, *aqk_lo;  // tu: v_from_tokens only, aqk_lo: split_aqk only
  float *decay, *inv_q, *inv_k;
};

// Element (t, x) of a record matrix (any width: the tiles make it independent of it).
__host__ __device__ __forceinline__ int64_t record_index(int t, int64_t x) {
  return (x >> 6) * (kChunk * 64) + t * 64 + ((((x >> 3) & 7) ^ (t & 7)) << 3) + (x & 7);
}

// Rows [0, kChunk) of a dense bfloat16 token tensor, kWidth channels of each, into shared
// memory by 16-byte cp.async pieces, the piece of row t at channel c going to at(t, c); zeros
// past len and past `cols`. A thread keeps one run of 8 channels and steps down the rows (a
// row's pieces go to consecutive threads: coalesced reads), so its addresses advance by
// constants. kUnroll: the loop's unrolling (all its passes by default; a kernel short of
// registers takes fewer). Commits nothing.
template <int kWidth, int kThreads, int kUnroll = kChunk, class At>
__device__ __forceinline__ void fetch_token_rows(At at, const bf16* rows, int64_t stride,
                                                 int len, int cols) {
  constexpr int kPieces = kWidth / 8, kStep = kThreads / kPieces;  // rows a pass
  static_assert(kThreads % kPieces == 0 && kChunk % kStep == 0, "whole rows a pass");
  const int t0 = threadIdx.x / kPieces, c8 = 8 * (threadIdx.x % kPieces);
  const bool in_cols = c8 < cols;
  const bf16* src = rows + t0 * stride + c8;
#pragma unroll(kUnroll)
  for (int r = 0; r < kChunk / kStep; ++r, src += kStep * stride) {
    const int t = t0 + r * kStep;
    const bool live = in_cols && t < len;
    // 0 bytes: zero-filled, nothing read (the first row stands in for the address)
    copy_async<16>(at(t, c8), live ? src : rows, live ? 16 : 0);
  }
}

// The same into a matrix laid out as a record's (record_index).
template <int kWidth, int kThreads, int kUnroll = kChunk>
__device__ __forceinline__ void fetch_token_rows(bf16* record, const bf16* rows, int64_t stride,
                                                 int len, int cols) {
  fetch_token_rows<kWidth, kThreads, kUnroll>(
      [record](int t, int c) { return record + record_index(t, c); }, rows, stride, len, cols);
}

// chunk_record_floats(KP) as a constant device code can read (the function is host code),
// and where the run's inverse lengths begin (after KP decays: inv_q, then inv_k).
template <int KP>
inline constexpr int kRecordFloats = chunk_record_floats(KP);
template <int KP>
inline constexpr int kInvQAt = KP;
template <int KP>
inline constexpr int kInvKAt = KP + kChunk;

// KP: the kernel's key width, c.KP.
template <int KP>
__device__ __forceinline__ Record record_of(const ChunkParams& c, int64_t rec) {
  constexpr int64_t kp = KP;
  // Matrices a launch has no region for (qk_from_tokens, v_from_tokens, no delta rule, no
  // split_aqk) are null.
  auto at = [](uint16_t* base, int64_t off) {
    return base ? reinterpret_cast<bf16*>(base) + off : nullptr;
  };
  float* run = c.ws.decay + rec * kRecordFloats<KP>;
  return {at(c.ws.qg, rec * kChunk * kp), at(c.ws.kg, rec * kChunk * kp),
          at(c.ws.w, rec * kChunk * kp),  at(c.ws.u, rec * kChunk * c.VP),
          at(c.ws.aqk, rec * kChunk * kChunk), at(c.ws.tu, rec * kChunk * kChunk),
          at(c.aqk_lo, rec * kChunk * kChunk), run, run + kInvQAt<KP>, run + kInvKAt<KP>};
}

// mma.cuh's load_a, load_b_pair_nk and load_b_pair_kn for a record matrix in shared memory,
// laid out as in global memory (record_index).
__device__ __forceinline__ void load_record_a(uint32_t (&a)[4], const bf16* x, int m0, int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4<false>(a, x + record_index(m0 + l % 16, k0 + 8 * (l / 16)));
}
__device__ __forceinline__ void load_record_b_pair_nk(uint32_t (&b)[4], const bf16* x, int n0,
                                                      int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4<false>(b, x + record_index(n0 + l % 8 + 8 * (l / 16), k0 + 8 * ((l / 8) % 2)));
}
__device__ __forceinline__ void load_record_b_pair_kn(uint32_t (&b)[4], const bf16* x, int n0,
                                                      int k0) {
  const int l = threadIdx.x % 32, mat = l / 8;
  ldmatrix_x4<true>(b, x + record_index(k0 + l % 8 + 8 * (mat % 2), n0 + 8 * (mat / 2)));
}

}  // namespace
}  // namespace flashdelta::detail::cuda
