// Device helpers of the CUDA backward's stages (cuda/backward_params.h): where a chunk lies,
// how the float32 buffers are indexed, and the block-wide tile product (tensor cores, tf32)
// every stage is written in.
#pragma once

#include "cuda/backward_params.h"
#include "cuda/chunk_index.cuh"
#include "cuda/device_io.cuh"
#include "cuda/mma.cuh"
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

// What a scan block walks: sequence n and value head hv of a grid of sequences x value heads
// x `tiles` column tiles, and the sequence's chunks, one after another.
struct ScanChunks {
  int64_t n, hv;
  Sequence seq;
  ChunkRange chunks;

  __device__ ScanChunks(const BackwardParams& b, int64_t tiles)
      : n(blockIdx.x / (b.p.HV * tiles)), hv(blockIdx.x / tiles % b.p.HV) {
    seq = sequence_of(b.p, n);
    chunks = chunks_of(b, n);
  }
  // Tokens of chunk ci (0 past the sequence), its record and the buffer row of its first token.
  __device__ int len(int64_t ci) const {
    const int64_t left = seq.len - ci * kC;
    return static_cast<int>(left <= 0 ? 0 : left < kC ? left : kC);
  }
  __device__ int64_t record(const BackwardParams& b, int64_t ci) const {
    return (chunks.first + ci) * b.p.HV + hv;
  }
  __device__ int64_t row0(const BackwardParams& b, int64_t ci) const {
    return seq.batch * b.p.T + seq.t0 + ci * kC;
  }
};

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

// prefetch_row_lines (cuda/device_io.cuh) of float32 rows.
__device__ inline void prefetch_rows(const float* p, int64_t stride, int rows, int64_t row_floats) {
  prefetch_row_lines(p, stride, rows, row_floats);
}

// x rounded to the nearest bfloat16, as its bits.
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Record rec's K x V slab (K-first) of the workspace's states or state gradients, in
// bfloat16 where the workspace has them so (BackwardParams::bf16_states), else float32.
struct StateSlab {
  float* f32;
  uint16_t* b16;
  __device__ StateSlab(float* f, uint16_t* h, int64_t rec, int64_t KV)
      : f32(f ? f + rec * KV : nullptr), b16(h ? h + rec * KV : nullptr) {}
  __device__ void store(int64_t idx, float x) const {
    if (b16)
      b16[idx] = bf16_bits(x);
    else
      f32[idx] = x;
  }
};
__device__ inline StateSlab states_slab(const BackwardParams& b, int64_t rec) {
  return {b.ws.states, b.ws.states16, rec, b.p.K * b.p.V};
}
__device__ inline StateSlab dstates_slab(const BackwardParams& b, int64_t rec) {
  return {b.ws.dstates, b.ws.dstates16, rec, b.p.K * b.p.V};
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

// The chunk's rows of the buffers, for one value head: token-major buffers (inputs and
// gradients, row r0 + i) and record-major ones (the chunk's own intermediates, row i of
// record rec, contiguous).
struct ChunkRows {
  const BackwardParams& b;
  int64_t r0, rec, hv, h;
  int len;
  __device__ float* k_row(float* buf, int i) const {
    return buf + ((r0 + i) * b.p.HV + hv) * b.p.K;
  }
  __device__ float* v_row(float* buf, int i) const {
    return buf + ((r0 + i) * b.p.HV + hv) * b.p.V;
  }
  __device__ float* k_rec(float* buf, int i) const { return buf + (rec * kC + i) * b.p.K; }
  __device__ float* v_rec(float* buf, int i) const { return buf + (rec * kC + i) * b.p.V; }
  __device__ const float* key_head(const float* buf, int i) const {
    return buf + ((r0 + i) * b.H + h) * b.p.K;
  }
  __device__ float beta(int i) const { return b.ws.beta[(r0 + i) * b.p.HV + hv]; }
  // Element offset of value head hv at the chunk's first token in a token tensor; row i is
  // stride[1] further on (a chunk's tokens are consecutive rows of one batch entry), so the
  // per-element offsets need no division by T.
  __device__ int64_t token_base(const TokenTensor& x) const {
    return token_row_offset(x, r0, b.p.T, hv);
  }
  // Product operands: the chunk's rows of a buffer, or their transpose.
  __device__ Rows v_rows(const float* buf) const {
    return {buf + (r0 * b.p.HV + hv) * b.p.V, b.p.HV * b.p.V};
  }
  __device__ Rows k_recs(const float* buf) const { return {buf + rec * kC * b.p.K, b.p.K}; }
  __device__ Rows v_recs(const float* buf) const { return {buf + rec * kC * b.p.V, b.p.V}; }
  __device__ Cols k_recs_t(const float* buf) const { return {buf + rec * kC * b.p.K, b.p.K}; }
  __device__ Cols v_recs_t(const float* buf) const { return {buf + rec * kC * b.p.V, b.p.V}; }
};

// Products have at most kC rows (a chunk's tokens) and kMaxCols columns (K or V), taken
// kPassCols columns per pass; the summed index l is staged kL values at a time,
// double-buffered. Each operand is staged with its contiguous index last, so that global
// memory is read in 16-byte pieces: A(m, l) as [m][l] when contiguous in l, else [l][m];
// B(l, n) as [l][n] when contiguous in n, else [n][l]. Row lengths of 4 mod 32 floats
// ([.][l]) or 8 mod 32 ([l][.]) put the 32 elements of a tf32 fragment in distinct banks.
constexpr int kMaxCols = 256;
constexpr int kPassCols = 128;
template <int kL>
struct alignas(16) ProductStage {
  static_assert(kL % 8 == 0, "whole tf32 k-steps");
  static constexpr int kLdA = kC + 8, kLdB = kPassCols + 8, kLdL = kL + 4;
  float a[2][kL * kLdA > kC * kLdL ? kL * kLdA : kC * kLdL];
  float b[2][kL * kLdB > kPassCols * kLdL ? kL * kLdB : kPassCols * kLdL];
};

// One element into shared memory: cp.async from global memory (it lands while the block
// computes on the other buffer), a zero out of range.
__device__ __forceinline__ void stage_element(float* dst, const float* src, bool ok) {
  if (ok)
    copy_async<4>(dst, src, 4);
  else
    *dst = 0.f;
}

// Stages X(o, l0 + l) for o < extent (a multiple of 8), l < kL, zeros past O and L: at
// dst[o * ld + l] when X is contiguous in l (kContigL), else at dst[l * ld + o]. Four
// elements along the contiguous index at a time: one 16-byte copy when all are in range and
// aligned, else one by one. at(o, l) is the element's address.
template <int kL, bool kContigL, class At>
__device__ void stage_operand(const At& at, int O, int extent, int L, int l0, bool shared,
                              float* dst, int ld) {
  constexpr int kQuadsL = kL / 4;
  const int quads = kContigL ? kQuadsL : extent / 4, lines = kContigL ? extent : kL;
  for (int idx = threadIdx.x; idx < lines * quads; idx += blockDim.x) {
    const int line = idx / quads, q = idx % quads * 4;
    const int o = kContigL ? line : q, l = l0 + (kContigL ? q : line);
    float* d = dst + line * ld + q;
    const float* src = at(o, l);
    const bool full = kContigL ? o < O && l + 3 < L : o + 3 < O && l < L;
    if (full && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      if (shared)
        *reinterpret_cast<float4*>(d) = *reinterpret_cast<const float4*>(src);
      else
        copy_async<16>(d, src, 16);
      continue;
    }
    const auto element = [&](int e) { return kContigL ? at(o, l + e) : at(o + e, l); };
    const auto in_range = [&](int e) { return kContigL ? o < O && l + e < L : o + e < O && l < L; };
    if (shared) {  // all four read before any is stored (cuda/device_io.cuh)
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = in_range(e) ? *element(e) : 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) d[e] = v[e];
      continue;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) stage_element(d + e, element(e), in_range(e));
  }
}

// body(s) for each slice s < slices, with slices s + 1 .. s + kStages - 1 staged (stage(s'):
// cp.async copies into buffer s' % kStages of kStages) while body(s) runs; a block barrier
// before and after each body, so body reads its slice once every thread's copies have landed
// and no copy overwrites a buffer a body still reads.
template <int kStages, class Stage, class Body>
__device__ void over_buffered_slices(int slices, const Stage& stage, const Body& body) {
  static_assert(kStages >= 2, "one slice in flight at least");
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < slices) stage(s);
    commit_async();  // empty groups too: wait_async counts groups
  }
  for (int s = 0; s < slices; ++s) {
    if (s + kStages - 1 < slices) stage(s + kStages - 1);
    commit_async();
    wait_async<kStages - 1>();
    __syncthreads();
    body(s);
    __syncthreads();
  }
}

// An epilogue of staged_product that stores out(m, n) at row(m)[n], a float32 row in global
// memory: a lane's two adjacent columns of a row (n even) as one 8-byte store where both lie
// inside N and the address allows it, half the store instructions of 4-byte ones.
template <class Row>
struct StoreRows {
  Row row;
  __device__ __forceinline__ void pair(int m, int n, float x0, float x1, bool both) const {
    float* p = row(m) + n;
    if (both && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
      return;
    }
    p[0] = x0;
    if (both) p[1] = x1;
  }
};
template <class Row>
__device__ __forceinline__ StoreRows<Row> store_rows(const Row& row) {
  return {row};
}
template <class T>
inline constexpr bool kIsStoreRows = false;
template <class Row>
inline constexpr bool kIsStoreRows<StoreRows<Row>> = true;

// out(m, n) = sum over l < L of a(m, l) b(l, n) for m < M <= kC, n < N <= kMaxCols, handed to
// epi(m, n, value) (or stored by a StoreRows epi), on the tensor cores: tf32 operands (rounded
// to nearest), float32 accumulators. In each pass warp w owns rows 16 (w % 4) .. + 15 and
// every other 8-column tile starting at w / 4. Each output belongs to one lane and is summed
// in a fixed order: deterministic, and epi may read-modify-write any array at (m, n) that is
// not an operand. Slice s + 1 is in flight while slice s is multiplied. Starts and ends with a
// block barrier, so operands written just before and arrays the epilogue writes are safe to
// use around it.
template <int kL, class A, class Bm, class Epi>
__device__ void staged_product(int M, int N, int L, const A& a, const Bm& bm,
                               ProductStage<kL>& st, const Epi& epi) {
  using Stage = ProductStage<kL>;
  constexpr bool kALast = !A::kContiguousFirst;  // A staged [m][l]
  constexpr bool kBLast = Bm::kContiguousFirst;  // B staged [n][l]
  constexpr int kLdA = kALast ? Stage::kLdL : Stage::kLdA;
  constexpr int kLdB = kBLast ? Stage::kLdL : Stage::kLdB;
  constexpr int kRowTiles = kC / 16;
  constexpr int kColGroups = kBackwardThreads / 32 / kRowTiles;
  constexpr int kTilesPerWarp = kPassCols / 8 / kColGroups;
  const int slices = (L + kL - 1) / kL;
  const bool a_shared = __isShared(a.p), b_shared = __isShared(bm.p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = warp % kRowTiles * 16, first_tile = warp / kRowTiles;
  const bool rows = m0 < M;
  auto at_a = [&](int m, int l) { return a.at(m, l); };
  for (int n0 = 0; n0 < N; n0 += kPassCols) {
    const int N8 = (min(N - n0, kPassCols) + 7) / 8 * 8;
    auto at_b = [&](int n, int l) { return bm.at(l, n0 + n); };
    auto stage = [&](int s) {
      stage_operand<kL, kALast>(at_a, M, kC, L, s * kL, a_shared, st.a[s & 1], kLdA);
      stage_operand<kL, kBLast>(at_b, N - n0, N8, L, s * kL, b_shared, st.b[s & 1], kLdB);
    };
    Acc acc[kTilesPerWarp];
    __syncthreads();
    over_buffered_slices<2>(slices, stage, [&](int s) {
      if (rows) {
        const float* sa = st.a[s & 1];
        const float* sb = st.b[s & 1];
        auto ea = [&](int m, int k) {
          return to_tf32(kALast ? sa[m * kLdA + k] : sa[k * kLdA + m]);
        };
        auto eb = [&](int k, int n) {
          return to_tf32(kBLast ? sb[n * kLdB + k] : sb[k * kLdB + n]);
        };
#pragma unroll
        for (int k0 = 0; k0 < kL; k0 += 8) {
          const uint32_t af[4] = {ea(m0 + g, k0 + c), ea(m0 + g + 8, k0 + c),
                                  ea(m0 + g, k0 + c + 4), ea(m0 + g + 8, k0 + c + 4)};
#pragma unroll
          for (int e = 0; e < kTilesPerWarp; ++e) {
            const int n = (first_tile + kColGroups * e) * 8;
            if (n < N8) mma_tf32(acc[e], af, eb(k0 + c, n + g), eb(k0 + c + 4, n + g));
          }
        }
      }
    });
    if (!rows) continue;
    if constexpr (kIsStoreRows<Epi>) {
#pragma unroll
      for (int e = 0; e < kTilesPerWarp; ++e) {
        const int nt = (first_tile + kColGroups * e) * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // elements 2h, 2h + 1: columns n, n + 1 of row m
          const int m = m0 + acc_row(2 * h), n = n0 + nt + acc_col(2 * h);
          if (nt < N8 && m < M && n < N)
            epi.pair(m, n, acc[e].d[2 * h], acc[e].d[2 * h + 1], n + 1 < N);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < kTilesPerWarp; ++e)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int nt = (first_tile + kColGroups * e) * 8;
          const int m = m0 + acc_row(r), n = n0 + nt + acc_col(r);
          if (nt < N8 && m < M && n < N) epi(m, n, acc[e].d[r]);
        }
    }
  }
  wait_async<0>();
  __syncthreads();
}

// The slot of output column n in staged_product's epilogue: for any row m, one lane computes
// every (m, n) of a slot, in a fixed order (tiles, then elements, ascending). An array of
// [rows][kEpilogueSlots] in shared memory takes row sums in epilogues with neither a race
// nor an atomic: each lane adds to its own entries; a fixed-order sum over the slots ends it.
constexpr int kEpilogueSlots = 8;
__device__ __forceinline__ int epilogue_slot(int n) {
  constexpr int kColGroups = kBackwardThreads / 32 / (kC / 16);  // as in staged_product
  static_assert(kColGroups * 4 == kEpilogueSlots, "column group x lane of the quad");
  return n / 8 % kColGroups * 4 + n % 8 / 2;  // passes start at multiples of 16 tiles
}

// Opts a kernel in to `bytes` of dynamic shared memory (past the 48 KB default); the host
// checked the device offers it (cuda/backward.cpp) before anything was launched.
template <class Kernel>
void set_shared_bytes(Kernel kernel, size_t bytes) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(bytes));
}

}  // namespace
}  // namespace flashdelta::detail::cuda
