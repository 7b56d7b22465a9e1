// Device helpers of the CUDA backward's stages (cuda/backward_params.h): where a chunk lies,
// how the float32 buffers are indexed, and the block-wide tile product every per-chunk stage
// is written in.
#pragma once

#include "cuda/backward_params.h"
#include "cuda/chunk_index.cuh"
#include "cuda/device_io.cuh"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kC = kChunk;  // tokens per chunk, as in the forward
constexpr int kBackwardThreads = 256;

// The forward's chunk numbering (cuda/chunk_index.cuh) from the backward's parameters.
__device__ ChunkRange chunks_of(const BackwardParams& b, int64_t n) {
  return chunk_range(b.ws.chunk_start, b.chunks_per_row, n);
}

// Chunk `chunk`, and the buffer row of its first token (batch * T + t0 + t). False for grid
// slots past the last chunk, and for an empty chunk (a malformed device table's).
__device__ bool chunk_at(const BackwardParams& b, int64_t chunk, ChunkRef& ref, int64_t& r0) {
  if (!locate_chunk(b.p, b.ws.chunk_start, b.chunks_per_row, chunk, ref)) return false;
  r0 = ref.seq.batch * b.p.T + ref.seq.t0 + ref.t;
  return ref.len > 0;
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

// Element offset of head `head` at buffer row `row` (batch * T + t) of a token tensor.
__device__ __forceinline__ int64_t token_row_offset(const TokenTensor& x, int64_t row, int64_t T,
                                                    int64_t head) {
  return row / T * x.stride[0] + row % T * x.stride[1] + head * x.stride[2];
}

// Element offset of (slot n, head hv, key i, value j) of a state tensor (either layout).
__device__ __forceinline__ int64_t state_offset(const StateTensor& s, int64_t n, int64_t hv,
                                                int64_t i, int64_t j) {
  return n * s.slot_stride + hv * s.head_stride + i * s.key_stride + j * s.value_stride;
}

}  // namespace
}  // namespace flashdelta::detail::cuda
