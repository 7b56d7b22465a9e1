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

// Operands of staged_product: element (i, j) of a float32 matrix in global or shared memory.
// Rows: row-major with row stride ld (contiguous in j); Cols: its transpose (contiguous in i).
struct Rows {
  static constexpr bool kContiguousFirst = false;
  const float* p;
  int64_t ld;
  __device__ __forceinline__ const float* at(int i, int j) const { return p + i * ld + j; }
};
struct Cols {
  static constexpr bool kContiguousFirst = true;
  const float* p;
  int64_t ld;
  __device__ __forceinline__ const float* at(int i, int j) const { return p + j * ld + i; }
};

// Products have at most kC rows (a chunk's tokens) and 256 columns (K or V); the summed index
// is staged kStageL values at a time, double-buffered: A as [l][m], B as [l][n], read back
// four at a time.
constexpr int kStageL = 16;
constexpr int kMaxCols = 256;
struct alignas(16) ProductStage {
  float a[2][kStageL][kC + 4];
  float b[2][kStageL][kMaxCols + 4];
};

// One element into shared memory: cp.async from global memory (it lands while the block
// computes on the other buffer), a plain copy from shared memory, a zero out of range.
__device__ __forceinline__ void stage_element(float* dst, const float* src, bool ok,
                                              bool shared_src) {
  if (!ok)
    *dst = 0.f;
  else if (shared_src)
    *dst = *src;
  else
    copy_async<4>(dst, src, 4);
}

// Queues A(m, l0 + l) into a[l][m] (m < kC) and B(l0 + l, n) into b[l][n] (n < N4), walking
// the contiguous index fastest so that global reads coalesce.
template <class A, class Bm>
__device__ void stage_slices(const A& a, const Bm& bm, int M, int N, int N4, int L, int l0,
                             bool a_shared, bool b_shared, float (*sa)[kC + 4],
                             float (*sb)[kMaxCols + 4]) {
  for (int idx = threadIdx.x; idx < kStageL * kC; idx += blockDim.x) {
    const int l = A::kContiguousFirst ? idx / kC : idx % kStageL;
    const int m = A::kContiguousFirst ? idx % kC : idx / kStageL;
    stage_element(&sa[l][m], a.at(m, l0 + l), m < M && l0 + l < L, a_shared);
  }
  for (int idx = threadIdx.x; idx < kStageL * N4; idx += blockDim.x) {
    const int l = Bm::kContiguousFirst ? idx % kStageL : idx / N4;
    const int n = Bm::kContiguousFirst ? idx / kStageL : idx % N4;
    stage_element(&sb[l][n], bm.at(l0 + l, n), n < N && l0 + l < L, b_shared);
  }
}

// out(m, n) = sum over l < L of a(m, l) b(l, n) for m < M <= kC, n < N <= kMaxCols, handed to
// epi(m, n, value). Each output belongs to one thread (a 4 x 4 block; more blocks than
// threads take further passes over the operands, which keeps 16 accumulators per thread) and
// is summed in order of l: deterministic, and epi may read-modify-write any array at (m, n).
// Slice s + 1 is in flight while slice s is multiplied. Starts and ends with a block
// barrier, so operands written just before and arrays the epilogue writes are safe to use
// around it.
template <class A, class Bm, class Epi>
__device__ void staged_product(int M, int N, int L, const A& a, const Bm& bm, ProductStage& st,
                               const Epi& epi) {
  const int N4 = (N + 3) / 4 * 4, tiles_n = N4 / 4, tiles = (M + 3) / 4 * tiles_n;
  const int slices = (L + kStageL - 1) / kStageL;
  const bool a_shared = __isShared(a.p), b_shared = __isShared(bm.p);
  __syncthreads();
  for (int first = 0; first < tiles; first += kBackwardThreads) {
    const int tile = first + threadIdx.x;
    const int m0 = tile / tiles_n * 4, n0 = tile % tiles_n * 4;
    float acc[4][4] = {};
    stage_slices(a, bm, M, N, N4, L, 0, a_shared, b_shared, st.a[0], st.b[0]);
    commit_async();
    for (int s = 0; s < slices; ++s) {
      if (s + 1 < slices)
        stage_slices(a, bm, M, N, N4, L, (s + 1) * kStageL, a_shared, b_shared,
                     st.a[(s + 1) & 1], st.b[(s + 1) & 1]);
      commit_async();
      wait_async<1>();
      __syncthreads();
      if (tile < tiles) {
        const float(*sa)[kC + 4] = st.a[s & 1];
        const float(*sb)[kMaxCols + 4] = st.b[s & 1];
#pragma unroll 4
        for (int l = 0; l < kStageL; ++l) {
          const float4 av = *reinterpret_cast<const float4*>(&sa[l][m0]);
          const float4 bv = *reinterpret_cast<const float4*>(&sb[l][n0]);
          const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
        }
      }
      __syncthreads();
    }
    if (tile < tiles) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (m0 + i < M && n0 + j < N) epi(m0 + i, n0 + j, acc[i][j]);
    }
  }
  wait_async<0>();
  __syncthreads();
}

// Opts a kernel in to `bytes` of dynamic shared memory (past the 48 KB default); the host
// checked the device offers it (cuda/backward.cpp) before anything was launched.
template <class Kernel>
void set_shared_bytes(Kernel kernel, size_t bytes) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(bytes));
}

// Element (i, j) of a state tensor given on the host side (K-first or V-first, any float).
__device__ __forceinline__ float load_state_elem(const StateTensor& s, DType dt, int64_t n,
                                                 int64_t hv, int64_t i, int64_t j) {
  return load_float(s.data, dt, n * s.slot_stride + hv * s.head_stride + i * s.key_stride +
                                    j * s.value_stride);
}

}  // namespace
}  // namespace flashdelta::detail::cuda
