// Which chunks belong to which sequence, and where a chunk's workspace record lies: shared by
// the chunkwise prepare and state kernels (cuda/chunk_params.h).
#pragma once

#include "cuda/chunk_params.h"
#include "cuda/mma.cuh"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Chunks [first, first + count) of the workspace belong to sequence n.
struct ChunkRange {
  int64_t first, count;
};

__device__ ChunkRange chunk_range(const ChunkParams& c, int64_t n) {
  if (!c.ws.chunk_start) return {n * c.chunks_per_row, c.chunks_per_row};
  return {c.ws.chunk_start[n], c.ws.chunk_start[n + 1] - c.ws.chunk_start[n]};
}

// Chunk `chunk` of the workspace: its sequence, and its tokens [t, t + len) of it.
struct ChunkRef {
  Sequence seq;
  int64_t t;
  int len;
};

// False for grid slots past the last chunk (cu_seqlens: the grid is an upper bound).
__device__ bool locate_chunk(const ChunkParams& c, int64_t chunk, ChunkRef& ref) {
  int64_t n = 0, local = 0;
  if (!c.ws.chunk_start) {
    n = chunk / c.chunks_per_row;
    local = chunk % c.chunks_per_row;
  } else {
    const int64_t* start = c.ws.chunk_start;
    if (chunk >= start[c.p.N]) return false;
    int64_t lo = 0, hi = c.p.N;  // the last n with start[n] <= chunk
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (start[mid] <= chunk) lo = mid; else hi = mid;
    }
    n = lo;
    local = chunk - start[n];
  }
  ref.seq = sequence_of(c.p, n);
  ref.t = local * kChunk;
  const int64_t left = ref.seq.len - ref.t;
  ref.len = static_cast<int>(left < kChunk ? left : kChunk);
  return true;
}

// The bf16 matrices of one record.
struct Record {
  bf16 *qg, *kg, *w, *u, *aqk;
  float* decay;
};

__device__ __forceinline__ Record record_of(const ChunkParams& c, int64_t rec) {
  const int64_t kp = c.KP;
  auto at = [](uint16_t* base, int64_t off) { return reinterpret_cast<bf16*>(base) + off; };
  return {at(c.ws.qg, rec * kChunk * kp), at(c.ws.kg, rec * kChunk * kp),
          at(c.ws.w, rec * kChunk * kp),  at(c.ws.u, rec * kChunk * c.VP),
          at(c.ws.aqk, rec * kChunk * kChunk), c.ws.decay + rec * kp};
}

}  // namespace
}  // namespace flashdelta::detail::cuda
