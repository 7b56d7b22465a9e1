// Device helpers of the CUDA backward's stages (cuda/backward_params.h): where a chunk lies,
// how the float32 buffers are indexed, and the block-wide tile product every per-chunk stage
// is written in.
#pragma once

#include "cuda/backward_params.h"
#include "cuda/device_io.cuh"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kC = kBackwardChunk;
constexpr int kBackwardThreads = 256;

// Chunks [first, first + count) belong to sequence n (the forward's numbering).
struct BackwardChunks {
  int64_t first, count;
};

__device__ BackwardChunks chunks_of(const BackwardParams& b, int64_t n) {
  if (!b.ws.chunk_start) return {n * b.chunks_per_row, b.chunks_per_row};
  return {b.ws.chunk_start[n], b.ws.chunk_start[n + 1] - b.ws.chunk_start[n]};
}

// One chunk: its sequence, its first token row r0 = batch * T + t0 + local start, and length.
struct ChunkAt {
  Sequence seq;
  int64_t t;   // first token within the sequence
  int64_t r0;  // first token row of the buffers
  int len;
};

// False for grid slots past the last chunk (with cu_seqlens the grid is an upper bound).
__device__ bool chunk_at(const BackwardParams& b, int64_t chunk, ChunkAt& at) {
  int64_t n = 0, local = 0;
  if (!b.ws.chunk_start) {
    n = chunk / b.chunks_per_row;
    local = chunk % b.chunks_per_row;
  } else {
    const int64_t* start = b.ws.chunk_start;
    if (chunk >= start[b.p.N]) return false;
    int64_t lo = 0, hi = b.p.N;  // the last n with start[n] <= chunk
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (start[mid] <= chunk) lo = mid; else hi = mid;
    }
    n = lo;
    local = chunk - start[n];
  }
  at.seq = sequence_of(b.p, n);
  at.t = local * kC;
  at.r0 = at.seq.batch * b.p.T + at.seq.t0 + at.t;
  const int64_t left = at.seq.len - at.t;
  at.len = static_cast<int>(left < kC ? left : kC);
  return at.len > 0;
}

// Row `row` of a per-value-head buffer of width `width` (K or V) at value head hv.
__device__ __forceinline__ float* head_row(float* buf, int64_t row, int64_t hv,
                                           const BackwardParams& b, int64_t width) {
  return buf + (row * b.p.HV + hv) * width;
}

// Element (i, l) of a row-major matrix with row stride ld (a functor for tile_product).
struct Rows {
  const float* p;
  int64_t ld;
  __device__ __forceinline__ float operator()(int i, int l) const { return p[i * ld + l]; }
};
// Element (i, l) of the transpose of a row-major matrix.
struct Cols {
  const float* p;
  int64_t ld;
  __device__ __forceinline__ float operator()(int i, int l) const { return p[l * ld + i]; }
};

// out(m, n) = sum over l < L of a(m, l) b(l, n) for m < M, n < N, handed to epi(m, n, value).
// Each output belongs to one thread, which sums in order of l: deterministic, and epi may
// read-modify-write any array at (m, n). Callers synchronise around it.
template <class A, class Bm, class Epi>
__device__ void tile_product(int M, int N, int L, const A& a, const Bm& bm, const Epi& epi) {
  constexpr int TM = 4, TN = 4;
  const int tiles_n = (N + TN - 1) / TN, tiles = (M + TM - 1) / TM * tiles_n;
  for (int tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
    const int m0 = tile / tiles_n * TM, n0 = tile % tiles_n * TN;
    float acc[TM][TN] = {};
    for (int l = 0; l < L; ++l) {
      float av[TM], bv[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) av[i] = m0 + i < M ? a(m0 + i, l) : 0.f;
#pragma unroll
      for (int j = 0; j < TN; ++j) bv[j] = n0 + j < N ? bm(l, n0 + j) : 0.f;
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (m0 + i < M && n0 + j < N) epi(m0 + i, n0 + j, acc[i][j]);
  }
}

// Element (i, j) of a state tensor given on the host side (K-first or V-first, any float).
__device__ __forceinline__ float load_state_elem(const StateTensor& s, DType dt, int64_t n,
                                                 int64_t hv, int64_t i, int64_t j) {
  return load_float(s.data, dt, n * s.slot_stride + hv * s.head_stride + i * s.key_stride +
                                    j * s.value_stride);
}

}  // namespace
}  // namespace flashdelta::detail::cuda
