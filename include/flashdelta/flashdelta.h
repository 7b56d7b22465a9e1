// FlashDelta: the delta-rule family of linear attention, in one recurrence.
//
// Per sequence n and value head hv (key head h = hv / (HV / H)), with state S in R^{K x V}
// and tokens t = 1..T_n, every entry point computes
//
//   1. S <- Diag(exp(g_t)) S                 forget (no gate | scalar g_t | vector g_t over K)
//   2. delta:  r_t = beta_t (v_t - S^T k_t)  predict from the retained state, then correct
//              S <- S + k_t r_t^T
//      linear: S <- S + k_t v_t^T
//   3. o_t = S^T (scale * q_t)               read after the write
//
// after the optional fused input transforms of Options (q/k L2 norm, beta sigmoid, gate
// activation). The mechanism (Options::mechanism) fixes the gate kind and the write rule.
//
// Tensors (fla layout), all views with arbitrary element strides:
//   q, k     [B, T, H, K]      float32 | bfloat16 | float16 | float64
//   v, o     [B, T, HV, V]     HV a multiple of H (grouped value attention)
//   g        [B, T, HV, K] (vector gate) or [B, T, HV] (scalar gate), log space: a decay
//            exp(g) <= 1, so g <= 0 (the activated gate with gate_in_kernel). The CUDA chunk
//            schedule factors a chunk's decays through reference points and relies on it:
//            with g > 0 its results are undefined (never out of bounds); others take any g.
//   beta     [B, T, HV]        delta mechanisms only
//   state    [N, HV, K, V] (k_first) or [N, HV, V, K] (v_first), float32 (float64 on cpu)
//   cu_seqlens int32 | int64 [N + 1], only with B = 1: sequences packed along T
//              (N = B without it); a zero-length sequence passes its state through.
//   A_log    [HV]; dt_bias [HV, K] or [HV * K] (vector gate), [HV] (scalar gate)
//   chunk_states [C, HV, K, V] (k_first) or [C, HV, V, K] (v_first), any float dtype:
//              optional output, the state before tokens 0, 64, 128, ... of every
//              sequence (see ForwardArgs::chunk_states)
// K and V are 1..256; B, N and HV are at most 2^24. No two elements of an output (o,
// final_state, chunk_states, the gradients, a decode's state pool) may share an address:
// with its dimensions of size > 1 in order of |stride|, each stride must pass the elements
// the smaller ones span (every dense, permuted, padded or negative-stride view does; stride 0
// never). Outputs overlap no other tensor, input or output, except final_state aliasing
// initial_state exactly. Nothing is written unless every argument is valid; errors are
// thrown as flashdelta::Error with a message naming the argument.
//
// Devices: every tensor of a call lives on the device of q. On cuda (builds with CUDA) the
// recurrent and chunk schedules run, asynchronously on `stream`, and the host reads no
// tensor data: cu_seqlens, state_indices and num_accepted_tokens are checked for shape and
// dtype only, and the kernels treat an out-of-range value as a padding row (or clamp an
// offset) rather than access memory outside the tensors. The CUDA chunk schedule (sm_80 and
// later) uses 64-token chunks whatever Options::chunk_size says, multiplies bfloat16
// operands with float32 accumulation (float32 states) for every input dtype, and needs
// temporary memory (ForwardArgs::workspace). Its forward of long sequences over few heads may
// run part of its kernels on a second stream of the library's (one per host thread, device
// and `stream`), forked from `stream` and joined back to it before the call returns, so
// that work queued on `stream` afterwards, or captured with it into a CUDA graph, follows
// all of it (FLASHDELTA_CHUNK_PIECES=off keeps everything on `stream`).
#pragma once

#include "flashdelta/options.h"
#include "flashdelta/types.h"

namespace flashdelta {

// Tokens between consecutive entries of ForwardArgs::chunk_states: fla's chunk size, fixed
// whatever schedule or Options::chunk_size runs the forward.
inline constexpr int64_t kChunkStateTokens = 64;

// Entries of ForwardArgs::chunk_states that a sequence of `len` tokens records: one per
// chunk it starts (none when empty).
inline constexpr int64_t chunk_state_count(int64_t len) {
  return len > 0 ? (len + kChunkStateTokens - 1) / kChunkStateTokens : 0;
}

struct ForwardArgs {
  TensorView q, k, v;
  TensorView g;              // required for gated mechanisms, absent otherwise
  TensorView beta;           // required for delta mechanisms, absent otherwise
  TensorView initial_state;  // optional; zeros when absent
  TensorView cu_seqlens;     // optional
  TensorView A_log;          // optional, only with Options::gate_in_kernel
  TensorView dt_bias;        // optional, only with Options::gate_in_kernel
  TensorView o;              // output [B, T, HV, V], any float dtype
  TensorView final_state;    // optional output, same shape as the state; may alias
                             // initial_state exactly (in-place update)
  // Optional output: the state entering every 64-token chunk (kChunkStateTokens), i.e.
  // before tokens 0, 64, 128, ... of each sequence, so sequence n of length L_n has
  // ceil(L_n / 64) entries (none when empty), concatenated over the sequences in order:
  // [C, HV, K, V] (k_first) or [C, HV, V, K] (v_first) with C = sum_n ceil(L_n / 64).
  // Entry 0 of a sequence is its initial state. Any float dtype (fla returns bfloat16 for
  // bfloat16 inputs); it overlaps no other tensor. fla's `h` of return_intermediate_states
  // ([B, NT, HV, K, V], NT = ceil(T / 64), or [1, C, ...] with cu_seqlens) is this tensor
  // viewed as [B * NT, HV, K, V]. With device-resident cu_seqlens the host cannot count
  // the chunks: C is then only checked against its range, and entries past C are not
  // written. Not recorded by the CUDA recurrent schedule (an error).
  TensorView chunk_states;
  void* stream = nullptr;    // cudaStream_t for CUDA tensors (nullptr = default stream)
  // Optional temporary device memory for the CUDA chunk schedule, on q's device, aligned to
  // 256 bytes and at least forward_workspace_bytes(...) long; used in stream order on
  // `stream`. Without it the schedule takes (and returns) its memory through the
  // stream-ordered allocator (cudaMallocAsync) of `stream`.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of workspace forward(args, options, schedule) uses: 0 for the CPU schedules and the
// CUDA recurrent one. Validates args as forward does (throws Error), reads no tensor data.
size_t forward_workspace_bytes(const ForwardArgs& args, const Options& options,
                               Schedule schedule = Schedule::chunk);

// Runs the recurrence with the chosen schedule. All schedules compute the same function;
// Schedule::reference runs the fp64 scalar recurrence in place of any fast path.
void forward(const ForwardArgs& args, const Options& options,
             Schedule schedule = Schedule::chunk);

// Stateful serving (decode and speculative multi-token steps) over a state pool.
//   q, k [N, T, H, K], v, o [N, T, HV, V], g, beta as in forward (or B = 1 with
//   cu_seqlens for sequences of different lengths, each at most the slot count).
//   state_pool  [P, HV, K, V] (or V-first) float32 (bfloat16 opt-in), updated in place.
//   state_indices int32 | int64:
//     [N]:     row n reads slot s = state_indices[n] and writes its final state back to s.
//     [N, S]:  per-token slots: row n starts from slot state_indices[n, a_n - 1], with
//              a_n = num_accepted_tokens[n] (1 when absent), and after its token t writes
//              the state to slot state_indices[n, t] (if >= 0). S >= tokens per row.
//   A start slot of -1 marks a padding row: it is skipped and its outputs are zeros.
//   Slots written by different rows must differ, and no row may start from a slot another
//   row writes (checked for cpu indices; on cuda the host cannot read them, and such a call
//   gives timing-dependent states).
struct DecodeArgs {
  TensorView q, k, v, g, beta;
  TensorView cu_seqlens;           // optional
  TensorView A_log, dt_bias;       // optional, only with Options::gate_in_kernel
  TensorView state_pool;
  TensorView state_indices;
  TensorView num_accepted_tokens;  // optional, only with [N, S] state_indices
  TensorView o;
  void* stream = nullptr;          // cudaStream_t for CUDA tensors (nullptr = default stream)
};

void decode(const DecodeArgs& args, const Options& options,
            Schedule schedule = Schedule::recurrent);

// Gradients of the forward's outputs (o and final state) with respect to every input.
// Inputs as in ForwardArgs, plus d_o [B, T, HV, V] and optional d_final_state. Each
// gradient output is optional (absent = not wanted) and has its input's shape:
// dq, dk, dv with respect to the raw q, k, v (through the L2 norm); dg with respect to the
// raw gate (through the activation); dbeta with respect to the raw beta (through the
// sigmoid); d_initial_state, dA_log, ddt_bias. Gradient dtypes are any float dtype; states
// and their gradients any float dtype too.
// Schedules: Schedule::reference on the CPU (the default); Schedule::chunk on CUDA (sm_80
// and later, ~102 KB of shared memory per block), which recomputes the forward's per-chunk
// states instead of keeping them, multiplies on the tensor cores with tf32 operands and
// float32 sums, and runs in passes over slices of whole key-head groups, as few as keep its
// workspace within three times the float32 size of q, k, v and g (one group per pass where
// a single group needs more: few heads with small K and V). Deterministic: no
// floating-point atomics, so the gradients are bitwise identical from run to run (unless a
// malformed device cu_seqlens makes sequences overlap: their gradients are then undefined,
// though nothing outside the tensors is ever accessed).
struct BackwardArgs {
  TensorView q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias;
  TensorView d_o;
  TensorView d_final_state;  // optional
  TensorView dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias;
  // Optional input, the opt-in to keep the forward's states: the state entering every
  // 64-token chunk as ForwardArgs::chunk_states records it (same shape and layout, any
  // float dtype; float32 keeps the backward's precision). Given, the backward reads these
  // states instead of recomputing them: the CUDA chunk backward skips its sequential
  // states pass, the reference starts every 64-token segment from its entry. The gradients
  // are then those of a forward that enters each chunk with these states (from the same
  // forward, the same gradients up to the states' rounding). No gradient output may
  // overlap it. With device-resident cu_seqlens C is only checked against its range: the
  // CUDA backward reads entries at or past C as zeros (no error), so pass at least the true
  // count (the upper bound T / 64 + min(N, T) is always enough).
  TensorView chunk_states;
  void* stream = nullptr;  // cudaStream_t for CUDA tensors (nullptr = default stream)
  // Optional temporary device memory for the CUDA chunk backward, as ForwardArgs::workspace
  // (at least backward_workspace_bytes(...) long, 256-byte aligned).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of workspace backward(args, options, schedule) uses: 0 on the CPU. Validates args
// as backward does (throws Error), reads no tensor data.
size_t backward_workspace_bytes(const BackwardArgs& args, const Options& options,
                                Schedule schedule = Schedule::reference);

void backward(const BackwardArgs& args, const Options& options,
              Schedule schedule = Schedule::reference);

// Library version and the SIMD target the CPU schedules dispatch to on this machine.
const char* version();
const char* cpu_simd_target();

}  // namespace flashdelta
