// Arguments of the CUDA chunkwise backward (bench/NOTES.md (h), bench/model/chunk_backward.py):
// the problem as the forward kernels see it, the gradients in and out, and the float32
// workspace that carries each stage's tiles to the next. Every product runs on the tensor
// cores with tf32 operands and float32 sums (staged_product, cuda/backward_common.cuh; the
// pairwise decay terms by 16-row blocks, cuda/backward_blocks.cuh); intermediates stay
// float32, but for 16-bit inputs the chunk states and their gradients, which `keys` alone
// reads, are stored in bfloat16 (BackwardParams::bf16_states). The host runs the stages over
// slices of the heads when one pass would need too much workspace (cuda/backward.cpp).
//
// Stages, in order on one stream (cuda/backward.cpp):
//   inputs    per token: q, k normalised and scaled, the activated gate, beta (float32)
//   records   per (chunk, value head), in parallel: Gamma, q/k gate factors, A_qk, A_kk,
//             T = (I + A_kk)^-1, w = T (beta k e^Gamma), u = T (beta v)
//   states    per (sequence, value head, tile of scan_cols columns), chunks in order: the
//             state entering every chunk and v_new = u - w S; with the forward's states kept
//             (BackwardArgs::chunk_states) per (chunk, value head) in parallel, the given
//             state and v_new
//   dstates   the same, chunks in reverse: the state gradient leaving every chunk and dv_new
// With scans_mma (K <= 128) the two scans run per (sequence, value head, mma_cols columns)
// with the state in tensor-core accumulators (cuda/backward_scans_mma.cu); when those blocks
// are too few to fill the GPU, per segment of each sequence too, after a pass that gives every
// segment's affine map (segment_maps).
//   keys      per (chunk, value head, 64-key tile), in parallel: the key gradients' products
//             over V and d Gamma_end, each gradient written once (cuda/backward_keys.cu)
//   grads     per (chunk, value head), in parallel: everything else (notes (h)), and where
//             it can the gradients finished in their dtypes (gate_in_grads, rows_in_grads)
//   outputs   per token, what grads did not finish: GVA sums, the transforms' derivatives,
//             the gradients in their dtypes
//   params    dA_log and ddt_bias, summed over tokens in a fixed order
// No atomics anywhere: every float is written by one thread in a fixed order, so the
// gradients are bitwise identical from run to run.
#pragma once

#include <cstdint>

#include "cuda/chunk_params.h"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {

// A rank-1 or rank-2 per-head parameter (A_log [HV], dt_bias [HV, W] or [HV * W]) or its
// gradient: element (hv, i) at hv * head_stride + i * key_stride.
struct HeadParam {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t head_stride = 0, key_stride = 0;
};

// Buffers are float32 and dense. Token rows are r = batch * T + t; "per value head" arrays
// are [B * T, HV, width], "per key head" [B * T, H, K]. Records (chunk * HV + hv) hold
// C x C tiles, K-vectors, K x V states, or C rows of width K or V ("per record row": row i
// of the chunk, contiguous, so that a chunk's slab is one block of memory).
struct BackwardWorkspace {
  int64_t* chunk_start = nullptr;  // [N + 1], cu_seqlens only
  float *qn = nullptr, *kn = nullptr;      // per key head: scale q / |q|, k / |k| (or as given)
  float *gate = nullptr, *beta = nullptr;  // per value head: log gate (K wide), beta
  float* dout = nullptr;                   // per value head: d_o in float32
  // Per record row, K wide.
  float *gamma = nullptr, *qg = nullptr, *kg = nullptr, *kb = nullptr, *w = nullptr, *dw = nullptr;
  float *vb = nullptr, *u = nullptr, *vn = nullptr, *dvn = nullptr;  // per record row, V wide
  float *aqk = nullptr, *tm = nullptr, *kdot = nullptr;  // per record, C x C
  float* decay = nullptr;                                // per record, K
  float* dgamma = nullptr;  // per record, K: d Gamma_end, from `keys` to `grads`
  // Per record, K x V (K-first): the state entering each chunk and the gradient of the state
  // leaving it, written by the scans for `keys` alone. In bfloat16 (states16, dstates16) where
  // BackwardParams::bf16_states, else float32 (states, dstates); the other pair is null.
  float *states = nullptr, *dstates = nullptr;
  uint16_t *states16 = nullptr, *dstates16 = nullptr;
  // Per (sequence, value head, segment) of split scans, K x (V + K), K-first: the segment's
  // response to a zero state (V columns) and to each unit state (K columns).
  float* segment_maps = nullptr;
  // Gradients of the transformed inputs, per value head; dv holds d(beta v) and dbeta every
  // term but sum_j d(beta v)_j v_j, which the outputs stage adds with beta's factor on dv.
  float *dq = nullptr, *dk = nullptr, *dg = nullptr, *dv = nullptr, *dbeta = nullptr;
  float* dA_log_part = nullptr;  // per value head and token
};

// Keys per block of the `keys` stage.
inline constexpr int kKeysTile = 64;

// The operands of the `keys` stage's three products over V (cuda/backward_keys.cu), A1 = dO S^T,
// A2 = v_new dS^T and A3 = dv_new S^T, where the states are bfloat16 (bf16_states; float32
// states always take tf32):
//   tf32   all three m16n8k8 on tf32 operands (dO, v_new, dv_new rounded to tf32);
//   mixed  A1 and A3 m16n8k16 on bfloat16 operands (dO exact for bfloat16 gradients in,
//          dv_new rounded), A2 in tf32 as above;
//   bf16   all three on bfloat16 operands.
// bench/model/backward_rounding.py (bench/results/backward-rounding-model-2026-12-05b.txt,
// float32 outputs, training inputs): mixed leaves every gradient's error as tf32's to two
// digits; bf16 moves dk 1.3e-3 -> 2.1e-3 and dg 1.7e-3 -> 3.1e-3 (fla: 3.6e-3, 5.8e-3).
enum class KeysProducts : int { tf32, mixed, bf16 };

// Value columns per block of the sequential scans, widest first (BackwardParams::scan_cols).
inline constexpr int kScanColumnWidths[] = {32, 16, 8};

struct BackwardParams {
  RecurrentParams p;  // sizes, options, q k v g beta, A_log, dt_bias, cu_seqlens, state_in
  int scan_cols = kScanColumnWidths[0];  // one of kScanColumnWidths (backward_scan_columns)
  bool scans_mma = false;                // the scans in registers (K <= 128)
  // Value columns per block of the scans in registers: 64 (8 warps), or 128 (16 warps) where
  // 64-column blocks would take more than one wave (the segments' maps: 64 either way).
  int mma_cols = 64;
  // The scans in registers split each sequence into `segments` runs of segment_chunks chunks
  // (1: not split; cuda/backward_scans_mma.cu).
  int64_t segments = 1, segment_chunks = 0;
  // With split states and dstates scans: the dstates scan carries by the transpose of the
  // states scan's maps (a chunk moves the state by A = diag(decay) - kg^T w and its gradient
  // by A^T, so a segment's gradient map is P^T), and its own maps form only their e. Not
  // with kept states: no states scan then.
  bool transposed_maps = false;
  DType state_in_dtype = DType::f32;
  // The scans store S and dS' for `keys` in bfloat16 (backward_bf16_states, cuda/cuda.h):
  // `keys` reads them as its products' operands only, and half the bytes move.
  bool bf16_states = false;
  // A scalar gate's records and grads in their short form (cuda_backward_scalar_pairs), whose
  // grads sums d Gamma over the channels: ws.dg then holds a row's whole in channel 0.
  bool scalar_pairs = false;
  // gate_in_grads: grads finishes a scalar gate's gradient in its short form (dg in its dtype,
  // ws.dg's float32 copy for ddt_bias, ws.dA_log_part), and the outputs stage leaves it;
  // rows_in_grads: dq, dk, dv and d beta too (the outputs stage skips the key rows and the
  // value rows' dv and d beta). Where, cuda_backward_split (cuda/cuda.h).
  bool gate_in_grads = false, rows_in_grads = false;
  // The `keys` stage's products (cuda_backward_keys_products; tf32 unless bf16_states).
  KeysProducts keys_products = KeysProducts::tf32;
  // grads' first products (d A_qk = dO v_new^T and, with the delta rule, d(beta v) v_new^T
  // for d A_kk) on bfloat16 operands (cuda_backward_joint_bf16; never without bf16_states).
  // bench/model/backward_rounding.py's joint_ops (bench/results/
  // backward-rounding-model-2026-12-06.txt, training inputs): dg 2.9e-3 -> 3.3e-3, dq
  // 2.7e-3 -> 2.9e-3, the other gradients as with tf32 (fla: dg 5.8e-3, dq 4.5e-3).
  bool joint_bf16 = false;
  int64_t B = 0, H = 0;
  int64_t chunks_per_row = 0, max_chunks = 0;
  TokenTensor d_o;
  StateTensor d_final;
  DType d_final_dtype = DType::f32;
  // BackwardArgs::chunk_states (data == nullptr: recompute the states): the state entering
  // chunk c (the chunk table's numbering) at entry c; entries at or past chunk_states_count
  // (a malformed device table's) read as zeros.
  StateTensor chunk_states;
  DType chunk_states_dtype = DType::f32;
  int64_t chunk_states_count = 0;
  // Outputs; data == nullptr means not wanted.
  TokenTensor dq, dk, dv, dg, dbeta;
  StateTensor d_initial;
  DType d_initial_dtype = DType::f32;
  HeadParam dA_log, ddt_bias;
  BackwardWorkspace ws;
};

// Dynamic shared memory per block of the per-chunk and the scan kernels (the host checks the
// device offers it before launching anything).
int64_t backward_chunk_shared_bytes();
int64_t backward_scan_shared_bytes();
int64_t backward_scans_mma_shared_bytes(int64_t K, int cols);  // K <= 128, cols 64 or 128
int64_t backward_keys_shared_bytes();

void launch_backward_inputs(const BackwardParams& b, void* stream);
void launch_backward_records(const BackwardParams& b, void* stream);
void launch_backward_states(const BackwardParams& b, void* stream);
void launch_backward_given_states(const BackwardParams& b, void* stream);
void launch_backward_dstates(const BackwardParams& b, void* stream);
void launch_backward_states_mma(const BackwardParams& b, void* stream);
void launch_backward_dstates_mma(const BackwardParams& b, void* stream);
void launch_backward_keys(const BackwardParams& b, void* stream);
void launch_backward_grads(const BackwardParams& b, void* stream);
void launch_backward_outputs(const BackwardParams& b, void* stream);
void launch_backward_params(const BackwardParams& b, void* stream);

}  // namespace flashdelta::detail::cuda
