// Which chunks belong to which sequence, and where a chunk's workspace record lies: shared by
// the chunkwise prepare and state kernels (cuda/chunk_params.h).
#pragma once

#include "cuda/chunk_index.cuh"
#include "cuda/chunk_params.h"
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

// The bf16 matrices of one record, and its float run: decay, inv_q, inv_k.
struct Record {
  bf16 *qg, *kg, *w, *u, *aqk;
  float *decay, *inv_q, *inv_k;
};

// chunk_record_floats(KP) as a constant device code can read (the function is host code).
template <int KP>
inline constexpr int kRecordFloats = chunk_record_floats(KP);

// KP: the kernel's key width, c.KP.
template <int KP>
__device__ __forceinline__ Record record_of(const ChunkParams& c, int64_t rec) {
  constexpr int64_t kp = KP;
  auto at = [](uint16_t* base, int64_t off) { return reinterpret_cast<bf16*>(base) + off; };
  float* run = c.ws.decay + rec * kRecordFloats<KP>;
  return {at(c.ws.qg, rec * kChunk * kp), at(c.ws.kg, rec * kChunk * kp),
          at(c.ws.w, rec * kChunk * kp),  at(c.ws.u, rec * kChunk * c.VP),
          at(c.ws.aqk, rec * kChunk * kChunk), run, run + kp, run + kp + kChunk};
}

}  // namespace
}  // namespace flashdelta::detail::cuda
