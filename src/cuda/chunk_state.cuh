// Steps 4-5 of the chunkwise forward (DESIGN.md section 3): one block per (sequence, value
// head, tile of BV value columns) walks its chunks in order and per chunk computes
//     v_new = u - w S                       (delta rule; linear: v_new = u = v)
//     o     = diag(n_q) (qg S + A_qk v_new)       (aqk_f16: n_q in A_qk's rows already)
//     S     = diag(decay) S + kg^T diag(n_k) v_new
// from the chunk's prepared record (cuda/chunk_params.h: qg and kg from q and k before the L2
// norm, whose inverse lengths n_q, n_k scale rows here), which is copied into shared memory
// asynchronously one chunk ahead while the current chunk computes (KP <= 128): on Hopper
// one bulk copy per matrix, which the record's layout allows (cuda/chunk_records.cuh).
//
// Each warp owns 16 value columns of the state for every key, and every product above reads
// only the warp's own columns of S and v_new: the warps never wait for each other within a
// chunk. The warp keeps its state transposed, S^T (16 columns x KP keys), in float32
// tensor-core accumulators, because an accumulator tile is also the register layout of a
// left operand: S^T and v_new^T feed the next products straight from registers as bfloat16
//     v_new^T = u^T - S^T w^T,   o^T = S^T qg^T + v_new^T A_qk^T,   S^T = S^T diag(decay) + v_new^T kg
// (v_new^T's columns scaled by n_k between the last two, o^T's by n_q on the way out)
// with the record's matrices as right operands from shared memory. The state itself
// accumulates in float32; every tensor-core operand is bfloat16 (A_qk, with split_aqk, a
// bfloat16 pair hi + lo taken as two products: its rounding is the output's largest error),
// but with aqk_f16 A_qk and v_new^T in their product, float16 (kF16, chunk_step_wgmma).
// On sm_90a with KP <= 128 the block's 4 warps are one warpgroup and each k-step of these
// products is one wgmma over the block's 64 columns (chunk_step_wgmma: the record read once
// per block, not once per warp); elsewhere, or with FLASHDELTA_CHUNK_STATE_PRODUCTS=mma_sync,
// each warp issues mma.sync (chunk_step_mma_sync). The two keep the same register layouts and
// epilogues. When the
// per-chunk states are wanted (ForwardArgs::chunk_states), each warp writes its columns of
// the state entering every chunk straight from the accumulators.
//
// Split sequences (ChunkParams::segments > 1, K <= 128, when the blocks above are too few to
// fill the GPU; DESIGN.md section 3): a first launch (StatePass::ends) runs every segment but a
// sequence's last from a zero state and from the identity without u, writing its affine map
// x_out = P x_in + e for every state column (ws.segment_maps); the second runs every segment,
// first carrying the state across the segments before it (S^T <- S^T P^T + e^T, a float32
// product on tf32 tensor cores, where the chunks' bfloat16 would round the whole state).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/bulk_copy.cuh"
#include "cuda/chunk_params.h"
#include "cuda/chunk_records.cuh"
#include "cuda/device_io.cuh"
#include "cuda/mma.cuh"
#include "cuda/wgmma.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kWarpColumns = 16;  // value columns per warp (the m of its products)

template <int KP>
struct StateGeometry {
  static constexpr int BV = chunk_state_columns(KP);
  static constexpr int kWarps = BV / kWarpColumns;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTokenTiles = kChunk / 8;  // n8 tiles of v_new^T and o^T
};

// One record (this block's tile of u), laid out as in global memory (cuda/chunk_records.cuh),
// each matrix 1024-byte aligned as wgmma's swizzled operands need.
template <int KP>
struct Stage {
  using G = StateGeometry<KP>;
  static_assert(G::BV == 64, "a block's columns of u are one tile of the record");
  alignas(1024) bf16 qg[kChunk * KP];
  alignas(1024) bf16 kg[kChunk * KP];
  alignas(1024) bf16 w[kChunk * KP];
  alignas(1024) bf16 u[kChunk * G::BV];
  alignas(1024) bf16 a[kChunk * kChunk];
  alignas(16) float decay[kRecordFloats<KP>];  // the record's run: decay, inv_q, inv_k

  __device__ const float* inv_q() const { return decay + kInvQAt<KP>; }
  __device__ const float* inv_k() const { return decay + kInvKAt<KP>; }
};
// With split_aqk A_qk's low part too (ChunkParams::aqk_lo); kernels without it keep the
// stage above, and their shared memory.
template <int KP>
struct SplitStage : Stage<KP> {
  alignas(1024) bf16 a_lo[kChunk * kChunk];
};
template <int KP, bool kSplit>
using StageOf = std::conditional_t<kSplit, SplitStage<KP>, Stage<KP>>;

// Records staged in shared memory: two stages where they fit (chunk i + 1's record lands
// while chunk i computes), else one. One stage at KP <= 128 also lets two blocks share an SM,
// each hiding the other's fetch and latencies (launch_state_kernel chooses).
template <int KP>
inline constexpr int kDefaultStages = KP <= 128 ? 2 : 1;
template <int KP, int kStages>
inline constexpr int kBlocksPerSM = kStages == 1 && KP <= 128 ? 2 : 1;
// __launch_bounds__' minimum blocks per SM: 0 (none stated) unless two must fit; a stated 1
// makes ptxas spend all 255 registers (and spill) on the mma.sync kernels.
template <int KP, int kStages>
inline constexpr int kMinBlocks = kBlocksPerSM<KP, kStages> == 2 ? 2 : 0;

template <int KP, int kStages, bool kSplit>
struct StateShared {
  using G = StateGeometry<KP>;
  StageOf<KP, kSplit> stage[kStages];
  alignas(16) float o[G::kWarps][kChunk][kWarpColumns + 4];  // each warp's output, staged
  uint64_t landed[kStages];  // each stage's bulk copies complete here (Hopper)
};
// Dynamic shared memory is requested this much larger than StateShared, whose start the
// kernel rounds up to a multiple of 1024 bytes (the launch promises 16).
constexpr int kSharedAlignSlack = 1024;
template <int KP, int kStages = kDefaultStages<KP>, bool kSplit = false>
inline constexpr int kStateSharedBytes =
    sizeof(StateShared<KP, kStages, kSplit>) + kSharedAlignSlack;
// Each stage's T diag(beta) (ChunkParams::v_from_tokens with the delta rule; u's slot holds
// v's tile then) lies past StateShared, 1024-byte aligned for wgmma, in memory that only
// those launches request (kTuSharedBytes more): the other launches keep their size.
template <int KP, int kStages, bool kSplit>
inline constexpr int kTuOffset = (sizeof(StateShared<KP, kStages, kSplit>) + 1023) / 1024 * 1024;
template <int KP, int kStages, bool kSplit>
inline constexpr int kTuSharedBytes = kTuOffset<KP, kStages, kSplit> -
                                      sizeof(StateShared<KP, kStages, kSplit>) +
                                      kStages * kChunk * kChunk * sizeof(bf16);
template <int KP, int kStages, bool kSplit>
constexpr int state_shared_bytes(bool tu) {
  return kStateSharedBytes<KP, kStages, kSplit> + (tu ? kTuSharedBytes<KP, kStages, kSplit> : 0);
}
static_assert(kBlocksPerSM<128, 1> * state_shared_bytes<128, 1, true>(true) <= 227 * 1024,
              "one stage at K <= 128, with the A_qk pair and T diag(beta), fits twice in a "
              "Hopper SM");

// A chunk's rows of the token tensors the state kernel reads as given: q and k
// (ChunkParams::qk_from_tokens; null otherwise), row t at q + t q_stride (k alike), K bfloat16
// channels each; v (v_from_tokens; null otherwise) from the block's first value column on,
// `cols` of them before V. Rows t < len are the sequence's tokens in the chunk.
struct TokenRows {
  const bf16 *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  int len = 0, K = 0, cols = 0;
};

// Copies one record (this block's tile of u, unless with_u is false: a map's identity
// columns have none) into a stage: on Hopper one bulk copy per matrix, completing on the
// stage's barrier `landed`; elsewhere 16-byte cp.async pieces in one commit group. Token rows
// come by cp.async instead, in one commit group: with tokens.k (ChunkParams::qk_from_tokens)
// the stage's qg and kg take the chunk's rows of q (with_q: the maps need none) and k, with
// tokens.v (v_from_tokens) its u takes the tile of v, and stage_tu (the stage's place past
// StateShared, kTuOffset; null unless records_keep_tu) the record's T diag(beta).
template <int KP, bool kSplit>
__device__ void fetch_record(const Record& r, const TokenRows& tokens, int64_t j0, bool delta,
                             bool with_u, bool with_q, StageOf<KP, kSplit>& st, bf16* stage_tu,
                             uint64_t* landed) {
  using G = StateGeometry<KP>;
  constexpr int kKeys = kChunk * KP, kValues = kChunk * G::BV, kA = kChunk * kChunk,
                kFloats = kRecordFloats<KP>;
  const int tid = threadIdx.x;
  const bool qk_tokens = tokens.k != nullptr, v_tokens = tokens.v != nullptr;
  const bf16* u = v_tokens ? nullptr : r.u + j0 * kChunk;  // the tile of columns j0 ..
  if (qk_tokens) {
    if (with_q) fetch_token_rows<KP, G::kThreads>(st.qg, tokens.q, tokens.q_stride, tokens.len,
                                                  tokens.K);
    fetch_token_rows<KP, G::kThreads>(st.kg, tokens.k, tokens.k_stride, tokens.len, tokens.K);
  }
  if (v_tokens && with_u)
    fetch_token_rows<G::BV, G::kThreads>(st.u, tokens.v, tokens.v_stride, tokens.len,
                                         tokens.cols);
  const bool tu = v_tokens && delta && with_u;
  if constexpr (kBulkCopies) {
    if (qk_tokens || v_tokens) commit_async();
    constexpr uint32_t kKeyBytes = kKeys * sizeof(bf16), kValueBytes = kValues * sizeof(bf16),
                       kABytes = kA * sizeof(bf16);
    // One thread issues all of them: a switch over six threads compiled to a jump table whose
    // branch held 5% of the kernel's samples (NOTES (ai)).
    if (tid == 0) {
      expect_bytes(landed, (qk_tokens ? 0 : 2 * kKeyBytes) + (delta ? kKeyBytes : 0) +
                               (with_u && !v_tokens ? kValueBytes : 0) + (tu ? kABytes : 0) +
                               (kSplit ? 2 : 1) * kABytes + kFloats * sizeof(float));
      if (!qk_tokens) {
        bulk_copy(st.qg, r.qg, kKeyBytes, landed);
        bulk_copy(st.kg, r.kg, kKeyBytes, landed);
      }
      if (delta) bulk_copy(st.w, r.w, kKeyBytes, landed);
      if (with_u && !v_tokens) bulk_copy(st.u, u, kValueBytes, landed);
      if (tu) bulk_copy(stage_tu, r.tu, kABytes, landed);
      bulk_copy(st.a, r.aqk, kABytes, landed);
      if constexpr (kSplit) bulk_copy(st.a_lo, r.aqk_lo, kA * sizeof(bf16), landed);
      bulk_copy(st.decay, r.decay, kFloats * sizeof(float), landed);
    }
  } else {
    for (int e = 8 * tid; e < kKeys; e += 8 * G::kThreads) {
      if (!qk_tokens) {
        copy_async<16>(st.qg + e, r.qg + e, 16);
        copy_async<16>(st.kg + e, r.kg + e, 16);
      }
      if (delta) copy_async<16>(st.w + e, r.w + e, 16);
    }
    for (int e = 8 * tid; with_u && !v_tokens && e < kValues; e += 8 * G::kThreads)
      copy_async<16>(st.u + e, u + e, 16);
    for (int e = 8 * tid; e < kA; e += 8 * G::kThreads) {
      if (tu) copy_async<16>(stage_tu + e, r.tu + e, 16);
      copy_async<16>(st.a + e, r.aqk + e, 16);
      if constexpr (kSplit) copy_async<16>(st.a_lo + e, r.aqk_lo + e, 16);
    }
    for (int e = 4 * tid; e < kFloats; e += 4 * G::kThreads)
      copy_async<16>(st.decay + e, r.decay + e, 16);
    commit_async();
  }
}

// Waits for this thread's view of a fetched stage: its barrier's phase `use % 2` (the stage's
// use-th fetch) on Hopper, the thread's own cp.async group elsewhere. A block barrier must
// follow before the stage is read (other threads' copies). Token rows (`tokens`) come by
// cp.async on Hopper too, and are then fenced for wgmma, which reads them in the async proxy.
__device__ __forceinline__ void await_record(uint64_t* landed, int64_t use, bool tokens) {
  if constexpr (kBulkCopies) {
    if (tokens) {
      wait_async<0>();
      fence_proxy_async();
    }
    wait_landed(landed, static_cast<uint32_t>(use % 2));
  } else {
    wait_async<0>();
  }
}

// The left-operand fragment of k-step kk (columns 16 kk .. 16 kk + 15 of a 16-row product
// held as n8 accumulator tiles): tiles 2 kk and 2 kk + 1, in bfloat16.
template <int N>
__device__ __forceinline__ void a_from_acc(uint32_t (&a)[4], const Acc (&acc)[N], int kk) {
  a[0] = pack_bf16(acc[2 * kk].d[0], acc[2 * kk].d[1]);
  a[1] = pack_bf16(acc[2 * kk].d[2], acc[2 * kk].d[3]);
  a[2] = pack_bf16(acc[2 * kk + 1].d[0], acc[2 * kk + 1].d[1]);
  a[3] = pack_bf16(acc[2 * kk + 1].d[2], acc[2 * kk + 1].d[3]);
}

// ChunkParams::aqk_f16: the same fragment as float16 with rows acc_row(0) and acc_row(2) of
// the warp's 16 times row[0] and row[1].
template <int N>
__device__ __forceinline__ void a_from_acc_f16(uint32_t (&a)[4], const Acc (&acc)[N], int kk,
                                               const float (&row)[2]) {
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const Acc& t = acc[2 * kk + x / 2];
    const int e = 2 * (x % 2);
    a[x] = pack_f16(t.d[e] * row[x % 2], t.d[e + 1] * row[x % 2]);
  }
}

// ChunkParams::aqk_f16: for the thread's two rows of a 16 x C product held as n8 accumulator
// tiles (a row's C values lie with the four lanes of a quad), the power of two that puts the
// row's largest magnitude in [2^14, 2^15), float16's top binade but one, and its inverse:
// 2^(141 - E) for a largest magnitude of exponent field E (at least 2^-114, for E = 255: an
// infinite row stays infinite), at most 2^64 so that the output rows it also scales stay
// finite where v_new's row is tiny beside them (below 2^-50: its float16 values then lie
// under 2^14, still normal down to 2^-78); 1 for a zero row. NaN is passed over, and passes
// through.
__device__ __forceinline__ void f16_row_scales(const Acc (&x)[kChunk / 8], float (&row)[2],
                                               float (&inv)[2]) {
  float m[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) m[e / 2] = fmaxf(m[e / 2], fabsf(x[nt].d[e]));
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
    const int field = static_cast<int>(__float_as_uint(m[r]) >> 23);  // m >= 0: no sign bit
    const int e = field == 0 ? 127 : min(268 - field, 127 + 64);
    row[r] = __uint_as_float(static_cast<uint32_t>(e) << 23);
    inv[r] = __uint_as_float(static_cast<uint32_t>(254 - e) << 23);
  }
}

// The rows of a 16 x C product held as n8 accumulator tiles times row[0] and row[1], and with
// `scale` (null: none) its columns (tokens) times scale[token].
__device__ __forceinline__ void scale_rows_and_token_columns(Acc (&x)[kChunk / 8],
                                                             const float (&row)[2],
                                                             const float* scale) {
#pragma unroll
  for (int nt = 0; nt < kChunk / 8; ++nt) {
    const float2 n = scale ? *reinterpret_cast<const float2*>(&scale[8 * nt + acc_col(0)])
                           : make_float2(1.f, 1.f);
    x[nt].d[0] *= n.x * row[0], x[nt].d[1] *= n.y * row[0];
    x[nt].d[2] *= n.x * row[1], x[nt].d[3] *= n.y * row[1];
  }
}

// This warp's acc[16 x N] += left[16 x K] . B on mma.sync, B from a record matrix x in shared
// memory: x^T for an [n][k] matrix (kNK), x itself for a [k][n] one. kLower skips the blocks
// of B above its block diagonal (n block < k block), which A_qk^T leaves zero. With kF16 both
// operands are float16, left's rows times row0 and row1 (a_from_acc_f16).
template <int K, int N, bool kNK, bool kLower = false, bool kF16 = false>
__device__ __forceinline__ void warp_product(Acc (&acc)[N / 8], const Acc (&left)[K / 8],
                                             const bf16* x, float row0 = 1.f, float row1 = 1.f) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    if constexpr (kF16) {
      const float row[2] = {row0, row1};
      a_from_acc_f16(a, left, kk, row);
    } else {
      a_from_acc(a, left, kk);
    }
#pragma unroll
    for (int np = kLower ? kk : 0; np < N / 16; ++np) {
      uint32_t b[4];
      if constexpr (kNK)
        load_record_b_pair_nk(b, x, 16 * np, 16 * kk);
      else
        load_record_b_pair_kn(b, x, 16 * np, 16 * kk);
      mma_16bit<kF16>(acc[2 * np], a, b[0], b[1]);
      mma_16bit<kF16>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// A float as an element of the chunk states (ForwardArgs::chunk_states), and two of them at
// adjacent addresses as one vector store.
template <class Out> __device__ __forceinline__ Out narrow(float x) { return static_cast<Out>(x); }
template <> __device__ __forceinline__ bf16 narrow<bf16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half(x); }
template <class Out>
struct alignas(2 * sizeof(Out)) OutPair {
  Out lo, hi;
};

// This warp's 16 columns of the state, transposed: element (column j0 + col, key) of
// S^T is acc[key / 8].d[e] with col = acc_row(e) and key % 8 = acc_col(e).
template <int KP>
struct StateColumns {
  Acc acc[KP / 8];

  // Calls f(value, offset) for each of this thread's state values inside K x V, with its
  // element offset in the state tensor s.
  template <class F>
  __device__ void for_each_value(const RecurrentParams& p, const StateTensor& s, int64_t n,
                                 int64_t hv, int64_t j0, F&& f) {
#pragma unroll
    for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 8 * nt + acc_col(e), j = j0 + acc_row(e);
        if (i < p.K && j < p.V)
          f(acc[nt].d[e], n * s.slot_stride + hv * s.head_stride + i * s.key_stride +
                              j * s.value_stride);
      }
  }

  // The initial state (zeros where absent and past K / V).
  __device__ void load(const RecurrentParams& p, int64_t n, int64_t hv, int64_t j0) {
    const auto* in = static_cast<const float*>(p.state_in.data);
    for (Acc& a : acc) a = Acc{};
    if (in) for_each_value(p, p.state_in, n, hv, j0, [&](float& x, int64_t off) { x = in[off]; });
  }

  __device__ void store(const RecurrentParams& p, int64_t n, int64_t hv, int64_t j0) {
    auto* out = static_cast<float*>(p.state_out.data);
    if (out) for_each_value(p, p.state_out, n, hv, j0, [&](float& x, int64_t off) { out[off] = x; });
  }

  // Columns j0 .. of the K x K identity (a segment map's P part starts from them).
  __device__ void identity(const RecurrentParams& p, int64_t j0) {
#pragma unroll
    for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 8 * nt + acc_col(e), j = j0 + acc_row(e);
        acc[nt].d[e] = i == j && i < p.K ? 1.f : 0.f;
      }
  }

  // f(value, element offset in a K x (V + K) segment map) for this thread's values inside K
  // and width, the block's columns starting at column `first` of the map.
  template <class F>
  __device__ void for_each_map_value(const RecurrentParams& p, int64_t j0, int64_t width,
                                     int64_t first, F&& f) {
#pragma unroll
    for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 8 * nt + acc_col(e), j = j0 + acc_row(e);
        if (i < p.K && j < width) f(acc[nt].d[e], i * (p.V + p.K) + first + j);
      }
  }

  // Entry `entry` of the chunk states. It runs once per chunk, inside the sequential loop:
  // the dtype is resolved once, and a slice inside K x V (K = KP) stores at fixed offsets
  // from one address, key pairs as one vector store where keys are dense (V-first).
  __device__ void store_entry(const ChunkParams& c, int64_t entry, int64_t hv, int64_t j0) {
    switch (c.chunk_states_dtype) {
      case DType::bf16: return store_entry_as<bf16>(c, entry, hv, j0);
      case DType::f16: return store_entry_as<__half>(c, entry, hv, j0);
      case DType::f64: return store_entry_as<double>(c, entry, hv, j0);
      default: return store_entry_as<float>(c, entry, hv, j0);
    }
  }

  template <class Out>
  __device__ void store_entry_as(const ChunkParams& c, int64_t entry, int64_t hv, int64_t j0) {
    const StateTensor& s = c.chunk_states;
    Out* out = static_cast<Out*>(s.data);
    if (KP != c.p.K || j0 + kWarpColumns > c.p.V) {  // a partial slice: every store checked
      for_each_value(c.p, s, entry, hv, j0,
                     [&](float& x, int64_t off) { out[off] = narrow<Out>(x); });
      return;
    }
    // Element e of tile nt lies at base + nt * keys8 (+ key_stride for odd e, + cols8 for e >= 2).
    Out* base = out + entry * s.slot_stride + hv * s.head_stride +
                (j0 + acc_row(0)) * s.value_stride + acc_col(0) * s.key_stride;
    const int64_t keys8 = 8 * s.key_stride, cols8 = 8 * s.value_stride;
    const bool pairs = s.key_stride == 1 && s.slot_stride % 2 == 0 && s.head_stride % 2 == 0 &&
                       s.value_stride % 2 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % sizeof(OutPair<Out>) == 0;
    if (pairs) {
#pragma unroll
      for (int nt = 0; nt < KP / 8; ++nt) {
        Out* at = base + nt * keys8;
        *reinterpret_cast<OutPair<Out>*>(at) = {narrow<Out>(acc[nt].d[0]),
                                                narrow<Out>(acc[nt].d[1])};
        *reinterpret_cast<OutPair<Out>*>(at + cols8) = {narrow<Out>(acc[nt].d[2]),
                                                        narrow<Out>(acc[nt].d[3])};
      }
      return;
    }
#pragma unroll
    for (int nt = 0; nt < KP / 8; ++nt) {
      Out* at = base + nt * keys8;
      at[0] = narrow<Out>(acc[nt].d[0]);
      at[s.key_stride] = narrow<Out>(acc[nt].d[1]);
      at[cols8] = narrow<Out>(acc[nt].d[2]);
      at[cols8 + s.key_stride] = narrow<Out>(acc[nt].d[3]);
    }
  }
};

// This warp's columns of the stage's u as v_new^T's tiles (zero for a map's identity
// columns, which have no u): ldmatrix.trans of u's [token][column] 8x8 blocks gives each lane
// the accumulator layout's (column, token pair) directly.
template <int KP>
__device__ __forceinline__ void load_u(Acc (&vn)[kChunk / 8], const Stage<KP>& st, bool map,
                                       int warp) {
  if (map) {
    for (Acc& x : vn) x = Acc{};
    return;
  }
  const int l = threadIdx.x % 32, m = l / 8;  // lane l addresses row l % 8 of matrix m
#pragma unroll
  for (int np = 0; np < kChunk / 16; ++np) {  // token tiles 2 np (matrices 0, 1) and 2 np + 1
    uint32_t r[4];
    ldmatrix_x4<true>(r, st.u + record_index(16 * np + 8 * (m / 2) + l % 8,
                                             kWarpColumns * warp + 8 * (m % 2)));
#pragma unroll
    for (int x = 0; x < 4; ++x) {  // matrix x: token tile 2 np + x / 2, columns + 8 (x % 2)
      Acc& a = vn[2 * np + x / 2];
      a.d[2 * (x % 2)] = __uint_as_float(r[x] << 16);
      a.d[2 * (x % 2) + 1] = __uint_as_float(r[x] & 0xFFFF0000u);
    }
  }
}

// The columns (tokens) of a 16 x C product held as n8 accumulator tiles, times scale[token].
__device__ __forceinline__ void scale_token_columns(Acc (&x)[kChunk / 8], const float* scale) {
#pragma unroll
  for (int nt = 0; nt < kChunk / 8; ++nt) {
    const float2 n = *reinterpret_cast<const float2*>(&scale[8 * nt + acc_col(0)]);
    x[nt].d[0] *= n.x, x[nt].d[1] *= n.y, x[nt].d[2] *= n.x, x[nt].d[3] *= n.y;
  }
}

// Before the state update: v_new^T's columns (tokens) scaled by n_k, S^T's (keys) by the
// chunk's decay.
template <int KP>
__device__ __forceinline__ void scale_for_update(Acc (&vn)[kChunk / 8], Acc (&s)[KP / 8],
                                                 const Stage<KP>& st) {
  scale_token_columns(vn, st.inv_k());
#pragma unroll
  for (int nt = 0; nt < KP / 8; ++nt) {
    const float2 d = *reinterpret_cast<const float2*>(&st.decay[8 * nt + acc_col(0)]);
    s[nt].d[0] *= d.x, s[nt].d[1] *= d.y, s[nt].d[2] *= d.x, s[nt].d[3] *= d.y;
  }
}

// One chunk for this warp's 16 columns on mma.sync, each warp reading the whole record:
//     v_new^T = u^T - S^T w^T,   o^T = S^T qg^T + v_new^T A_qk^T (unless kEnds),
//     S^T = S^T diag(decay) + v_new^T diag(n_k) kg.
// With q and k as given (tokens: ChunkParams::qk_from_tokens) S^T q^T's columns take inv_q
// before A_qk's term, as with kF16 (see chunk_step_wgmma). With tu (v_from_tokens, the
// delta rule; null otherwise) the stage holds v's tile in u's place and u^T = v^T tu^T comes
// first.
template <int KP, bool kEnds, bool kSplit, bool kF16>
__device__ __forceinline__ void chunk_step_mma_sync(const StageOf<KP, kSplit>& st,
                                                    StateColumns<KP>& S, Acc (&o)[kChunk / 8],
                                                    bool delta, bool map, bool tokens,
                                                    const bf16* tu, int warp) {
  Acc vn[kChunk / 8], u[kChunk / 8];
  if (tu) {  // tu is zero above its diagonal, as A_qk
    Acc v[kChunk / 8];
    load_u(v, st, map, warp);
    warp_product<kChunk, kChunk, true, true>(u, v, tu);
  } else {
    load_u(u, st, map, warp);
  }
  if (delta) warp_product<KP, kChunk, true>(vn, S.acc, st.w);
#pragma unroll
  for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) vn[nt].d[e] = u[nt].d[e] - vn[nt].d[e];

  if (!kEnds) warp_product<KP, kChunk, true>(o, S.acc, st.qg);
  // A_qk is zero right of the diagonal, so token block kk of v_new only reaches output
  // tokens from 16 kk on.
  if (!kEnds && kF16) {  // as in chunk_step_wgmma
    float row[2], row_inv[2];
    f16_row_scales(vn, row, row_inv);
    scale_rows_and_token_columns(o, row, st.inv_q());
    warp_product<kChunk, kChunk, true, true, true>(o, vn, st.a, row[0], row[1]);
    if constexpr (kSplit)
      warp_product<kChunk, kChunk, true, true, true>(o, vn, st.a_lo, row[0], row[1]);
    scale_rows_and_token_columns(o, row_inv, nullptr);
  } else if (!kEnds) {
    if (tokens) scale_token_columns(o, st.inv_q());
    warp_product<kChunk, kChunk, true, true>(o, vn, st.a);
    if constexpr (kSplit) warp_product<kChunk, kChunk, true, true>(o, vn, st.a_lo);
  }

  scale_for_update(vn, S.acc, st);
  warp_product<kChunk, KP, false>(S.acc, vn, st.kg);
}

// Bytes from a K-major record matrix's start to k-step kk (16 columns): its tile kk / 4, 32
// bytes a step inside (cuda/chunk_records.cuh).
__host__ __device__ constexpr uint32_t k_step_bytes(int kk) {
  return (kk / 4) * (kChunk * 64 * 2) + (kk % 4) * 32;
}

// The same chunk on wgmma: the block's 4 warps are one warpgroup, S^T (64 columns x KP keys)
// its left operand from registers, and each record matrix is read once per block instead of
// once per warp. v_new^T starts from u^T and takes -S^T w^T (the left operand negated); the
// first batch (w and qg, both from S^T's fragments) runs while nothing else waits on it.
// With kF16 (ChunkParams::aqk_f16) A_qk is float16 and so is v_new^T in its product, each
// row scaled by f16_row_scales; o^T's rows take the same factors before the product (and
// its columns n_q, which A_qk's rows carry already) and their inverses after it.
template <int KP, bool kEnds, bool kSplit, bool kF16>
__device__ __forceinline__ void chunk_step_wgmma(const StageOf<KP, kSplit>& st,
                                                 StateColumns<KP>& S, Acc (&o)[kChunk / 8],
                                                 bool delta, bool map, bool tokens,
                                                 const bf16* tu, int warp) {
  Acc vn[kChunk / 8];
  load_u(vn, st, map, warp);  // u^T, or v^T with tu
  // With tu v_new^T starts from v^T tu^T, in the same batch.
  uint32_t v[kChunk / 16][4];
  if (tu) {
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) a_from_acc(v[kk], vn, kk);
    for (Acc& x : vn) x = Acc{};
  }
  for (Acc& x : o) x = Acc{};
  // Every fragment of S^T first: registers the batch reads stay distinct, so ptxas need not
  // wait for one product before it forms the next fragment in the same registers.
  uint32_t a[KP / 16][4];
#pragma unroll
  for (int kk = 0; kk < KP / 16; ++kk) a_from_acc(a[kk], S.acc, kk);
  const SwizzledOperand w(st.w), qg(st.qg), aqk(st.a), kg(st.kg);
  wgmma_fence();
  hold_registers(vn);
  hold_registers(o);
  if (tu) {
    const SwizzledOperand t(tu);
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk)
      wgmma_m64n64k16<false>(vn, v[kk], t.at(k_step_bytes(kk)));
  }
  if (delta)
#pragma unroll
    for (int kk = 0; kk < KP / 16; ++kk) {
      wgmma_m64n64k16<false, -1>(vn, a[kk], w.at(k_step_bytes(kk)));
      if (!kEnds) wgmma_m64n64k16<false>(o, a[kk], qg.at(k_step_bytes(kk)));
    }
  else if (!kEnds)
#pragma unroll
    for (int kk = 0; kk < KP / 16; ++kk) wgmma_m64n64k16<false>(o, a[kk], qg.at(k_step_bytes(kk)));
  wgmma_commit();
  wgmma_wait<0>();
  hold_registers(vn);
  hold_registers(o);

  float row[2], row_inv[2];
  if (!kEnds && kF16) {  // the same product on float16 operands, v_new^T's rows scaled
    f16_row_scales(vn, row, row_inv);
    scale_rows_and_token_columns(o, row, st.inv_q());
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      uint32_t b[4];
      a_from_acc_f16(b, vn, kk, row);
      wgmma_m64n64k16<false, 1, true>(o, b, aqk.at(k_step_bytes(kk)));
      if constexpr (kSplit)
        wgmma_m64n64k16<false, 1, true>(o, b, SwizzledOperand(st.a_lo).at(k_step_bytes(kk)));
    }
    wgmma_commit();
  } else if (!kEnds) {  // o^T += v_new^T A_qk^T (the zero blocks above A_qk's diagonal included)
    if (tokens) scale_token_columns(o, st.inv_q());
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      uint32_t b[4];
      a_from_acc(b, vn, kk);
      wgmma_m64n64k16<false>(o, b, aqk.at(k_step_bytes(kk)));
    }
    if constexpr (kSplit) {
      const SwizzledOperand aqk_lo(st.a_lo);
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        uint32_t b[4];
        a_from_acc(b, vn, kk);
        wgmma_m64n64k16<false>(o, b, aqk_lo.at(k_step_bytes(kk)));
      }
    }
    wgmma_commit();
  }

  // S^T += v_new^T diag(n_k) kg, kg N-major: key tile j, tokens 16 kk .. as rows.
  scale_for_update(vn, S.acc, st);
  wgmma_fence();
  hold_registers(S.acc);
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
    uint32_t b[4];
    a_from_acc(b, vn, kk);
#pragma unroll
    for (int j = 0; j < KP / 64; ++j)
      wgmma_m64n64k16<true>(reinterpret_cast<Acc(&)[8]>(S.acc[8 * j]), b,
                            kg.at(j * (kChunk * 64 * 2) + kk * 16 * 128));
  }
  wgmma_commit();
  wgmma_wait<0>();
  hold_registers(S.acc);
  hold_registers(o);
  if (!kEnds && kF16) scale_rows_and_token_columns(o, row_inv, nullptr);
}

// inv_q's entries for accumulator tile nt of o^T (its tokens 8 nt + acc_col), or ones where
// o^T is scaled already (inv_q null: ChunkParams::qk_from_tokens, or kF16).
__device__ __forceinline__ float2 token_scale(const float* inv_q, int nt) {
  return inv_q ? *reinterpret_cast<const float2*>(&inv_q[8 * nt + acc_col(0)])
               : make_float2(1.f, 1.f);
}

// This warp's 16 columns of the chunk's output rows t0 .. t0 + 63 (those before len): o^T's
// tiles with their tokens scaled by n_q (token_scale), through the warp's staging rows ob, in
// runs of 8 columns (any dtype and layout: store_run8).
__device__ __forceinline__ void store_output(const RecurrentParams& p, const Acc (&o)[kChunk / 8],
                                             const float* inv_q, float (*ob)[kWarpColumns + 4],
                                             int64_t o_base, int64_t t0, int64_t len, int64_t jw) {
#pragma unroll
  for (int nt = 0; nt < kChunk / 8; ++nt) {
    const float2 n = token_scale(inv_q, nt);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      ob[8 * nt + acc_col(e)][acc_row(e)] = o[nt].d[e] * (e % 2 ? n.y : n.x);
  }
  __syncwarp();
  constexpr int kRuns = kChunk * kWarpColumns / 8;
#pragma unroll
  for (int x = threadIdx.x % 32; x < kRuns; x += 32) {
    const int row = x / (kWarpColumns / 8), col = 8 * (x % (kWarpColumns / 8));
    const int64_t t = t0 + row, j = jw + col;
    if (t >= len) continue;
    float run[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) run[e] = ob[row][col + e];
    store_run8(p.o, o_base + t * p.o.stride[1] + j * p.o.stride[3], clamp_run(p.V - j), run);
  }
  __syncwarp();  // the next chunk rewrites the staging rows
}

// The same for a dense bfloat16 output (ChunkParams::dense_output; sm_90): o^T's tiles go to
// the staging rows as bfloat16 [token][column] by 4 stmatrix.trans, and each run of 8 columns
// is one 16-byte load and store. Rows 24 elements apart keep both conflict-free.
__device__ __forceinline__ void store_output_dense(const RecurrentParams& p,
                                                   const Acc (&o)[kChunk / 8], const float* inv_q,
                                                   float (*ob)[kWarpColumns + 4], int64_t o_base,
                                                   int64_t t0, int64_t len, int64_t jw) {
  constexpr int kLd = 24;
  static_assert(kChunk * kLd * sizeof(bf16) <= kChunk * (kWarpColumns + 4) * sizeof(float));
  bf16* rows = reinterpret_cast<bf16*>(&ob[0][0]);
  const int l = threadIdx.x % 32, m = l / 8;
  // Every token tile's n_q before the stmatrix stores (reads before stores: cuda/device_io.cuh).
  float2 n[kChunk / 8];
#pragma unroll
  for (int nt = 0; nt < kChunk / 8; ++nt) n[nt] = token_scale(inv_q, nt);
#pragma unroll
  for (int np = 0; np < kChunk / 16; ++np) {  // token tiles 2 np, 2 np + 1: matrices 0-1, 2-3
    uint32_t r[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int nt = 2 * np + x / 2;
      r[x] = pack_bf16(o[nt].d[2 * (x % 2)] * n[nt].x, o[nt].d[2 * (x % 2) + 1] * n[nt].y);
    }
    stmatrix_x4_trans(rows + (16 * np + 8 * (m / 2) + l % 8) * kLd + 8 * (m % 2), r);
  }
  __syncwarp();
  auto* out = static_cast<bf16*>(const_cast<void*>(p.o.data)) + o_base + jw;
  constexpr int kRuns = kChunk * kWarpColumns / 8;
#pragma unroll
  for (int x = l; x < kRuns; x += 32) {
    const int row = x / 2, col = 8 * (x % 2);
    const int64_t t = t0 + row;
    if (t >= len || jw + col >= p.V) continue;
    *reinterpret_cast<uint4*>(out + t * p.o.stride[1] + col) =
        *reinterpret_cast<const uint4*>(rows + row * kLd + col);
  }
  __syncwarp();  // the next chunk rewrites the staging rows
}

// S^T = S^T P^T + e^T: the state carried across the segment whose map is m (K rows of
// V + K floats: e, then P). P's rows (the result's keys) go through `scratch` (kChunk rows of
// KP + 8 floats, the stages' memory) kChunk at a time, by asynchronous copies that all go out
// before any lands; tf32 products with float32 sums. The
// first half of the result waits in the warp's output rows `ob` while the second is formed
// (the whole result in registers beside S spilled). Starts and ends with a block barrier.
template <int KP>
__device__ void carry_across_segment(const RecurrentParams& p, const float* m, int64_t jw,
                                     StateColumns<KP>& S, float (*scratch)[KP + 8],
                                     float (*ob)[kWarpColumns + 4]) {
  static_assert(KP <= 2 * kChunk, "two rounds of kChunk keys at the most");
  constexpr int kRounds = KP / kChunk, kTiles = kChunk / 8;
  const int64_t K = p.K, ld = p.V + p.K;
  const int g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
  Acc t[kTiles];
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    __syncthreads();
    const int64_t rows = K - r * kChunk < kChunk ? K - r * kChunk : kChunk;
    stage_rows(&scratch[0][0], KP + 8, kChunk, KP, m + r * kChunk * ld + p.V, ld,
               static_cast<int>(rows), static_cast<int>(K));
    commit_async();
    wait_async<0>();
    __syncthreads();
    // k-slot c is key 2c of the k-step and slot c + 4 key 2c + 1 (the accumulator's layout),
    // in both operands.
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) t[nt] = Acc{};
#pragma unroll
    for (int kt = 0; kt < KP / 8; ++kt) {
      const Acc& x = S.acc[kt];
      const uint32_t a[4] = {to_tf32(x.d[0]), to_tf32(x.d[2]), to_tf32(x.d[1]), to_tf32(x.d[3])};
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        const float2 b = *reinterpret_cast<const float2*>(&scratch[8 * nt + g][8 * kt + 2 * c]);
        mma_tf32(t[nt], a, to_tf32(b.x), to_tf32(b.y));
      }
    }
    if (r + 1 < kRounds)
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ob[8 * nt + acc_col(e)][acc_row(e)] = t[nt].d[e];
  }
  __syncwarp();
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    S.acc[(kRounds - 1) * kTiles + nt] = t[nt];
    if (kRounds == 2)
#pragma unroll
      for (int e = 0; e < 4; ++e) S.acc[nt].d[e] = ob[8 * nt + acc_col(e)][acc_row(e)];
  }
  S.for_each_map_value(p, jw, p.V, 0, [&](float& x, int64_t off) { x += m[off]; });
  __syncthreads();
}

// The launches of the state kernel: whole sequences, or split ones (the maps, then the
// segments).
enum class StatePass { whole, ends, segments };

// kRecord: write the chunk states. Template flags rather than run-time tests, so the common
// path compiles to the same code as without the features (ptxas allocates the loop's
// registers differently once it holds the stores or the segments' bounds). Blocks are
// numbered ((n * HV + hv) * segments + seg) * tiles + tile, the maps' launch with the
// identity's K columns as tiles after V's.
// kWgmma: the chunk's products on wgmma where this pass compiles it (sm_90a, KP <= 128),
// else on mma.sync. kStages: see StateShared. kSplit: A_qk as a bfloat16 pair
// (ChunkParams::split_aqk; never with kEnds, which has no outputs). kF16: A_qk and its product
// in float16 (ChunkParams::aqk_f16; never with kEnds).
template <int KP, bool kRecord, StatePass kPass, bool kWgmma, int kStages, bool kSplit,
          bool kF16>
__global__ void __launch_bounds__(StateGeometry<KP>::kThreads, kMinBlocks<KP, kStages>)
    chunk_state_kernel(const ChunkParams c) {
  using G = StateGeometry<KP>;
  constexpr bool kEnds = kPass == StatePass::ends;
  constexpr bool kW = kWgmma && kWgmmaCompiled && KP <= 128;
  static_assert(!kW || G::kThreads == 128, "the block is one warpgroup");
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned misalign = smem_address(smem) % kSharedAlignSlack;
  static_assert(!((kSplit || kF16) && kEnds), "the maps have no A_qk term");
  auto& sh = *reinterpret_cast<StateShared<KP, kStages, kSplit>*>(
      smem + (misalign ? kSharedAlignSlack - misalign : 0));
  const RecurrentParams& p = c.p;
  const int64_t segments = kPass == StatePass::whole ? 1 : c.segments;
  const int64_t value_tiles = (p.V + G::BV - 1) / G::BV;
  const int64_t tiles = kEnds ? value_tiles + (p.K + G::BV - 1) / G::BV : value_tiles;
  const int64_t blk = blockIdx.x, tile = blk % tiles, seg = blk / tiles % segments,
                n = blk / (tiles * segments * p.HV), hv = blk / (tiles * segments) % p.HV;
  const bool map = kEnds && tile >= value_tiles;  // the identity's columns
  const int warp = threadIdx.x / 32;
  // The block's and the warp's columns.
  const int64_t j0 = (map ? tile - value_tiles : tile) * G::BV, jw = j0 + kWarpColumns * warp;
  const Sequence seq = sequence_of(p, n);
  const ChunkRange chunks = chunk_range(c, n);
  const int64_t o_base = token_offset(p.o, seq, hv);
  // The segment's chunks [c0, c1); `used` segments of the sequence hold chunks.
  int64_t c0 = 0, c1 = chunks.count, used = 1;
  if constexpr (kPass != StatePass::whole) {
    const int64_t per = c.segment_chunks;
    used = (chunks.count + per - 1) / per;
    c0 = seg * per;
    c1 = chunks.count < c0 + per ? chunks.count : c0 + per;
    if (kEnds ? seg + 1 >= used : seg > 0 && seg >= used) return;
  }
  auto segment_map = [&](int64_t s) {
    return c.ws.segment_maps + ((n * p.HV + hv) * segments + s) * p.K * (p.V + p.K);
  };

  if constexpr (kBulkCopies) {
    if (threadIdx.x < kStages) init_landing_barrier(&sh.landed[threadIdx.x]);
    __syncthreads();
  }
  StateColumns<KP> S;
  if (!kEnds) {
    S.load(p, n, hv, jw);
    if constexpr (kPass == StatePass::segments) {
      for (int64_t s = 0; s < seg; ++s)
        carry_across_segment(p, segment_map(s), jw, S,
                             reinterpret_cast<float(*)[KP + 8]>(&sh.stage[0]), sh.o[warp]);
      if (kBulkCopies && seg > 0) {  // the carries' scratch is the stages' memory
        fence_proxy_async();
        __syncthreads();
      }
    }
  } else if (map) {
    S.identity(p, jw);
  }
  // Chunk i's stage, and how many fetches into that stage came before it.
  auto record = [&](int64_t i) { return record_of<KP>(c, (chunks.first + i) * p.HV + hv); };
  auto stage = [&](int64_t i) { return static_cast<int>((i - c0) % kStages); };
  // Token tensors read as given (ChunkParams::qk_from_tokens, v_from_tokens): the sequence's
  // rows, v's from the block's first column.
  const bool tokens = c.qk_from_tokens, v_tokens = c.v_from_tokens;
  // Each stage's T diag(beta) with v's tiles and the delta rule (kTuOffset), else null.
  bf16* const tu = v_tokens && p.delta
                       ? reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(&sh) +
                                                 kTuOffset<KP, kStages, kSplit>)
                       : nullptr;
  auto stage_tu = [&](int s) { return tu ? tu + s * kChunk * kChunk : nullptr; };
  const int64_t h = hv / p.group;
  auto rows_of = [&](const TokenTensor& x, int64_t head, int64_t col) {
    return static_cast<const bf16*>(x.data) + token_offset(x, seq, head) + col;
  };
  const bf16* q_rows = tokens ? rows_of(p.q, h, 0) : nullptr;
  const bf16* k_rows = tokens ? rows_of(p.k, h, 0) : nullptr;
  const bf16* v_rows = v_tokens && !map ? rows_of(p.v, hv, j0) : nullptr;
  auto fetch = [&](int64_t i) {
    const int64_t t0 = i * kChunk, left = seq.len - t0;
    TokenRows rows;
    rows.len = static_cast<int>(left < kChunk ? left : kChunk);
    if (tokens) {
      rows.q = q_rows + t0 * p.q.stride[1], rows.q_stride = p.q.stride[1];
      rows.k = k_rows + t0 * p.k.stride[1], rows.k_stride = p.k.stride[1];
      rows.K = static_cast<int>(p.K);
    }
    if (v_rows) {
      rows.v = v_rows + t0 * p.v.stride[1], rows.v_stride = p.v.stride[1];
      rows.cols = static_cast<int>(p.V - j0 < G::BV ? p.V - j0 : G::BV);
    }
    fetch_record<KP, kSplit>(record(i), rows, j0, p.delta, !map, !kEnds, sh.stage[stage(i)],
                             stage_tu(stage(i)), &sh.landed[stage(i)]);
  };
  if (kStages == 2 && c0 < c1) fetch(c0);

  for (int64_t i = c0; i < c1; ++i) {
    // The registers hold the state entering chunk i: recorded straight from them.
    if (kRecord && !kEnds && chunks.first + i < c.chunk_states_count)
      S.store_entry(c, chunks.first + i, hv, jw);
    StageOf<KP, kSplit>& st = sh.stage[stage(i)];
    if (kStages == 1) fetch(i);
    await_record(&sh.landed[stage(i)], (i - c0) / kStages, tokens || v_rows);
    // Chunk i's stage has landed for every thread, and every warp is done with chunk i - 1,
    // whose stage the prefetch of chunk i + 1 then overwrites while chunk i computes.
    __syncthreads();
    if (kStages == 2 && i + 1 < c1) fetch(i + 1);

    Acc o[G::kTokenTiles];
    const bf16* u_from_v = map ? nullptr : stage_tu(stage(i));  // u = tu v (map: no u)
    if constexpr (kW)
      chunk_step_wgmma<KP, kEnds, kSplit, kF16>(st, S, o, p.delta, map, tokens, u_from_v, warp);
    else
      chunk_step_mma_sync<KP, kEnds, kSplit, kF16>(st, S, o, p.delta, map, tokens, u_from_v,
                                                   warp);

    if (kEnds) {
      if (kStages == 1) __syncthreads();  // the next chunk rewrites the only stage
      continue;
    }
    // With tokens or kF16 o^T's columns are scaled already (either chunk step).
    const float* inv_q = tokens || kF16 ? nullptr : st.inv_q();
    if (kStmatrix && c.dense_output)
      store_output_dense(p, o, inv_q, sh.o[warp], o_base, i * kChunk, seq.len, jw);
    else
      store_output(p, o, inv_q, sh.o[warp], o_base, i * kChunk, seq.len, jw);
    if (kStages == 1) __syncthreads();  // the next chunk rewrites the only stage
  }
  if (kEnds)  // the segment's end, into its map (columns V .. for the identity's)
    S.for_each_map_value(p, jw, map ? p.K : p.V, map ? p.V : 0,
                         [&](float& x, int64_t off) { segment_map(seg)[off] = x; });
  else if (kPass == StatePass::whole || seg == (used > 0 ? used - 1 : 0))
    S.store(p, n, hv, jw);
}

// One launch of the state kernel: one block per (sequence, value head, segment, tile of BV
// columns). With wgmma (the only path instantiated with one stage at KP <= 128), one stage
// where the launch has more blocks than SMs but not more than twice as many, unless the host
// fixed the stages: then every block is resident at once, two per SM. Beyond that both forms
// run in waves, and each block's own prefetch pays more (bench/NOTES.md (ai): varlen's 768
// blocks 0.288 ms with two stages, 0.314 with one).
template <int KP, bool kRecord, StatePass kPass, bool kWgmma, bool kSplit = false,
          bool kF16 = false>
void launch_state_kernel(const ChunkParams& c, int64_t tiles, cudaStream_t stream) {
  using G = StateGeometry<KP>;
  const int64_t blocks = c.p.N * c.p.HV * c.segments * tiles;
  if (blocks <= 0) return;
  auto launch = [&](auto kernel, int smem) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<static_cast<unsigned>(blocks), G::kThreads, smem, stream>>>(c);
  };
  const bool tu = records_keep_tu(c);
  if constexpr (kWgmma && KP <= 128) {
    const bool one = c.state_stages == 1 ||
                     (c.state_stages == 0 && blocks > c.sm_count && blocks <= 2 * c.sm_count);
    if (one)
      return launch(chunk_state_kernel<KP, kRecord, kPass, true, 1, kSplit, kF16>,
                    state_shared_bytes<KP, 1, kSplit>(tu));
  }
  constexpr int kStages = kDefaultStages<KP>;
  launch(chunk_state_kernel<KP, kRecord, kPass, kWgmma, kStages, kSplit, kF16>,
         state_shared_bytes<KP, kStages, kSplit>(tu));
}

template <int KP, bool kWgmma, bool kSplit, bool kF16>
void launch_state_products(const ChunkParams& c, cudaStream_t stream) {
  constexpr int64_t BV = StateGeometry<KP>::BV;
  const int64_t value_tiles = (c.p.V + BV - 1) / BV;
  const bool record = c.chunk_states.data != nullptr;
  if constexpr (KP <= 128) {  // the host splits sequences only there
    if (c.segments > 1) {
      constexpr StatePass kEnds = StatePass::ends, kSegments = StatePass::segments;
      launch_state_kernel<KP, false, kEnds, kWgmma>(c, value_tiles + (c.p.K + BV - 1) / BV,
                                                    stream);
      return record
                 ? launch_state_kernel<KP, true, kSegments, kWgmma, kSplit, kF16>(c, value_tiles,
                                                                                  stream)
                 : launch_state_kernel<KP, false, kSegments, kWgmma, kSplit, kF16>(c, value_tiles,
                                                                                   stream);
    }
  }
  constexpr StatePass kWhole = StatePass::whole;
  record ? launch_state_kernel<KP, true, kWhole, kWgmma, kSplit, kF16>(c, value_tiles, stream)
         : launch_state_kernel<KP, false, kWhole, kWgmma, kSplit, kF16>(c, value_tiles, stream);
}

template <int KP, bool kSplit, bool kF16>
void launch_state(const ChunkParams& c, cudaStream_t stream) {
  if constexpr (KP <= 128)
    if (c.state_wgmma) return launch_state_products<KP, true, kSplit, kF16>(c, stream);
  launch_state_products<KP, false, kSplit, kF16>(c, stream);
}

// The A_qk forms, float16 (ChunkParams::aqk_f16) only where the host allows it (KP <= 128:
// K = 256 would double its width's instantiations for an opt-in).
template <int KP, bool kSplit>
void launch_state_aqk(const ChunkParams& c, cudaStream_t stream) {
  if constexpr (KP <= 128)
    if (c.aqk_f16) return launch_state<KP, kSplit, true>(c, stream);
  launch_state<KP, kSplit, false>(c, stream);
}

// Whether the current GPU's shared memory per block allows the state kernel only one record
// stage (see chunk_state_one_stage_only).
template <int KP, bool kSplit>
bool one_stage_only(const ChunkParams& c) {
  int device = 0, available = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess)
    throw Error(ErrorCode::runtime, "the CUDA chunk schedule: no usable CUDA device");
  const bool tu = records_keep_tu(c);
  const int smem = state_shared_bytes<KP, kDefaultStages<KP>, kSplit>(tu);
  if (available >= smem) return false;
  // The pair's second stage, or the second stage's T diag(beta), passes an A100's 163 KB at
  // K = 128: one stage, which is instantiated with the wgmma flag at KP <= 128
  // (launch_state_kernel), takes it there.
  if ((kSplit || tu) && KP <= 128 && c.state_wgmma &&
      available >= state_shared_bytes<KP, 1, kSplit>(tu))
    return true;
  throw Error(ErrorCode::unsupported,
              "argument 'q': the CUDA chunk state kernel for K <= " + std::to_string(KP) +
                  " needs " + std::to_string(smem) + " bytes of shared memory per block; this "
                  "GPU offers " + std::to_string(available) + " (Hopper: 232448)");
}

// The state kernel's two entry points at key width KP, either A_qk form: each width's
// instantiations compile in a file of their own (cuda/chunk_state_k64.cu, _k128.cu,
// _k256.cu), in parallel; cuda/chunk_state.cpp picks the width.
template <int KP>
void launch_state_width(const ChunkParams& c, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  c.split_aqk ? launch_state_aqk<KP, true>(c, s) : launch_state_aqk<KP, false>(c, s);
}

template <int KP>
bool one_stage_only_width(const ChunkParams& c) {
  return c.split_aqk ? one_stage_only<KP, true>(c) : one_stage_only<KP, false>(c);
}

}  // namespace
}  // namespace flashdelta::detail::cuda
