// Which chunks belong to which sequence, shared by the chunkwise forward and backward: the
// chunks of batch row n are n * chunks_per_row .. (whole rows), or with cu_seqlens those the
// device-computed table chunk_start gives (cuda/chunk_table.cu).
#pragma once

#include "cuda/chunk_params.h"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Chunks [first, first + count) belong to sequence n.
struct ChunkRange {
  int64_t first, count;
};

__device__ ChunkRange chunk_range(const int64_t* chunk_start, int64_t chunks_per_row,
                                  int64_t n) {
  if (!chunk_start) return {n * chunks_per_row, chunks_per_row};
  return {chunk_start[n], chunk_start[n + 1] - chunk_start[n]};
}

// Chunk `chunk`: its sequence, and its tokens [t, t + len) of it.
struct ChunkRef {
  Sequence seq;
  int64_t t;
  int len;
};

// False for grid slots past the last chunk (cu_seqlens: the grid is an upper bound).
__device__ bool locate_chunk(const RecurrentParams& p, const int64_t* chunk_start,
                             int64_t chunks_per_row, int64_t chunk, ChunkRef& ref) {
  int64_t n = 0, local = 0;
  if (!chunk_start) {
    n = chunk / chunks_per_row;
    local = chunk % chunks_per_row;
  } else {
    if (chunk >= chunk_start[p.N]) return false;
    int64_t lo = 0, hi = p.N;  // the last n with chunk_start[n] <= chunk
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (chunk_start[mid] <= chunk) lo = mid; else hi = mid;
    }
    n = lo;
    local = chunk - chunk_start[n];
  }
  ref.seq = sequence_of(p, n);
  ref.t = local * kChunk;
  const int64_t left = ref.seq.len - ref.t;
  ref.len = static_cast<int>(left < kChunk ? left : kChunk);
  return true;
}

}  // namespace
}  // namespace flashdelta::detail::cuda
