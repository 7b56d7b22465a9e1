// Arguments of the CUDA chunkwise forward (DESIGN.md section 3): the problem as the recurrent
// kernel sees it, plus the chunk geometry and the workspace that carries each chunk's
// prepared operands from the prepare kernel (steps 1-3, every chunk in parallel) to the state
// kernel (steps 4-5, chunks in order per sequence and value head).
#pragma once

#include <cstdint>

#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {

// Tokens per chunk and per sub-chunk (one warp's block of rows in the prepare kernel).
inline constexpr int kChunk = 64;
inline constexpr int kSubChunk = 16;

// Key width the kernels are compiled for: K padded with zero channels to 64, 128 or 256.
constexpr int chunk_key_width(int64_t K) { return K <= 64 ? 64 : K <= 128 ? 128 : 256; }
// Value columns of u per chunk record: V padded with zeros to a multiple of 64.
constexpr int64_t chunk_value_width(int64_t V) { return (V + 63) / 64 * 64; }
// Value columns one state-kernel block owns: 16 per warp, whose K x 16 state tile stays in
// registers.
constexpr int chunk_state_columns(int) { return 64; }  // split_scan (host_params.h) assumes it

// Floats of a record's run (ChunkWorkspace::decay): decays per key, then inv_q and inv_k.
constexpr int chunk_record_floats(int KP) { return KP + 2 * kChunk; }

// One record per (chunk, value head), index chunk * HV + hv, all zero past the chunk's last
// token and past K / V (decay is 1 past K), with Gamma the cumulative log2 decay from the
// chunk start. The bf16 matrices are stored in tiles of 64 columns, their rows permuted within
// (cuda/chunk_records.cuh, record_index). q and k are taken as given: the L2
// norm's inverse lengths n_q, n_k (1 without it) enter only as row and column scales, where
// they are exact, so that the prepare kernel needs no pass over q and k before its slices:
//     T = (I + A_kk)^-1,  A_kk[i, j] = beta_i n_k,i n_k,j k_i . k_j 2^(Gamma_i - Gamma_j), j < i
// and the state kernel takes
//     v_new = u - w S,   o = diag(n_q) (qg S + A_qk v_new),   S' = diag(decay) S + kg^T n_k v_new
// (n_k v_new: v_new's rows scaled), where the record's n_q holds the attention scale too.
// With ChunkParams::qk_from_tokens there are no qg and kg: the state kernel reads q and k as
// given, and the record's run and A_qk carry the scalar gate's factors instead (see there).
// With ChunkParams::v_from_tokens there is no u: tu instead, and the state kernel reads v.
struct ChunkWorkspace {
  uint16_t* qg = nullptr;   // [KP / 64][C, 64] bf16: q 2^Gamma (reads the chunk-start state)
  uint16_t* kg = nullptr;   // [KP / 64][C, 64] bf16: k 2^(Gamma_end - Gamma) (writes the end state)
  uint16_t* w = nullptr;    // [KP / 64][C, 64] bf16: T diag(n_k) (beta k 2^Gamma), delta rule only
  uint16_t* u = nullptr;    // [VP / 64][C, 64] bf16: T (beta v) (delta) or v (linear)
  uint16_t* aqk = nullptr;  // [C, C]  bf16: q_i . k_j n_k,j 2^(Gamma_i - Gamma_j), j <= i
                            // (aqk_f16: float16, rows times scale n_q,i)
  uint16_t* tu = nullptr;   // [C, C]  bf16: T diag(beta), v_from_tokens with the delta rule
  // [chunk_record_floats(KP)]: [KP] 2^Gamma_end, then [C] scale n_q and [C] n_k (zero past
  // the chunk's last token).
  float* decay = nullptr;
  int64_t* chunk_start = nullptr;  // [N + 1] first chunk of each sequence (cu_seqlens only)
  // Per (sequence, value head, segment) of split sequences, K x (V + K) float32, K-first: the
  // segment's end from a zero state (V columns) and from each unit state (K columns).
  float* segment_maps = nullptr;
};

struct ChunkParams {
  RecurrentParams p;  // sizes, options, token tensors, o, initial / final state, cu_seqlens
  int KP = 64;
  int64_t VP = 64;
  // q, k, v and a vector gate all bf16_dense_runs (host_params.h): the prepare kernel reads
  // them by TokenRuns<true> (cuda/device_io.cuh).
  bool dense_tokens = false;
  // The prepare kernel's T = (I + A_kk)^-1 by column blocks on tf32 tensor cores rather
  // than by distances on the CUDA cores (cuda/chunk_inverse.cuh).
  bool inverse_by_columns = true;
  // The state kernel's products on wgmma (K <= 128; compiled for sm_90a, mma.sync elsewhere)
  // rather than mma.sync.
  bool state_wgmma = false;
  // o is bf16_dense_runs (host_params.h): the state kernel stores it by 16-byte runs from
  // bfloat16 staging (sm_90).
  bool dense_output = false;
  // Record stages of the wgmma state kernel: 0 picks per launch (one, two blocks per SM,
  // where the launch has between sm_count and twice as many blocks), 1 or 2 fix it.
  int state_stages = 0;
  int sm_count = 0;
  int64_t chunks_per_row = 0;  // ceil(T / C), batch rows without cu_seqlens
  int64_t max_chunks = 0;      // chunks of all sequences, or an upper bound with cu_seqlens
  // The state kernel splits each sequence into `segments` runs of segment_chunks chunks
  // (1: not split; K <= 128 only).
  int64_t segments = 1, segment_chunks = 0;
  ChunkWorkspace ws;
  // ForwardArgs::chunk_states (data == nullptr: not wanted): entry first + i of a sequence
  // whose chunks are [first, first + count) holds the state entering its chunk i. Entries
  // at or past chunk_states_count (a malformed device table's) are not written.
  StateTensor chunk_states;
  DType chunk_states_dtype = DType::f32;
  int64_t chunk_states_count = 0;
  // A_qk to ~16 bits instead of bfloat16's 8 (bench/NOTES.md (f), (as)): the prepare kernel's
  // slices take its operands as bfloat16 pairs hi + lo (hi hi, lo hi and hi lo; with a vector
  // gate hi lo over the diagonal blocks only, whose column factors' low parts a 5 KB table
  // keeps; the key tiles' operands are exact already) and store it as such a pair (aqk_lo
  // below), and
  // the state kernel takes A_qk v_new as two products. A template parameter of both kernels:
  // those without it are unchanged by it. Opt-in (FLASHDELTA_CHUNK_AQK=split): +15% of the KDA
  // forward for 4.1e-3 -> 3.0e-3 (bench/NOTES.md (bk)).
  bool split_aqk = false;
  // [records][C, C] bf16, with split_aqk: A_qk - aqk rounded again (aqk + aqk_lo carries ~16
  // bits; record_of). These two last, so that the other members' offsets stay those of the
  // kernels built without the pair.
  uint16_t* aqk_lo = nullptr;
  // With inverse_by_columns: each step's sum in one tf32 product instead of three (operands
  // split hi + lo, float32's precision). T is rounded to bfloat16 next, and o's error against
  // fp64 moves by under 1% in the rounding model, but where T is far from the identity (weak
  // gates, beta near 1) its bfloat16 entries round differently and o moves by ~2e-3 from the
  // three-product form (bench/NOTES.md (at)). Opt-in (FLASHDELTA_CHUNK_INVERSE=tf32; -1% of
  // the KDA prepare kernel, -3% of GDN's in (av)); not with split_aqk.
  bool inverse_one_product = false;
  // Without a vector gate and with dense bfloat16 q and k (the prepare kernel's key tiles),
  // qg and kg are q and k scaled by one number per token, so the record leaves them out: the
  // state kernel copies its chunk's rows of q and k as given into its stage (zeros past the
  // sequence's end and past K), and the factors move to per-token scales it applies,
  //     inv_q = n_q scale 2^Gamma       on the columns of o^T = S^T q^T (before + v_new^T A^T),
  //     inv_k = n_k 2^(Gamma_end - Gamma)  on the columns of v_new^T before the state update,
  // with A_qk's rows scaled by n_q scale in the record and o stored as it comes. 32 KB less written
  // and kept per record at K = 128.
  bool qk_from_tokens = false;
  // With dense bfloat16 v (dense_tokens) the record leaves u = T diag(beta) v out too: it keeps
  // T diag(beta) (tu, C x C), and the state kernel copies its block's tile of v's rows into
  // its stage and takes u^T = v^T tu^T itself (v^T for the linear write), a product off its
  // chain through the state. At K = V = 128 the prepare kernel reads 16 KB less (no v) and
  // writes 8 KB less a record, the state kernel reads 8 KB more; u stays float32. On an H100
  // the KDA forward -7%, Gated DeltaNet's -9% (bench/NOTES.md (bt)).
  // FLASHDELTA_CHUNK_RECORDS: `auto` takes both where they apply, `qk` the first alone, `full`
  // neither (qg, kg and u in the records).
  bool v_from_tokens = false;
  // A_qk in the record as float16 (aqk and, with split_aqk, aqk_lo) and the state kernel's
  // A_qk v_new on float16 operands: three more mantissa bits for two of the output's four
  // bfloat16-sized roundings (bench/NOTES.md (cc), the rounding model of the first row's
  // inputs before o's own rounding: 3.66e-3 -> 2.83e-3; with split_aqk 2.34e-3 -> 1.67e-3).
  // Its range is made safe twice:
  // - A_qk's rows take n_q and the attention scale in the prepare kernel (the state kernel
  //   applies the record's n_q to S^T q^T's columns before A_qk's term instead of to o), so
  //   with q and k L2-normalised and every log gate <= 0 (none, or activated in the kernel)
  //   |A_qk| <= |scale|, which the host bounds;
  // - each row of v_new^T (a value column of the tile) goes to float16 times a power of two
  //   that puts its largest magnitude in [2^14, 2^15), found per chunk by a quad reduction;
  //   o^T's row takes the same factor before the product and its inverse after, so the result
  //   is that of unscaled operands to float32 rounding for any finite v_new (f16_row_scales).
  // Both state products (wgmma, mma.sync) have it, as kernels of their own, at K <= 128.
  bool aqk_f16 = false;
};

// Whether the records keep T diag(beta) (ChunkParams::v_from_tokens with the delta rule): the
// workspace's region for it and the state kernel's shared memory (host side; the kernels test
// the two flags themselves, as they are).
inline bool records_keep_tu(const ChunkParams& c) {
  return c.v_from_tokens && c.p.delta;
}

// The three launches of a forward, in order on `stream` (a cudaStream_t); each returns
// without synchronising. The chunk table runs only with cu_seqlens (ws.chunk_start set).
void launch_chunk_table(const ChunkParams& c, void* stream);
void launch_chunk_prepare(const ChunkParams& c, void* stream);
void launch_chunk_state(const ChunkParams& c, void* stream);
// Whether the state kernel must run with one record stage on the current GPU. Its shared
// memory per block: 104 KB at K <= 64, 152 KB at K <= 128, 136 KB at K <= 256 (one stage);
// with split_aqk 120, 168 and 144 KB, or 95 KB with one stage at K <= 128 (A100s: true
// there); v_from_tokens with the delta rule adds 8 KB a stage (A100s at K <= 128: true).
// Throws Error(unsupported) where the GPU has less (99 KB per block); called before anything
// is launched.
bool chunk_state_one_stage_only(const ChunkParams& c);
// The three above at key width KP = 64, 128 or 256 (ChunkParams::KP), one width's kernels
// per file (cuda/chunk_prepare_k64.cu, _k128.cu, _k256.cu and cuda/chunk_state_k64.cu, ...;
// cuda/chunk_prepare.cpp and cuda/chunk_state.cpp dispatch).
template <int KP>
void launch_chunk_prepare_width(const ChunkParams& c, void* stream);
template <int KP>
void launch_chunk_state_width(const ChunkParams& c, void* stream);
template <int KP>
bool chunk_state_one_stage_only_width(const ChunkParams& c);

}  // namespace flashdelta::detail::cuda
