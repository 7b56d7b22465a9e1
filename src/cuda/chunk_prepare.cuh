// Steps 1-3 of the chunkwise forward for one (chunk, value head) per block, all chunks in
// parallel (DESIGN.md section 3): the fused transforms, Gamma (cumulative log2 decay), the
// intra-chunk matrices A_qk and A_kk on tensor cores, T = (I + A_kk)^-1, and the record the
// state kernel consumes (cuda/chunk_params.h).
//
// A vector gate makes A[i, j] = sum_c x_ic y_jc 2^(Gamma_ic - Gamma_jc) a product only after
// factorising each key channel c around a reference point r_c: x 2^(Gamma_i - r) and
// y 2^(r - Gamma_j). Row block I (16 rows, columns j < 16 (I + 1)) uses r = the midpoint of
// Gamma over the block (halfway between its values before and after the block): left of the
// diagonal block every y factor has an exponent <= 0, and inside it both factors stay within
// 2^kMaxFactorLog2 unless the channel decays by more than 2 kMaxFactorLog2 over the block
// (about 5.2 nats per token, beyond fla's lower bound of -5). Such a channel takes r = Gamma
// before the block (every exponent <= 0) and its diagonal-block terms are summed pairwise
// and exactly instead. Per-step gates are floored at kMinGateLog2 (a decay of 2^-64 is 0
// to float32 beside the rest of a sum; the floor keeps Gamma finite for gates of -inf and
// its differences precise).
// Scalar gates factor out of the key sum, and take 2^(Gamma_i - Gamma_j) per entry.
//
// q and k enter as given. With the L2 norm the slices gather each token's sum of squares (a
// half-warp's lanes hold its channel pairs: fill_slice), and the inverse lengths n_q, n_k
// enter only where a scale is exact: A_qk's columns, A_kk's rows and columns, T's columns for
// w, and in the state kernel the output's and v_new's rows (cuda/chunk_params.h). No pass
// over q and k precedes the slices, and no value is rounded to bfloat16 twice.
//
// Keys are processed in slices of kSlice channels so the block fits three times per SM.
// Without a vector gate and with dense bfloat16 inputs, A's operands are the bfloat16 rows
// of q and k as given: the whole 64 x K tiles are copied to shared memory at once
// (cp.async), A is taken over all K with no slices, and w's operand is k itself, its row
// scale beta 2^Gamma moved onto T's columns with n_k (the key tiles).
// Shared arrays read or written 16 bytes at a time are declared alignas(16), so that a new
// member or padding cannot misalign them silently.
// Each key width's kernels are instantiated in a file of their own (cuda/chunk_prepare_k64.cu,
// _k128.cu, _k256.cu: launch_prepare_width), so that they compile in parallel;
// cuda/chunk_prepare.cpp picks the width.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/chunk_inverse.cuh"
#include "cuda/chunk_params.h"
#include "cuda/chunk_records.cuh"
#include "cuda/device_io.cuh"
#include "cuda/mma.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps: warp I owns row block I of the chunk
constexpr int kSlice = 32;
constexpr float kMaxFactorLog2 = 60.f;
constexpr float kMinGateLog2 = -64.f;

// A per-step log2 gate floored at kMinGateLog2 (NaN stays NaN: bad input is not hidden).
__device__ __forceinline__ float floor_gate(float g) { return g < kMinGateLog2 ? kMinGateLog2 : g; }
constexpr int kSliceLd = kSlice + 8;
// The float32 rows of a slice (q, k, Gamma: written only for split_aqk's row_low and where a
// channel does not factorise) are 36 floats apart: fill_slice's half-warps, on rows 4 apart,
// then store their 8-byte pairs on different banks.
constexpr int kStageLd = kSlice + 4;
static_assert(kSlice == 32 && kSubChunk == 2 * 8,
              "a half-warp's lanes take the slice's channel pairs, a lane 8 of its block's rows");
constexpr int kValueTile = 64;  // value columns of u per pass
constexpr int kValueLd = kValueTile + 8;
constexpr int kChunkLd = kChunk + 8;  // the slices' T in bfloat16
// A_kk's float32 rows are 68 floats apart (4 banks): the inverse's tf32 operand loads (8 rows
// x 4 columns a warp) fall in 32 distinct banks, and finish_a's 8-byte stores (a half-warp's
// 4 rows x 4 column pairs) in 2 passes of 2; rows 65 apart had put 4 lanes on one bank in both
// (ncu (bq): ~7 M of the kernel's 10.2 M excess shared wavefronts).
constexpr int kALd = kChunk + 4;
static_assert(kThreads / 32 * kSubChunk == kChunk, "one warp per row block");

// Rows of column factors per key slice: row block I factors columns 0 .. 16 (I + 1) - 1
// around its own reference point, at rows kbar_base(I) .. of one shared table.
__host__ __device__ constexpr int kbar_base(int I) { return kSubChunk * I * (I + 1) / 2; }
constexpr int kKbarRows = kbar_base(4);

template <int KP>
struct PrepareShared {
  // Per key slice (steps 1-2).
  struct Slice {
    alignas(16) float q[kChunk][kStageLd];  // transformed q, k (zero past len / K)
    alignas(16) float k[kChunk][kStageLd];
    alignas(16) float gamma[kChunk][kStageLd];  // vector gate: Gamma after each token
    alignas(16) bf16 xq[4][kSubChunk][kSliceLd];  // row factors per warp
    alignas(16) bf16 xk[4][kSubChunk][kSliceLd];  // vector gate only (else kbar's rows)
    // Column factors per row block (kbar_base); without a vector gate rows 0 .. 63 hold k.
    alignas(16) bf16 kbar[kKbarRows][kSliceLd];
    // split_aqk: the low parts x - bfloat16(x) of the column factors, row block I's on its
    // diagonal block (tokens 16 I .. 16 I + 15): with a vector gate the only ones the pair
    // corrects; without, kbar's 64 rows of k (accumulate_products).
    alignas(16) bf16 kbar_lo[4][kSubChunk][kSliceLd];
    alignas(16) float ref[4][kSlice];  // vector gate: reference point of each row block and channel
    alignas(8) float total[4][kSlice];  // ... and the sum of its gates (fill_slice's scan)
    bool exact[4][kSlice];  // ... and whether its diagonal block factorises within range
  };
  // After the slices (step 3 and the record). Once the inverse is complete, T's two bfloat16
  // copies (tb, tu) are written, and beta v (vb) or v's tiles (vt) take the place of T in
  // float32.
  struct Solve {
    alignas(16) float a[kChunk][kALd];  // A_kk (strictly lower)
    alignas(16) float t[kChunk][kChunk + 4];  // T = (I + A_kk)^-1 (lower, unit diagonal)
    InverseScratch inverse;
    // The slices' tu; the key tiles' launch ends before it (prepare_shared_bytes).
    alignas(16) bf16 tu[kChunk][kChunkLd];
  };
  // The key tiles' q (their k lies in wsrc), until finish_a.
  struct QTile {
    alignas(16) bf16 q[kChunk][KP + 8];
  };
  alignas(16) bf16 wsrc[kChunk][KP + 8];  // beta k 2^Gamma (slices), k as given (key tiles)
  alignas(16) float beta[kChunk];
  float gs[kChunk];  // scalar gate: Gamma after each token
  alignas(16) float inv_k[kChunk];  // 1 / |k| per token (finish_norms)
  float inv_q[kChunk];  // 1 / |q| per token: A_qk's row scale where finish_a takes it
  alignas(16) float w_cols[kChunk];  // key tiles: T's column scale for w, n_k beta 2^Gamma
  // The key tiles' launch ends at the solve's tu (prepare_shared_bytes): what follows, the
  // slices' part of the union and the vector gate's arrays, they never touch.
  union {
    Solve v;
    QTile qt;
    Slice s;
  } u;
  alignas(16) float bias[KP];  // vector gate in the kernel: dt_bias per key (zeros past K)

  // T's bfloat16 copies. With the slices tb takes A_kk's place and tu has its own rows, both
  // kChunkLd wide; the key tiles put both in A_kk's place in the record layout
  // (cuda/chunk_records.cuh, 8 KB each), which their launch's size needs (t_index).
  __device__ bf16* tb() { return reinterpret_cast<bf16*>(&u.v.a[0][0]); }
  template <bool KeyTiles>
  __device__ bf16* tu() { return KeyTiles ? tb() + kChunk * 64 : &u.v.tu[0][0]; }
  template <bool KeyTiles>
  __device__ static int t_index(int r, int c) {
    return KeyTiles ? static_cast<int>(record_index(r, c)) : r * kChunkLd + c;
  }
  // beta v ([C][kValueLd], write_values) or v's tiles (record layout, fetch_value_tiles).
  __device__ bf16* vb() { return reinterpret_cast<bf16*>(&u.v.t[0][0]); }
};
// Shared memory of a launch: the key tiles' stops before the slices' tu.
template <int KP>
constexpr int prepare_shared_bytes(bool key_tiles) {
  using S = PrepareShared<KP>;
  return key_tiles ? static_cast<int>(offsetof(S, u) + offsetof(typename S::Solve, tu))
                   : static_cast<int>(sizeof(S));
}
static_assert(sizeof(PrepareShared<64>::Solve) <= sizeof(PrepareShared<64>::Slice) &&
                  sizeof(PrepareShared<256>::QTile) <= offsetof(PrepareShared<256>::Solve, tu),
              "the slices size the union; the key tiles' q fits in the solve's place");
static_assert(2 * sizeof(bf16) * kChunk * 64 <= sizeof(float) * kChunk * kALd &&
                  sizeof(bf16) * kChunk * kChunkLd <= sizeof(float) * kChunk * kALd &&
                  sizeof(bf16) * kChunk * kValueLd <= sizeof(float) * kChunk * kALd,
              "T in bfloat16 and beta v fit in the places of A_kk and T in float32");
// Three blocks per SM at KP <= 128 (the kernel is latency-bound: more warps hide more); the
// cap of 168 registers holds each of the slices' kernels without spills (ptxas at KP = 64, 128,
// with fill_slice's register map). Shared memory allows 3 at KP <= 128 only (76 KB a block at
// KP = 128), and with the key tiles 4 (55 KB; their 128 registers spill nothing).
constexpr int kMinBlocks(int KP, bool key_tiles) {
  return KP > 128 ? 2 : key_tiles ? 4 : 3;
}
static_assert(4 * (prepare_shared_bytes<128>(true) + 1024) <= 228 * 1024 &&
                  3 * (prepare_shared_bytes<128>(false) + 1024) <= 228 * 1024,
              "four key-tile blocks or three slice blocks fit an SM's shared memory (1 KB "
              "reserved per block)");

__device__ __forceinline__ void store_pair(bf16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

// x - bfloat16(x): the low part of x as a bfloat16 pair hi + lo (split_aqk).
__device__ __forceinline__ float low_part(float x) {
  return x - __bfloat162float(__float2bfloat16_rn(x));
}

// Two entries of A_qk to the record as bfloat16, or float16 (ChunkParams::aqk_f16); `low`: the
// low parts x - 16-bit(x) of the pair's second member instead (split_aqk).
__device__ __forceinline__ void store_aqk_pair(bf16* dst, float a, float b, bool f16, bool low) {
  if (!f16) {
    if (low) a = low_part(a), b = low_part(b);
    store_pair(dst, a, b);
    return;
  }
  if (low) a -= __half2float(__float2half_rn(a)), b -= __half2float(__float2half_rn(b));
  *reinterpret_cast<uint32_t*>(dst) = pack_f16(a, b);
}

// The low parts x - hi of an operand register hi (a bfloat16 pair, the first in the low half)
// whose exact values are x0 and x1, as a bfloat16 pair.
__device__ __forceinline__ uint32_t low_pair(uint32_t hi, float x0, float x1) {
  return pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// Per-token scalars: beta and the scalar gate's Gamma (the L2 norms' come after the slices).
template <GateForm G, int KP>
__device__ void load_token_scalars(const RecurrentParams& p, PrepareShared<KP>& sh,
                                   const ChunkRef& ref, int64_t hv, float a_gate) {
  const int tid = threadIdx.x;
  if (G == GateForm::vector && p.gate_in_kernel) {
    // With the lower bound, the sigmoid's argument in log2 units: -a log2(e) dt_bias
    // (activate_gates_log2).
    const float scale = p.has_lower_bound ? -a_gate * kLog2e : 1.f;
    for (int e = tid; e < KP; e += kThreads)
      sh.bias[e] = p.dt_bias && e < p.K ? scale * load_float(p.dt_bias, p.dt_bias_dtype,
                                                             hv * p.dt_bias_head_stride +
                                                                 e * p.dt_bias_key_stride)
                                        : 0.f;
  }
  if (tid < kChunk) {
    const int t = tid;
    const bool live = t < ref.len;
    float b = 0.f, gl = 0.f;
    if (p.delta && live)
      b = activate_beta(p, load_float(p.beta.data, p.beta.dtype,
                                      token_offset(p.beta, ref.seq, hv) + (ref.t + t) * p.beta.stride[1]));
    if (G == GateForm::scalar && live) {
      float gx = load_float(p.g.data, p.g.dtype,
                            token_offset(p.g, ref.seq, hv) + (ref.t + t) * p.g.stride[1]);
      if (p.gate_in_kernel) {
        if (p.dt_bias) gx += load_float(p.dt_bias, p.dt_bias_dtype, hv * p.dt_bias_head_stride);
        gx = activate_gate(p, gx, a_gate);
      }
      gl = floor_gate(gx * kLog2e);
    }
    sh.beta[t] = b;
    sh.gs[t] = gl;
  }
  __syncthreads();
  if (G == GateForm::scalar && tid == 0) {
    float run = 0.f;
    for (int t = 0; t < kChunk; ++t) sh.gs[t] = run += sh.gs[t];
  }
}

// The slices' thread map: warp I takes row block I, and a lane the channel pair cp = 2 (lane %
// 16), cp + 1 of the slice on eight of the block's rows, slice_row(u, lane / 16) for u = 0 .. 7:
// two segments of four rows each (the in-warp scan's), h = lane / 16 taking rows 4 h .. 4 h + 3
// and 8 + 4 h .. 11 + 4 h. A lane keeps its 16 values in registers from the load to the
// factors; rows 4 apart put the half-warps' 4-byte stores into the bfloat16 tables (rows of
// kSliceLd, wsrc) on different banks.
constexpr int kSliceRows = kSubChunk / 2;
__device__ __forceinline__ int slice_row(int u, int h) { return u % 4 + 8 * (u / 4) + 4 * h; }
// How many of the channel pair key, key + 1 lie before K (0, 1 or 2).
__device__ __forceinline__ int pair_valid(int64_t key, int64_t K) {
  return key >= K ? 0 : key + 1 >= K ? 1 : 2;
}

// Dense inputs: the raw bfloat16 pairs of q, k and the vector gate that a lane takes from a
// slice (zero past the chunk's last token and past K), fetched a slice ahead so that their
// latency passes behind the previous slice's products. Other inputs are read where they are
// converted (read_slice).
struct SlicePairs {
  uint32_t q[kSliceRows], k[kSliceRows], g[kSliceRows];
};

// Where the lane's first row of q, k and the vector gate starts at its pair of the first slice
// (dense inputs); a slice adds its first channel. Computed again for each slice's fetch: held
// across the slice loop, the three pointers pushed ptxas into spills.
struct SliceSource {
  const unsigned short *q, *k, *g;
};

template <GateForm G>
__device__ SliceSource slice_source(const RecurrentParams& p, const ChunkRef& ref, int64_t hv) {
  const int lane = threadIdx.x % 32, t0 = kSubChunk * (threadIdx.x / 32) + 4 * (lane / 16);
  const int cp = 2 * (lane % 16);
  auto rows = [&](const TokenTensor& x, int64_t head) {
    return static_cast<const unsigned short*>(x.data) + token_offset(x, ref.seq, head) +
           (ref.t + t0) * x.stride[1] + cp;
  };
  return {rows(p.q, hv / p.group), rows(p.k, hv / p.group),
          G == GateForm::vector ? rows(p.g, hv) : nullptr};
}

template <GateForm G, bool Dense>
__device__ SlicePairs fetch_pairs(const RecurrentParams& p, const ChunkRef& ref,
                                  const SliceSource& src, int c0) {
  SlicePairs r{};
  if constexpr (Dense) {
    const int lane = threadIdx.x % 32, t0 = kSubChunk * (threadIdx.x / 32) + 4 * (lane / 16);
    if (c0 + 2 * (lane % 16) >= p.K) return r;  // dense: K is a multiple of 8 (whole pairs)
    bool live[kSliceRows];
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u) live[u] = t0 + slice_row(u, 0) < ref.len;
    // Rows u and u + 4 lie 8 token rows apart: two pointers stepping down one row at a time.
    auto rows = [&](const unsigned short* x, int64_t stride, uint32_t (&w)[kSliceRows]) {
      const unsigned short *lo = x + c0, *hi = lo + 8 * stride;
#pragma unroll
      for (int m = 0; m < kSliceRows / 2; ++m, lo += stride, hi += stride) {
        if (live[m]) w[m] = *reinterpret_cast<const uint32_t*>(lo);
        if (live[m + 4]) w[m + 4] = *reinterpret_cast<const uint32_t*>(hi);
      }
    };
    rows(src.q, p.q.stride[1], r.q);
    rows(src.k, p.k.stride[1], r.k);
    if constexpr (G == GateForm::vector) rows(src.g, p.g.stride[1], r.g);
  }
  return r;
}

// A bfloat16 pair (the first in the low half) as float32.
__device__ __forceinline__ float2 bf16_pair_to_float2(uint32_t w) {
  float x[2];
  bf16_pairs_to_float<2>(&w, x);
  return make_float2(x[0], x[1]);
}

// Channels key and key + 1 of a token row at element offset off (valid: how many lie before
// K; zeros past), any dtype and channel stride.
__device__ __forceinline__ float2 load_pair(const TokenTensor& x, int64_t off, int valid) {
  return make_float2(valid > 0 ? load_float(x.data, x.dtype, off) : 0.f,
                     valid > 1 ? load_float(x.data, x.dtype, off + x.stride[3]) : 0.f);
}

// The lane's slice values q, k and the gate as float32 (pairs: dense inputs, already loaded;
// else loaded here), zeros past the chunk's last token and past K.
template <GateForm G, bool Dense>
__device__ void read_slice(const RecurrentParams& p, const ChunkRef& ref, int64_t hv, int c0,
                           const SlicePairs& pairs, float2 (&q)[kSliceRows],
                           float2 (&k)[kSliceRows], float2 (&g)[kSliceRows]) {
  if constexpr (Dense) {
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u) {
      q[u] = bf16_pair_to_float2(pairs.q[u]);
      k[u] = bf16_pair_to_float2(pairs.k[u]);
      g[u] = G == GateForm::vector ? bf16_pair_to_float2(pairs.g[u]) : make_float2(0.f, 0.f);
    }
  } else {
    const int lane = threadIdx.x % 32, t0 = kSubChunk * (threadIdx.x / 32) + 4 * (lane / 16);
    const int64_t key = c0 + 2 * (lane % 16), h = hv / p.group;
    const int valid = pair_valid(key, p.K);
    // Each tensor's offset of the lane's first row, then a row at a time (rows u and u + 4
    // 8 apart).
    auto rows = [&](const TokenTensor& x, int64_t head, float2 (&out)[kSliceRows]) {
      int64_t lo = token_offset(x, ref.seq, head) + (ref.t + t0) * x.stride[1] + key * x.stride[3];
      int64_t hi = lo + 8 * x.stride[1];
#pragma unroll
      for (int m = 0; m < kSliceRows / 2; ++m, lo += x.stride[1], hi += x.stride[1]) {
        out[m] = load_pair(x, lo, t0 + slice_row(m, 0) < ref.len ? valid : 0);
        out[m + 4] = load_pair(x, hi, t0 + slice_row(m + 4, 0) < ref.len ? valid : 0);
      }
    };
    rows(p.q, h, q);
    rows(p.k, h, k);
    if constexpr (G == GateForm::vector) rows(p.g, hv, g);
    else
      for (float2& x : g) x = make_float2(0.f, 0.f);
  }
}

// Sums over the 16 lanes of a half-warp of each of their eight values v[u], scattered: a lane
// is left with the sum for u = 4 b3 + 2 b2 + b1 (bits of lane % 16: norm_row), and so is its
// neighbour lane ^ 1 (8 shuffles, where a sum per u would take 32).
__device__ __forceinline__ int norm_row(int lane) {
  return 4 * ((lane >> 3) & 1) + 2 * ((lane >> 2) & 1) + ((lane >> 1) & 1);
}
__device__ __forceinline__ float half_warp_sums(const float (&v)[kSliceRows]) {
  const int lane = threadIdx.x % 32;
  const bool b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
  float x4[4], x2[2];
#pragma unroll
  for (int m = 0; m < 4; ++m)
    x4[m] = (b3 ? v[4 + m] : v[m]) + __shfl_xor_sync(0xffffffffu, b3 ? v[m] : v[4 + m], 8);
#pragma unroll
  for (int m = 0; m < 2; ++m)
    x2[m] = (b2 ? x4[2 + m] : x4[m]) + __shfl_xor_sync(0xffffffffu, b2 ? x4[m] : x4[2 + m], 4);
  const float x1 = (b1 ? x2[1] : x2[0]) + __shfl_xor_sync(0xffffffffu, b1 ? x2[0] : x2[1], 2);
  return x1 + __shfl_xor_sync(0xffffffffu, x1, 1);
}

// float2 arithmetic for the slices' channel pairs.
__device__ __forceinline__ float2 shfl_xor2(float2 x, int mask) {
  return make_float2(__shfl_xor_sync(0xffffffffu, x.x, mask),
                     __shfl_xor_sync(0xffffffffu, x.y, mask));
}
__device__ __forceinline__ float2 add2(float2 a, float2 b) {
  return make_float2(a.x + b.x, a.y + b.y);
}
__device__ __forceinline__ float2 sub2(float2 a, float2 b) {
  return make_float2(a.x - b.x, a.y - b.y);
}
__device__ __forceinline__ float2 mul2(float2 a, float2 b) {
  return make_float2(a.x * b.x, a.y * b.y);
}
__device__ __forceinline__ float2 exp2_pair(float2 x) {
  return make_float2(exp2_approx(x.x), exp2_approx(x.y));
}

// Packs eight floats into bfloat16 and stores them with one 16-byte store. Into a record
// (global memory) the store is spelled out: through record_index's address the compiler
// cannot prove the uint4 store's alignment again after splitting it, and made four 4-byte
// stores of it (every such store of this file's PTX before; shared memory kept its 16).
__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  return make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]),
                    pack_bf16(v[6], v[7]));
}
__device__ __forceinline__ void store_bf16x8(bf16* dst, const float (&v)[8]) {
  *reinterpret_cast<uint4*>(dst) = pack_bf16x8(v);
}
__device__ __forceinline__ void store_bf16x8_global(bf16* dst, const float (&v)[8]) {
  __stwb(reinterpret_cast<uint4*>(dst), pack_bf16x8(v));  // st.global.wb: the default policy
}

// The vector gate activated in the kernel (activate_gates), in log2 units, for pairs of raw
// values x (even: the pair's first channel) with bias b = the pair's sh.bias. With the lower
// bound, lower_bound sigmoid(a (x + dt_bias)) log2(e) with the constants folded: b holds
// -a log2(e) dt_bias, so 2^(-a log2(e) (x + dt_bias)) takes one fma and one exp2, and
// lower_bound log2(e) one multiply: 6 instructions a value where the unfolded form took 8 (SASS
// at K = 128); the log2 gate differs from it by a few ulp. Else -a log2(e) softplus(x + dt_bias).
template <int N>
__device__ __forceinline__ void activate_gates_log2(const RecurrentParams& p, float (&x)[N],
                                                    float2 b, float a) {
  static_assert(N % 2 == 0, "channel pairs");
  if (p.has_lower_bound) {
    const float s = -a * kLog2e, top = p.lower_bound * kLog2e;
#pragma unroll
    for (int e = 0; e < N; ++e)
      x[e] = top * __fdividef(1.f, 1.f + exp2_approx(fmaf(s, x[e], e % 2 ? b.y : b.x)));
  } else {
    const float s = -a * kLog2e;
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = s * softplusf(x[e] + (e % 2 ? b.y : b.x));
  }
}

// One key slice, channels [c0, c0 + kSlice), held in the lane's registers (slice_row) from the
// load to the factors:
//  1. q, k and the gate as float32, the gate activated where asked, in log2, floored, and zero
//     past the chunk and past K;
//  2. the L2 norms' sums of squares, added to nq and nk for the lane's norm_row;
//  3. Gamma (vector gate) by a scan of the block's rows within the warp, the row blocks' sums to
//     s.total and a block barrier; every lane then derives every block's reference point (see
//     the file comment), exactness and Gamma_end from those sums by the same arithmetic, so
//     that the row and column factors of a block meet at equal bits;
//  4. the factors: row factors xq, xk; the column factors of the lane's tokens for its own row
//     block (the diagonal) and each later one (kbar_base), a later block's from the diagonal
//     one by the channel's step 2^(r_J - r_(J-1)) where the warp's channels all factorise;
//     qg, kg and decay to the record; beta k 2^Gamma (wsrc, the operand of w); with split_aqk,
//     or where a channel of the block does not factorise, the float32 values that the
//     products' row_low and pairwise terms read.
// The caller's barrier publishes the tables to slice_products.
template <GateForm G, bool kSplit, bool Dense, int KP>
__device__ void fill_slice(const RecurrentParams& p, PrepareShared<KP>& sh, const Record& rec,
                           const ChunkRef& ref, int64_t hv, const SlicePairs& pairs, float a_gate,
                           int c0, float& nq, float& nk) {
  constexpr bool kVector = G == GateForm::vector;
  auto& s = sh.u.s;
  const int I = threadIdx.x / 32, lane = threadIdx.x % 32, h = lane / 16, cp = 2 * (lane % 16);
  const int r0 = kSubChunk * I;
  const int64_t key = c0 + cp;
  float2 q[kSliceRows], k[kSliceRows], g[kSliceRows];
  read_slice<G, Dense>(p, ref, hv, c0, pairs, q, k, g);
  if constexpr (kVector) {
    const int valid = pair_valid(key, p.K);
    float x[2 * kSliceRows];
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u) x[2 * u] = g[u].x, x[2 * u + 1] = g[u].y;
    if (p.gate_in_kernel) {
      const float2 b = *reinterpret_cast<const float2*>(&sh.bias[key]);  // zeros past K
      activate_gates_log2(p, x, b, a_gate);
    }
    const float unit = p.gate_in_kernel ? 1.f : kLog2e;  // given gates are in natural log
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u) {
      const bool live = r0 + slice_row(u, h) < ref.len;
      g[u] = make_float2(live && valid > 0 ? floor_gate(x[2 * u] * unit) : 0.f,
                         live && valid > 1 ? floor_gate(x[2 * u + 1] * unit) : 0.f);
    }
  }
  if (p.qk_l2norm) {
    float sq[kSliceRows], sk[kSliceRows];
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u) {
      sq[u] = q[u].x * q[u].x + q[u].y * q[u].y;
      sk[u] = k[u].x * k[u].x + k[u].y * k[u].y;
    }
    nq += half_warp_sums(sq);
    nk += half_warp_sums(sk);
  }
  if constexpr (kVector) {
    // Inclusive sums down each segment of four rows, then the segments before it: the four
    // segments' sums in block order, added in that order by both halves.
    float2 lo = make_float2(0.f, 0.f), hi = lo;
#pragma unroll
    for (int u = 0; u < kSliceRows / 2; ++u) g[u] = lo = add2(lo, g[u]);
#pragma unroll
    for (int u = kSliceRows / 2; u < kSliceRows; ++u) g[u] = hi = add2(hi, g[u]);
    const float2 other_lo = shfl_xor2(lo, 16), other_hi = shfl_xor2(hi, 16);
    const float2 s0 = h ? other_lo : lo, s1 = h ? lo : other_lo, s2 = h ? other_hi : hi,
                 s3 = h ? hi : other_hi;
    const float2 s01 = add2(s0, s1), s012 = add2(s01, s2);
    const float2 before_lo = h ? s0 : make_float2(0.f, 0.f), before_hi = h ? s012 : s01;
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u)
      g[u] = add2(g[u], u < kSliceRows / 2 ? before_lo : before_hi);
    if (h == 0) *reinterpret_cast<float2*>(&s.total[I][cp]) = add2(s012, s3);
  }
  __syncthreads();  // s.total; the scalar gate's Gamma (load_token_scalars' scan)

  // Per row: beta, the scalar gate's Gamma (read before any store: cuda/device_io.cuh).
  float beta[kSliceRows], gs[kSliceRows] = {};
#pragma unroll
  for (int u = 0; u < kSliceRows; ++u) {
    const int t = r0 + slice_row(u, h);
    beta[u] = sh.beta[t];
    if constexpr (G == GateForm::scalar) gs[u] = sh.gs[t];
  }
  const float gs_end = G == GateForm::scalar ? sh.gs[ref.len - 1] : 0.f;
  // Every block's reference point and exactness for the lane's pair, the lane's own block's
  // and the next one's picked out (static indices: no local memory), and the steps between
  // consecutive later blocks.
  float2 gend = make_float2(0.f, 0.f), ref_i = gend, ref_next = gend, step_next = gend, step[4];
  bool exact_i[2] = {true, true};
  if constexpr (kVector) {
    float2 start_i = gend, prev = gend;
#pragma unroll
    for (int J = 0; J < 4; ++J) {
      const float2 start = gend;
      const float2 end = add2(start, *reinterpret_cast<const float2*>(&s.total[J][cp]));
      const bool exact0 = start.x - end.x <= 2.f * kMaxFactorLog2;
      const bool exact1 = start.y - end.y <= 2.f * kMaxFactorLog2;
      const float2 r = make_float2(exact0 ? 0.5f * (start.x + end.x) : start.x,
                                   exact1 ? 0.5f * (start.y + end.y) : start.y);
      step[J] = J > 0 && J > I ? exp2_pair(sub2(r, prev)) : make_float2(1.f, 1.f);
      if (J == I) start_i = start, ref_i = r, exact_i[0] = exact0, exact_i[1] = exact1;
      if (J == I + 1) ref_next = r;
      prev = r;
      gend = end;
    }
    step_next = exp2_pair(sub2(ref_next, ref_i));
#pragma unroll
    for (int u = 0; u < kSliceRows; ++u) g[u] = add2(g[u], start_i);
    if (h == 0) s.exact[I][cp] = exact_i[0], s.exact[I][cp + 1] = exact_i[1];
    if (kSplit && h == 0) *reinterpret_cast<float2*>(&s.ref[I][cp]) = ref_i;
  }
  if (I == 0 && h == 0) {  // the decay over the chunk (1 past K)
    const float2 d =
        kVector ? exp2_pair(gend) : make_float2(exp2_approx(gs_end), exp2_approx(gs_end));
    rec.decay[key] = d.x;
    rec.decay[key + 1] = d.y;
  }
  // The warp's later column factors from the diagonal ones where its channels all factorise
  // (the diagonal factor then lies within 2^kMaxFactorLog2, and a step is at least 2^-120).
  const bool by_steps = kVector && __all_sync(0xffffffffu, exact_i[0] && exact_i[1]);
  // float32 values for slice_products: split_aqk's row_low and the pairwise diagonal terms of
  // channels that do not factorise (rare: a decay of more than 2 kMaxFactorLog2 over a block).
  const bool tables = kSplit || (kVector && !by_steps);
  auto store = [](bf16* dst, float2 x) { store_pair(dst, x.x, x.y); };
  // The lane's rows in a record matrix (record_index): rows u and u + 4, 8 rows apart, share a
  // swizzle and lie 8 x 64 elements apart.
  int rec_row[kSliceRows / 2];
#pragma unroll
  for (int m = 0; m < kSliceRows / 2; ++m)
    rec_row[m] = static_cast<int>(record_index(r0 + slice_row(m, h), key));
#pragma unroll
  for (int u = 0; u < kSliceRows; ++u) {
    const int i = slice_row(u, h), t = r0 + i;
    float2 qg, kg, wk;
    if constexpr (kVector) {
      const float2 gam = g[u], e = exp2_pair(sub2(gam, ref_i)), up = exp2_pair(gam);
      store(&s.xq[I][i][cp], mul2(q[u], e));
      store(&s.xk[I][i][cp], mul2(k[u], e));
      // The diagonal block's column factors, 0 for a channel that does not factorise (its
      // terms are summed pairwise instead).
      // 2^(r - Gamma) as 1 / 2^(Gamma - r): one MUFU either way, a subtraction less (|Gamma - r|
      // <= kMaxFactorLog2 where the channel factorises, and an inexact channel's diag is 0).
      const float2 d = mul2(k[u], make_float2(rcp_approx(e.x), rcp_approx(e.y)));
      const float2 diag = make_float2(exact_i[0] ? d.x : 0.f, exact_i[1] ? d.y : 0.f);
      store(&s.kbar[kbar_base(I) + t][cp], diag);
      if constexpr (kSplit)
        store_pair(&s.kbar_lo[I][i][cp], low_part(diag.x), low_part(diag.y));
      if (I + 1 < 4) {
        float2 x = by_steps ? mul2(d, step_next)
                            : mul2(k[u], exp2_pair(sub2(ref_next, gam)));
#pragma unroll
        for (int J = 1; J < 4; ++J) {
          if (J <= I) continue;
          if (J > I + 1) x = mul2(x, step[J]);
          store(&s.kbar[kbar_base(J) + t][cp], x);
        }
      }
      qg = mul2(q[u], up);
      kg = mul2(k[u], exp2_pair(sub2(gend, gam)));
      wk = make_float2(beta[u] * k[u].x * up.x, beta[u] * k[u].y * up.y);
    } else {
      // Without a vector gate the row factors are q and k as given, and every row block's
      // column factors k (kbar's row t, which A_kk's rows read too).
      store(&s.xq[I][i][cp], q[u]);
      store(&s.kbar[t][cp], k[u]);
      if constexpr (kSplit)
        store_pair(&s.kbar_lo[0][0][0] + t * kSliceLd + cp, low_part(k[u].x), low_part(k[u].y));
      const float up = G == GateForm::scalar ? exp2_approx(gs[u]) : 1.f;
      const float down = G == GateForm::scalar ? exp2_approx(gs_end - gs[u]) : 1.f;
      qg = make_float2(q[u].x * up, q[u].y * up);
      kg = make_float2(k[u].x * down, k[u].y * down);
      wk = make_float2(beta[u] * k[u].x * up, beta[u] * k[u].y * up);
    }
    const int at = rec_row[u % 4] + 8 * 64 * (u / 4);
    store(rec.qg + at, qg);
    store(rec.kg + at, kg);
    if (p.delta) store(&sh.wsrc[t][key], wk);
    if (tables) {
      *reinterpret_cast<float2*>(&s.q[t][cp]) = q[u];
      if constexpr (kVector) {
        *reinterpret_cast<float2*>(&s.k[t][cp]) = k[u];
        *reinterpret_cast<float2*>(&s.gamma[t][cp]) = g[u];
      }
    }
  }
}

// acc_q += xq kbar^T and acc_k += xk kbar^T over key channels [0, Width) for warp I's row
// block I: column tiles 0 .. 2I+1 (tile pairs np <= I). xq and xk point at the warp's 16
// rows, kbar at token 0's; rows are ld elements apart.
// kSplit (split_aqk): A_qk's operands as bfloat16 pairs hi + lo, acc_q += xq_lo kbar^T +
// xq kbar_lo^T (lo lo is below float32's sum). row_low(k0, aq, aq_lo) gives the A fragment's
// low parts at k0. kbar_lo holds the column low parts of every token (kLowDiagonal false:
// rows as kbar's, every tile pair) or of the diagonal block only (true: its 16 rows, tile pair
// np == I). The vector gate takes the latter: its column factors differ per row block (160
// rows, 12.5 KB of low parts), and the entries of A_qk left of the diagonal block, smaller
// than those on it, add little error: in the rounding model (bench/model/chunk_rounding.py)
// the pair gives 2.54e-3 with the diagonal blocks' column low parts against 2.51e-3 with all
// (single bfloat16: 3.82e-3; weak gates 3.14e-3 against 3.04e-3).
template <int Width, bool kSplit = false, bool kLowDiagonal = false, class RowLow = int>
__device__ __forceinline__ void accumulate_products(const bf16* xq, const bf16* xk,
                                                    const bf16* kbar, int ld, Acc (&acc_q)[8],
                                                    Acc (&acc_k)[8], const bf16* kbar_lo = nullptr,
                                                    const RowLow& row_low = {}) {
  const int I = threadIdx.x / 32;
#pragma unroll
  for (int k0 = 0; k0 < Width; k0 += 16) {
    uint32_t aq[4], ak[4], aq_lo[4];
    load_a(aq, xq, ld, 0, k0);
    load_a(ak, xk, ld, 0, k0);
    if constexpr (kSplit) row_low(k0, aq, aq_lo);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np > I) break;
      uint32_t b[4];
      load_b_pair_nk(b, kbar, ld, 16 * np, k0);
      mma_bf16(acc_q[2 * np], aq, b[0], b[1]);
      mma_bf16(acc_q[2 * np + 1], aq, b[2], b[3]);
      mma_bf16(acc_k[2 * np], ak, b[0], b[1]);
      mma_bf16(acc_k[2 * np + 1], ak, b[2], b[3]);
      if constexpr (kSplit) {
        mma_bf16(acc_q[2 * np], aq_lo, b[0], b[1]);
        mma_bf16(acc_q[2 * np + 1], aq_lo, b[2], b[3]);
        if (!kLowDiagonal || np == I) {
          uint32_t b_lo[4];
          load_b_pair_nk(b_lo, kbar_lo, ld, kLowDiagonal ? 0 : 16 * np, k0);
          mma_bf16(acc_q[2 * np], aq, b_lo[0], b_lo[1]);
          mma_bf16(acc_q[2 * np + 1], aq, b_lo[2], b_lo[3]);
        }
      }
    }
  }
}

// Warp I's products for row block I over one key slice from fill_slice's tables, into acc_q /
// acc_k, column tiles 0 .. 2I+1 (tile pairs np <= I); see the file comment for the
// factorisation.
template <GateForm G, bool kSplit, int KP>
__device__ void slice_products(PrepareShared<KP>& sh, Acc (&acc_q)[8], Acc (&acc_k)[8]) {
  auto& s = sh.u.s;
  const int I = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = kSubChunk * I;
  const bool exact = G != GateForm::vector || s.exact[I][lane];  // lane = key channel here
  // Without a vector gate every row block's column factors are k itself, and A_kk's row
  // factors too: one table of the chunk's 64 rows of k serves them all.
  const bf16* kbar = G == GateForm::vector ? &s.kbar[kbar_base(I)][0] : &s.kbar[0][0];
  const bf16* xk = G == GateForm::vector ? &s.xk[I][0][0] : &s.kbar[r0][0];
  // split_aqk: the low parts of warp I's row factors, recomputed in float32 where the A
  // fragment's registers hold them (register r: rows g + 8 (r % 2), channels + 8 (r / 2);
  // cuda/mma.cuh) as fill_slice computed them.
  auto row_low = [&](int k0, const uint32_t (&aq)[4], uint32_t (&aq_lo)[4]) {
    const int g = lane / 4, c2 = 2 * (lane % 4);
    auto row_factor = [&](int t, int ch) {
      float x = s.q[t][ch];
      if constexpr (G == GateForm::vector) x *= exp2_approx(s.gamma[t][ch] - s.ref[I][ch]);
      return x;
    };
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = r0 + g + 8 * (r % 2), ch = k0 + c2 + 8 * (r / 2);
      aq_lo[r] = low_pair(aq[r], row_factor(t, ch), row_factor(t, ch + 1));
    }
  };
  constexpr bool kVector = G == GateForm::vector;
  accumulate_products<kSlice, kSplit, kVector>(&s.xq[I][0][0], xk, kbar, kSliceLd, acc_q, acc_k,
                                               &s.kbar_lo[kVector ? I : 0][0][0], row_low);
  if constexpr (G == GateForm::vector) {
    // The channels that do not factorise over this row block add their diagonal-block terms
    // exactly, each lane to the accumulator entries it holds (tiles 2I and 2I + 1; finish_a
    // drops those above the diagonal).
    const unsigned inexact = __ballot_sync(0xffffffffu, !exact);
    if (inexact) {
      float fq[2][4] = {}, fk[2][4] = {};
#pragma unroll
      for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = acc_row(e), j = 8 * x + acc_col(e);
          if (j > i) continue;
          for (unsigned m = inexact; m; m &= m - 1) {
            const int cc = __ffs(m) - 1;
            const float kj =
                s.k[r0 + j][cc] * exp2_approx(s.gamma[r0 + i][cc] - s.gamma[r0 + j][cc]);
            fq[x][e] += s.q[r0 + i][cc] * kj;
            fk[x][e] += s.k[r0 + i][cc] * kj;
          }
        }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt / 2 != I) continue;  // static indices: acc_q stays in registers
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc_q[nt].d[e] += fq[nt % 2][e];
          acc_k[nt].d[e] += fk[nt % 2][e];
        }
      }
    }
  }
}

// The key tiles (see the file comment): q to u.qt and k to wsrc, zeros past the chunk's last
// token and past K; the caller waits (wait_async) and publishes them with a block barrier.
template <int KP>
__device__ void fetch_key_tiles(const RecurrentParams& p, PrepareShared<KP>& sh,
                                const ChunkRef& ref, int64_t h) {
  const auto* q = static_cast<const bf16*>(p.q.data) + token_offset(p.q, ref.seq, h) +
                  ref.t * p.q.stride[1];
  const auto* k = static_cast<const bf16*>(p.k.data) + token_offset(p.k, ref.seq, h) +
                  ref.t * p.k.stride[1];
  // Not unrolled: unrolled, the kernel (128 registers at four blocks an SM) spilled.
  fetch_token_rows<KP, kThreads, 1>([&sh](int t, int c) { return &sh.u.qt.q[t][c]; }, q,
                                    p.q.stride[1], ref.len, p.K);
  fetch_token_rows<KP, kThreads, 1>([&sh](int t, int c) { return &sh.wsrc[t][c]; }, k,
                                    p.k.stride[1], ref.len, p.K);
  commit_async();
}

// From the key tiles: qg, kg and decay to the record, the inverse lengths (as finish_norms
// does) and T's column scale for w, w_cols = n_k beta 2^Gamma. KP / 8 threads per token, 8
// channels each. With qk_from_tokens (cuda/chunk_params.h) no qg and kg: the record's inverse
// lengths take the gate's factors, n_q scale 2^Gamma and n_k 2^(Gamma_end - Gamma), and n_q
// goes to shared memory for A_qk's rows.
template <GateForm G, int KP>
__device__ void write_tile_factors(const RecurrentParams& p, bool qk_from_tokens,
                                   PrepareShared<KP>& sh, const Record& rec, const ChunkRef& ref) {
  constexpr int kLanes = KP / 8, kTokensPerPass = kThreads / kLanes;
  static_assert(32 % kLanes == 0, "a token's threads are adjacent lanes of one warp");
  const int tid = threadIdx.x, c8 = 8 * (tid % kLanes);
  const float gend = G == GateForm::scalar ? sh.gs[ref.len - 1] : 0.f;
  for (int c = tid; c < KP; c += kThreads) rec.decay[c] = exp2_approx(gend);
  // The token scalars go to shared memory after the loop (reads before stores:
  // cuda/device_io.cuh).
  constexpr int kTilePasses = kChunk / kTokensPerPass;
  float token_inv_k[kTilePasses] = {}, token_w_cols[kTilePasses] = {},
        token_inv_q[kTilePasses] = {};
#pragma unroll
  for (int x = 0; x < kTilePasses; ++x) {
    const int t = kTokensPerPass * x + tid / kLanes;
    const float gam = G == GateForm::scalar ? sh.gs[t] : 0.f;
    const float up = exp2_approx(gam), down = exp2_approx(gend - gam);
    const uint4 rq = *reinterpret_cast<const uint4*>(&sh.u.qt.q[t][c8]);
    const uint4 rk = *reinterpret_cast<const uint4*>(&sh.wsrc[t][c8]);
    const uint32_t wq[4] = {rq.x, rq.y, rq.z, rq.w}, wk[4] = {rk.x, rk.y, rk.z, rk.w};
    float q[8], k[8], qg[8], kg[8], sq = 0.f, sk = 0.f;
    bf16_pairs_to_float<8>(wq, q);
    bf16_pairs_to_float<8>(wk, k);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      sq += q[e] * q[e];
      sk += k[e] * k[e];
      qg[e] = q[e] * up;
      kg[e] = k[e] * down;
    }
    if (!qk_from_tokens) {
      store_bf16x8_global(rec.qg + record_index(t, c8), qg);
      store_bf16x8_global(rec.kg + record_index(t, c8), kg);
    }
    sq = lane_sum<1, kLanes / 2>(sq);
    sk = lane_sum<1, kLanes / 2>(sk);
    if (tid % kLanes == 0) {
      const bool norm = p.qk_l2norm, live = t < ref.len;
      const float nk = !live ? 0.f : norm ? rsqrtf(sk + kL2NormEps) : 1.f;
      const float nq = !live ? 0.f : norm ? rsqrtf(sq + kL2NormEps) : 1.f;
      rec.inv_q[t] = qk_from_tokens ? nq * p.scale * up : nq * p.scale;
      rec.inv_k[t] = qk_from_tokens ? nk * down : nk;
      token_inv_k[x] = nk;
      token_inv_q[x] = nq;
      token_w_cols[x] = nk * sh.beta[t] * up;
    }
  }
  if (tid % kLanes == 0)
#pragma unroll
    for (int x = 0; x < kTilePasses; ++x) {
      const int t = kTokensPerPass * x + tid / kLanes;
      sh.inv_k[t] = token_inv_k[x];
      sh.inv_q[t] = token_inv_q[x];
      sh.w_cols[t] = token_w_cols[x];
    }
}

// The inverse lengths of q and k, 1 / sqrt(sum of squares + eps) with the L2 norm and 1
// without (0 past the chunk's last token), from the sums fill_slice gathered (a lane and its
// neighbour hold its norm_row's), to the record and to shared memory (finish_a's row and
// column scales), which the caller's barrier publishes. The record's n_q takes the attention
// scale (cuda/chunk_params.h): qg leaves it out, a multiply a value less in fill_slice, and so
// does A_qk unless aqk_f16 puts both on its rows (finish_a).
template <int KP>
__device__ void finish_norms(const RecurrentParams& p, PrepareShared<KP>& sh, const Record& rec,
                             const ChunkRef& ref, float nq, float nk) {
  const int lane = threadIdx.x % 32;
  if (lane % 2) return;
  const int t = kSubChunk * (threadIdx.x / 32) + slice_row(norm_row(lane), lane / 16);
  const bool norm = p.qk_l2norm, live = t < ref.len;
  sh.inv_q[t] = !live ? 0.f : norm ? rsqrtf(nq + kL2NormEps) : 1.f;
  rec.inv_q[t] = p.scale * sh.inv_q[t];
  sh.inv_k[t] = rec.inv_k[t] = !live ? 0.f : norm ? rsqrtf(nk + kL2NormEps) : 1.f;
}

// Row block I of A_qk to the record and of A_kk to shared memory (zeros above the diagonal),
// with the inverse key lengths on A_qk's columns and A_kk's rows and columns; n_q and the
// attention scale on A_qk's rows where the key tiles' qk_from_tokens or aqk_f16 asks (else
// the record's n_q carries both to the state kernel's output rows); A_qk as float16 with
// aqk_f16.
template <GateForm G, bool kSplit, int KP>
__device__ void finish_a(const RecurrentParams& p, bool rows_n_q, bool aqk_f16,
                         PrepareShared<KP>& sh, const Record& rec, const Acc (&acc_q)[8],
                         const Acc (&acc_k)[8]) {
  const int I = threadIdx.x / 32, r0 = kSubChunk * I;
  // The per-token scalars of the thread's rows (e / 2) and of its columns (nt, x), four column
  // tiles at a time, read before the stores into A_kk's rows (reads before stores:
  // cuda/device_io.cuh); all eight tiles' at once spilled in the A_qk pair's kernels.
  float row_k[2], row_q[2], gs_row[2] = {};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r0 + acc_row(2 * r);
    row_k[r] = sh.beta[t] * sh.inv_k[t];
    row_q[r] = rows_n_q ? p.scale * sh.inv_q[t] : 1.f;
    if constexpr (G == GateForm::scalar) gs_row[r] = sh.gs[t];
  }
  constexpr int kTiles = 4;
#pragma unroll
  for (int nt0 = 0; nt0 < 8; nt0 += kTiles) {  // tiles right of the row block store zeros
    float col[kTiles][2], gs_col[kTiles][2] = {};
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int j = 8 * (nt0 + n) + acc_col(x);
        col[n][x] = sh.inv_k[j];
        if constexpr (G == GateForm::scalar) gs_col[n][x] = sh.gs[j];
      }
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int nt = nt0 + n, i = acc_row(e), t = r0 + i;
        float vq[2] = {0.f, 0.f}, vk[2] = {0.f, 0.f};
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int j = 8 * nt + acc_col(e + x);
          if (nt / 2 > I || j > t) continue;
          float fq = acc_q[nt].d[e + x], fk = acc_k[nt].d[e + x];
          if (G == GateForm::scalar) {
            const float f = exp2_approx(gs_row[e / 2] - gs_col[n][x]);
            fq *= f;
            fk *= f;
          }
          vq[x] = row_q[e / 2] * fq * col[n][x];
          vk[x] = j < t ? row_k[e / 2] * fk * col[n][x] : 0.f;
        }
        const int j0 = 8 * nt + acc_col(e);
        store_aqk_pair(rec.aqk + record_index(t, j0), vq[0], vq[1], aqk_f16, false);
        if constexpr (kSplit)
          store_aqk_pair(rec.aqk_lo + record_index(t, j0), vq[0], vq[1], aqk_f16, true);
        *reinterpret_cast<float2*>(&sh.u.v.a[t][j0]) = make_float2(vk[0], vk[1]);
      }
  }
}

// T = (I + A_kk)^-1 (cuda/chunk_inverse.cuh, in either order; by columns in three tf32
// products a step or, inverse_one_product, one), left in bfloat16 twice, each rounded once
// from float32: T diag(cols) in tb (w's operand: w = T diag(n_k) (beta k
// 2^Gamma); cols = n_k with wsrc's slices, w_cols = n_k beta 2^Gamma with the key tiles), and
// in tu u's: T diag(beta) where v enters as given (ValueTiles), else T.
template <bool KeyTiles, bool ValueTiles, bool kOneProduct, int KP>
__device__ void solve(const ChunkParams& c, PrepareShared<KP>& sh) {
  auto& v = sh.u.v;
  const int tid = threadIdx.x;
  if (c.inverse_by_columns)
    invert_unit_lower_by_columns<kThreads, !kOneProduct>(&v.a[0][0], kALd, &v.t[0][0],
                                                         kChunk + 4, v.inverse);
  else
    invert_unit_lower<kThreads>(&v.a[0][0], kALd, &v.t[0][0], kChunk + 4, v.inverse);
  // A_kk is dead: T in bfloat16 takes its place, four entries a thread and pass.
  bf16 *tb = sh.tb(), *tu = sh.template tu<KeyTiles>();
  const float* cols = KeyTiles ? sh.w_cols : sh.inv_k;
  const auto at = PrepareShared<KP>::template t_index<KeyTiles>;
  // A thread's quads share their columns (q); all their rows are read before any store
  // (reads before stores: cuda/device_io.cuh).
  constexpr int kQuadsPerRow = kChunk / 4, kRowsPerPass = kThreads / kQuadsPerRow,
                kQuadPasses = kChunk / kRowsPerPass;
  static_assert(kThreads % kQuadsPerRow == 0, "a thread's quads share their columns");
  const int q = 4 * (tid % kQuadsPerRow), r0 = tid / kQuadsPerRow;
  const float4 n = *reinterpret_cast<const float4*>(&cols[q]);
  const float4 b = ValueTiles ? *reinterpret_cast<const float4*>(&sh.beta[q])
                              : make_float4(1.f, 1.f, 1.f, 1.f);
  float4 x[kQuadPasses];
#pragma unroll
  for (int m = 0; m < kQuadPasses; ++m)
    x[m] = *reinterpret_cast<const float4*>(&v.t[r0 + kRowsPerPass * m][q]);
#pragma unroll
  for (int m = 0; m < kQuadPasses; ++m) {
    const int r = r0 + kRowsPerPass * m;
    *reinterpret_cast<uint2*>(tb + at(r, q)) = make_uint2(pack_bf16(x[m].x * n.x, x[m].y * n.y),
                                                          pack_bf16(x[m].z * n.z, x[m].w * n.w));
    *reinterpret_cast<uint2*>(tu + at(r, q)) = make_uint2(pack_bf16(x[m].x * b.x, x[m].y * b.y),
                                                          pack_bf16(x[m].z * b.z, x[m].w * b.w));
  }
  __syncthreads();
}

// out[rows of block I][n0 .. n0 + 63] = t[block I rows] . src[tokens][n0 ..], in bfloat16,
// into a record matrix (cuda/chunk_records.cuh); t is one of solve's bfloat16
// copies of T (rows kChunkLd apart or, RecordT, in the record layout), src row-major (rows
// ld_src apart) or, RecordSrc, one tile in the record layout (ld_src unused).
template <bool RecordT, bool RecordSrc>
__device__ void lower_product_rows(const bf16* t, const bf16* src, int ld_src, int n0, bf16* out) {
  const int I = threadIdx.x / 32, r0 = kSubChunk * I;
  Acc acc[8];
  for (int k0 = 0; k0 <= r0; k0 += 16) {
    uint32_t a[4];
    if constexpr (RecordT)
      load_record_a(a, t, r0, k0);
    else
      load_a(a, t, kChunkLd, r0, k0);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      if constexpr (RecordSrc)
        load_record_b_pair_kn(b, src, n0 + 16 * np, k0);
      else
        load_b_pair_kn(b, src, ld_src, n0 + 16 * np, k0);
      mma_bf16(acc[2 * np], a, b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2)
      store_pair(out + record_index(r0 + acc_row(e), n0 + 8 * nt + acc_col(e)), acc[nt].d[e],
                 acc[nt].d[e + 1]);
}

// Value columns [v0, v0 + kValueTile) of the record's u: T (beta v) for the delta rule
// with general inputs (after solve; dense ones take write_values_from_tiles), v for the linear
// write; 8 columns of one token per thread and load.
template <int KP, bool Dense>
__device__ void write_values(const ChunkParams& c, PrepareShared<KP>& sh, const Record& rec,
                             const ChunkRef& ref, int64_t hv, int64_t v0) {
  const RecurrentParams& p = c.p;
  const bool delta = !Dense && p.delta;  // dense inputs take write_values_from_tiles for it
  const int tid = threadIdx.x;
  constexpr int kLanes = kValueTile / 8, kLoads = kChunk * kLanes / kThreads;
  const int col = 8 * (tid % kLanes), valid_v = clamp_run(p.V - v0 - col);
  const int64_t ov = token_offset(p.v, ref.seq, hv) + ref.t * p.v.stride[1] + (v0 + col) * p.v.stride[3];
  Run8 raw[kLoads];  // every load issued before any is used
#pragma unroll
  for (int x = 0; x < kLoads; ++x) {
    const int t = tid / kLanes + x * (kThreads / kLanes);
    raw[x] = TokenRuns<Dense>::load(p.v, ov + t * p.v.stride[1], t < ref.len ? valid_v : 0);
  }
  __syncthreads();  // the previous tile's product has read vb
#pragma unroll
  for (int x = 0; x < kLoads; ++x) {
    const int t = tid / kLanes + x * (kThreads / kLanes);
    float val[8];
    TokenRuns<Dense>::to_float(raw[x], p.v, val);
    if (delta) {
#pragma unroll
      for (int e = 0; e < 8; ++e) val[e] *= sh.beta[t];
      store_bf16x8(sh.vb() + t * kValueLd + col, val);
    } else {
      store_bf16x8_global(rec.u + record_index(t, v0 + col), val);
    }
  }
  if (!delta) return;
  __syncthreads();
  lower_product_rows<false, false>(sh.template tu<false>(), sh.vb(), kValueLd, 0,
                                   rec.u + record_index(0, v0));
}

// Dense v with the delta rule: v's tiles of 64 columns as given, by cp.async into solve's
// dead float32 T (kValueTilesInT at a time, in the record layout), beta on tu's columns
// instead (solve); the first batch is issued before w's product, which hides its latency.
constexpr int kValueTilesInT = 2;
static_assert(kValueTilesInT * kChunk * 64 * sizeof(bf16) <= sizeof(float) * kChunk * (kChunk + 4),
              "the value tiles fit in T's float32 place");

// Value columns [v0, v0 + 64 kValueTilesInT) of v into vt (zeros past the chunk's last token
// and past V); committed, not waited on. Not by fetch_token_rows (cuda/chunk_records.cuh):
// with its stepping pointer the split A_qk form at K = 128 spilled 32 bytes, at any unrolling.
template <int KP>
__device__ void fetch_value_tiles(const RecurrentParams& p, PrepareShared<KP>& sh,
                                  const ChunkRef& ref, int64_t hv, int64_t v0) {
  constexpr int kRuns = kValueTilesInT * 64 / 8;  // 16-byte runs per token
  const auto* v = static_cast<const unsigned short*>(p.v.data) + token_offset(p.v, ref.seq, hv) +
                  ref.t * p.v.stride[1];
  bf16* dst = sh.vb();
  for (int e = threadIdx.x; e < kChunk * kRuns; e += kThreads) {
    const int t = e / kRuns, x = 8 * (e % kRuns);
    const bool live = t < ref.len && v0 + x < p.V;
    copy_async<16>(dst + record_index(t, x), v + (live ? t * p.v.stride[1] + v0 + x : 0),
                   live ? 16 : 0);
  }
  commit_async();
}

// u = (T diag(beta)) v over all value columns, the first batch of tiles already issued.
template <bool KeyTiles, int KP>
__device__ void write_values_from_tiles(const ChunkParams& c, PrepareShared<KP>& sh,
                                        const Record& rec, const ChunkRef& ref, int64_t hv) {
  constexpr int kBatch = 64 * kValueTilesInT;
  for (int64_t v0 = 0; v0 < c.VP; v0 += kBatch) {
    if (v0 > 0) {
      __syncthreads();  // the previous batch's products have read the tiles
      fetch_value_tiles(c.p, sh, ref, hv, v0);
    }
    wait_async<0>();
    __syncthreads();
    for (int x = 0; x < kValueTilesInT && v0 + 64 * x < c.VP; ++x)
      lower_product_rows<KeyTiles, true>(sh.template tu<KeyTiles>(), sh.vb() + x * kChunk * 64,
                                         0, 0, rec.u + record_index(0, v0 + 64 * x));
  }
}

// T diag(beta), solve's tu, to the record in its layout (ChunkParams::v_from_tokens: the
// state kernel takes u = tu v itself), 16 bytes a thread and pass; ordered after solve by its
// closing barrier.
template <bool KeyTiles, int KP>
__device__ void write_tu(PrepareShared<KP>& sh, const Record& rec) {
  const bf16* tu = sh.template tu<KeyTiles>();
  constexpr int kPieces = kChunk / 8;
  for (int e = threadIdx.x; e < kChunk * kPieces; e += kThreads) {
    const int r = e / kPieces, c8 = 8 * (e % kPieces);
    *reinterpret_cast<uint4*>(rec.tu + record_index(r, c8)) = *reinterpret_cast<const uint4*>(
        tu + PrepareShared<KP>::template t_index<KeyTiles>(r, c8));
  }
}

// kSplit: A_qk as a bfloat16 pair (ChunkParams::split_aqk). kOneProduct: T by columns in
// one tf32 product a step (ChunkParams::inverse_one_product; its own kernels: with the other
// form in the same kernel, ptxas spilled 120 bytes in the default one's slice loop).
template <GateForm G, int KP, bool Dense, bool kSplit, bool kOneProduct = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks(KP, Dense && G != GateForm::vector))
    chunk_prepare_kernel(const ChunkParams c) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sh = *reinterpret_cast<PrepareShared<KP>*>(smem);
  const RecurrentParams& p = c.p;
  const int64_t chunk = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  ChunkRef ref;
  if (!locate_chunk(c, chunk, ref)) return;
  const Record rec = record_of<KP>(c, blockIdx.x);
  const float a_gate = p.gate_in_kernel && p.A_log
                           ? expf(load_float(p.A_log, p.A_log_dtype, hv * p.A_log_stride))
                           : 1.f;
  // With the slices q and k are read a slice at a time, the gate with them and v well after
  // the start: the later slices' and v's DRAM latency is then not waited on. The key tiles
  // copy all of q and k at once.
  const int64_t h = hv / p.group;
  constexpr bool kKeyTiles = Dense && G != GateForm::vector;
  if constexpr (kKeyTiles) {
    fetch_key_tiles(p, sh, ref, h);
  } else {
    prefetch_token_rows(p.q, token_offset(p.q, ref.seq, h) + ref.t * p.q.stride[1], ref.len,
                        static_cast<int>(p.K));
    prefetch_token_rows(p.k, token_offset(p.k, ref.seq, h) + ref.t * p.k.stride[1], ref.len,
                        static_cast<int>(p.K));
  }
  if (G == GateForm::vector)
    prefetch_token_rows(p.g, token_offset(p.g, ref.seq, hv) + ref.t * p.g.stride[1], ref.len,
                        static_cast<int>(p.K));
  if (!c.v_from_tokens)
    prefetch_token_rows(p.v, token_offset(p.v, ref.seq, hv) + ref.t * p.v.stride[1], ref.len,
                        static_cast<int>(p.V));
  const int tid = threadIdx.x;
  // The first key slice's loads before the token scalars' (the slices' path).
  SlicePairs pairs;
  if constexpr (!kKeyTiles) pairs = fetch_pairs<G, Dense>(p, ref, slice_source<G>(p, ref, hv), 0);
  load_token_scalars<G>(p, sh, ref, hv, a_gate);

  Acc acc_q[8], acc_k[8];
  if constexpr (kKeyTiles) {
    wait_async<0>();
    __syncthreads();  // the tiles; beta and the scalar gate's Gamma (load_token_scalars)
    write_tile_factors<G>(p, c.qk_from_tokens, sh, rec, ref);
    const int r0 = kSubChunk * (tid / 32);
    accumulate_products<KP>(&sh.u.qt.q[r0][0], &sh.wsrc[r0][0], &sh.wsrc[0][0], KP + 8, acc_q,
                            acc_k);
    __syncthreads();  // finish_a overwrites the q tile and reads the norms
  } else {
    float nq = 0.f, nk = 0.f;  // the L2 norms' sums (fill_slice; unused without the norm)
    for (int c0 = 0; c0 < KP; c0 += kSlice) {
      fill_slice<G, kSplit, Dense>(p, sh, rec, ref, hv, pairs, a_gate, c0, nq, nk);
      if (c0 + kSlice < KP)
        pairs = fetch_pairs<G, Dense>(p, ref, slice_source<G>(p, ref, hv), c0 + kSlice);
      __syncthreads();  // the slice's factors
      slice_products<G, kSplit>(sh, acc_q, acc_k);
    }
    finish_norms(p, sh, rec, ref, nq, nk);
    __syncthreads();  // finish_a overwrites the slice buffers and reads the norms
  }
  finish_a<G, kSplit>(p, (kKeyTiles && c.qk_from_tokens) || c.aqk_f16, c.aqk_f16, sh, rec,
                      acc_q, acc_k);
  // With v_from_tokens (dense inputs only) the record takes tu instead of u, and no v.
  const bool values = !Dense || !c.v_from_tokens;
  if (p.delta) {
    solve<kKeyTiles, Dense, kOneProduct>(c, sh);
    if (Dense && values) fetch_value_tiles(p, sh, ref, hv, 0);
  }

  // w = T diag(w_cols) wsrc = T diag(n_k) (beta k 2^Gamma); u = T (beta v), or v for the
  // linear write.
  if (p.delta)
    for (int n0 = 0; n0 < KP; n0 += 64)
      lower_product_rows<kKeyTiles, false>(sh.tb(), &sh.wsrc[0][0], KP + 8,
                                           n0, rec.w);
  if (!values) {
    if (p.delta) write_tu<kKeyTiles>(sh, rec);
  } else if (Dense && p.delta) {
    write_values_from_tiles<kKeyTiles>(c, sh, rec, ref, hv);
  } else {
    for (int64_t v0 = 0; v0 < c.VP; v0 += kValueTile)
      write_values<KP, Dense>(c, sh, rec, ref, hv, v0);
  }
}

template <GateForm G, int KP, bool kSplit, bool kOneProduct>
auto prepare_kernel(bool dense) {
  return dense ? chunk_prepare_kernel<G, KP, true, kSplit, kOneProduct>
               : chunk_prepare_kernel<G, KP, false, kSplit, kOneProduct>;
}

template <GateForm G, int KP>
void launch_prepare(const ChunkParams& c, cudaStream_t stream) {
  // The one-product inverse is not built with the pair (the host refuses the two together).
  const auto kernel = c.split_aqk             ? prepare_kernel<G, KP, true, false>(c.dense_tokens)
                      : c.inverse_one_product ? prepare_kernel<G, KP, false, true>(c.dense_tokens)
                                              : prepare_kernel<G, KP, false, false>(c.dense_tokens);
  const int smem = prepare_shared_bytes<KP>(c.dense_tokens && G != GateForm::vector);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  // The blocks per SM above need nearly all of its shared memory.
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                       cudaSharedmemCarveoutMaxShared);
  kernel<<<static_cast<unsigned>(c.max_chunks * c.p.HV), kThreads, smem, stream>>>(c);
}

// The prepare kernel's launch at key width KP, every gate form.
template <int KP>
void launch_prepare_width(const ChunkParams& c, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (c.p.gate) {
    case GateForm::none: return launch_prepare<GateForm::none, KP>(c, s);
    case GateForm::scalar: return launch_prepare<GateForm::scalar, KP>(c, s);
    case GateForm::vector: return launch_prepare<GateForm::vector, KP>(c, s);
  }
}

}  // namespace
}  // namespace flashdelta::detail::cuda
