// The CUDA schedules, compiled when the build finds a CUDA compiler (FLASHDELTA_WITH_CUDA).
// Each takes a validated problem whose tensors all live on the GPU, launches on the caller's
// stream and returns without synchronising.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/problem.h"
#include "reference/reference.h"

namespace flashdelta::detail {

void cuda_recurrent_forward(const Problem& p, const ForwardIO& io, void* stream);
void cuda_recurrent_decode(const DecodeProblem& d, const TensorView& o, void* stream);
// The recurrent schedule's kernels: the block kernel's wide and narrow tiles
// (cuda/recurrent_tile.cuh) and the warp kernel (cuda/recurrent_warp_kernel.cu), which
// takes only V-first states, K in {32, 64, 128, 256} and V a multiple of its task width.
enum class RecurrentKernel { wide, narrow, warp };
// The kernel for a problem whose wide tile makes `wide_blocks` blocks on a GPU of `sms` SMs
// and that makes `warp_tasks` warp kernel tasks (0: the warp kernel does not take it). The
// environment variable FLASHDELTA_RECURRENT_TILE picks: unset or `auto`, the warp kernel
// wherever it takes the problem, else the narrow tile when the wide tile leaves SMs
// without a block, else the wide one; `wide` or `narrow`, that kernel (the same sums in
// another order: equal to float32 rounding); `warp` is `auto`'s choice, kept as a name.
// Any other value throws Error(invalid_argument) naming the variable.
RecurrentKernel cuda_recurrent_kernel(int64_t wide_blocks, int sms, int64_t warp_tasks);
// Whether the recurrent kernels that have one (the warp kernel; the block kernel's narrow
// tile where it differs from the wide one, 32 < K <= 128; the wide tile always loops) take
// the task grid (value tiles, HV, N), each block's index its task, for N sequences of HV
// value heads: where both fit a grid dimension (65,535) and FLASHDELTA_RECURRENT_GRID is
// unset or `auto`; `loop` takes the grid-stride loop over task numbers that larger problems
// run (the same tasks: bitwise equal). Any other value throws Error(invalid_argument) naming
// the variable.
bool cuda_recurrent_task_grid(int64_t N, int64_t HV);
// The decode defaults below differ by memory system, told apart by the device's peak DRAM
// bandwidth (peak_memory_bandwidth): `fast_memory` at kFastMemoryBandwidth or more. Measured
// on two GPUs (bench/NOTES.md (br)): the H200 (4.8 TB/s, fast) and the H100 (3.35 TB/s).
inline constexpr double kFastMemoryBandwidth = 4e12;
// Keys per lane of the warp kernel for head size K, V value columns, `pairs` (sequence,
// value head) pairs and a float32 or bfloat16 (`bf16_state`) state on `sms` SMs: 8 at
// K = 256, 4 below K = 128. At K = 128, 8 (16-column tasks, the K = 256 kernel's lane shape,
// 12 warps per SM instead of 24) where the 16-column tasks fill at least
// kWarpWavesForEightKeys waves and the state is bfloat16 (a 4-key task's 2 KB of state leave
// its per-task work uncovered: 5% faster at N = 256, bench/NOTES.md (ak)) or the memory is not
// fast (float32 states on the H100: N = 256 V-first -4.6 to -6% with no prefetch blocks, (br);
// on the H200 the 8-key form was 1.5% slower without prefetch blocks, (ak)); else 4.
// FLASHDELTA_RECURRENT_WARP_KEYS=4 or 8 forces K = 128's; unset or `auto`: as described. Any
// other value throws Error(invalid_argument) naming the variable.
int cuda_recurrent_warp_keys(int64_t K, int64_t V, int64_t pairs, bool bf16_state, int sms,
                             bool fast_memory);
inline constexpr int64_t kWarpWavesForEightKeys = 8;
// How far ahead, in eighths of a resident wave, the warp kernel's prefetch blocks (on the
// task grid, one per row and value head after that head's value tiles; bfloat16 tokens)
// queue the same head's state of a later row into L2, so that a block's first loads find its
// state in L2 while a finished block's slot is refilled: FLASHDELTA_RECURRENT_WARP_PREFETCH
// `off` 0, `quarter` 2, `half` 4, `one` 8, `double` 16, or a count of eighths 0 .. 16, for
// every warp-kernel step, serving or forward. Unset or `auto`: half a wave (4) for a one-token
// step on a pool in place (`one_token_in_place`) on fast memory, where it measured -1.4 to
// -2.2% at N = 256 V-first (bench/NOTES.md (ar), (bp)); else 0 (on the H100 every distance
// past one row lost, half a wave +4.6% with 4-key and +5-6% with 8-key tasks: (bo), (br); out
// of place +3.5%, four per-token slots per row +5%, a whole wave ahead +10%: (ar)).
// The same results whatever the setting: a prefetch is a hint. Any other value throws
// Error(invalid_argument) naming the variable.
int cuda_recurrent_warp_prefetch_eighths(bool one_token_in_place, bool fast_memory);
// The chunkwise forward (prefill); needs sm_80 or later. With workspace (or workspace_bytes)
// set it runs in that memory, checked first against cuda_chunk_workspace_bytes; otherwise it
// allocates in stream order.
void cuda_chunk_forward(const Problem& p, const ForwardIO& io, void* stream, void* workspace,
                        size_t workspace_bytes);
// Bytes of workspace the chunkwise forward of p needs (host arithmetic only).
int64_t cuda_chunk_workspace_bytes(const Problem& p);
// Segments the forward's state kernel splits each sequence of `chunks` chunks into (K <= 128;
// 1 otherwise), for `scans` (sequence, value head) pairs of V columns: split_scan
// (cuda/host_params.h) under FLASHDELTA_CHUNK_STATE_SEGMENTS.
int64_t cuda_chunk_state_segments(int64_t scans, int64_t K, int64_t V, int64_t chunks);
// Chunks of each piece, first to last, that the forward splits sequences of `chunks` chunks
// into for `scans` (sequence, value head) pairs of V columns: one piece, or several whose
// state kernels run beside the next piece's prepare kernel (the model in
// cuda/chunk_pieces.cpp).
// FLASHDELTA_CHUNK_PIECES: unset or `auto` the model; `off` one piece; 1, 2, 3, 4 or 8
// that many (at most `chunks`). Any other value throws Error(invalid_argument) naming the
// variable. The forward takes one piece with cu_seqlens, recorded chunk states or where the
// state kernel splits sequences into segments (cuda_chunk_state_segments above 1, e.g.
// B=1 T=32768 H=16), whatever this says.
std::vector<int64_t> cuda_chunk_pieces(int64_t scans, int64_t V, int64_t chunks);
// The chunkwise backward (sm_80 or later); allocates its float32 workspace in stream order
// (cuda_chunk_backward_workspace_bytes of it).
void cuda_chunk_backward(const Problem& p, const BackwardArgs& args);
// `kept`: the caller gives the forward's chunk states (BackwardArgs::chunk_states).
int64_t cuda_chunk_backward_workspace_bytes(const Problem& p, bool kept);
// Whether the backward stores the chunk states and their gradients (the `keys` stage's
// operands, nothing else's) in bfloat16: for 16-bit q, k and v (bench/model/
// backward_rounding.py: dg within 3.8e-3 of the largest, fla's own 5.8e-3) unless the forward's
// states are kept (the states pass reads its own float32 copy back) or
// FLASHDELTA_BACKWARD_STATES is `f32` (unset, empty or `auto`: by the rule). Any other value
// throws Error(invalid_argument) naming the variable.
bool backward_bf16_states(const Problem& p, bool kept);
// Value columns per block of the backward's sequential scans, for `scans` (sequence, value
// head) pairs of V columns on a GPU of `sms` SMs. The environment variable
// FLASHDELTA_BACKWARD_SCAN_COLUMNS picks: unset or `auto`, the widest of 32, 16 and 8 whose
// blocks give every SM one (else 8); 32, 16 or 8, that width (the same gradients bit for bit).
// Throws Error(invalid_argument) naming the variable for any other value.
int cuda_backward_scan_columns(int64_t scans, int64_t V, int sms);
// Whether the backward's two sequential scans run with the state in tensor-core registers
// (cuda/backward_scans_mma.cu) rather than as tile scans (cuda/backward_scan.cu): where
// K <= 128 unless FLASHDELTA_BACKWARD_SCANS is `tiles` (unset, empty or `mma`: the
// registers). Any other value throws Error(invalid_argument) naming the variable.
bool cuda_backward_scans_mma(int64_t K);
// Value columns per block of the scans in registers (cuda::BackwardParams::mma_cols) for
// `scans` (sequence, value head) pairs of V columns split into `segments` each, on a GPU of
// `sms` SMs; `wide_fits`: the GPU offers the 128-column blocks' shared memory (215 KB at
// K = 128). 64 where !wide_fits; otherwise FLASHDELTA_BACKWARD_MMA_COLUMNS `64` or `128`
// picks, and unset, empty or `auto` takes 128 where V > 64 and the scan's 64-column blocks
// (scans x segments x tiles) would be more than one per SM (the same gradients bit for bit
// either way). Any other value throws Error(invalid_argument) naming the variable.
int cuda_backward_mma_columns(int64_t scans, int64_t V, int64_t segments, int sms,
                              bool wide_fits);
// Whether the backward's per-chunk stages take a scalar gate's short form (one decay per
// token pair, no per-channel tables; cuda/backward_chunk.cu): for GateKind::scalar unless
// FLASHDELTA_BACKWARD_GATE_PAIRS is `general` (unset, empty or `auto`: by the gate), which
// runs the vector gate's form for every gate. Any other value throws Error(invalid_argument)
// naming the variable.
bool cuda_backward_scalar_pairs(GateKind gate);
namespace cuda {
enum class KeysProducts : int;  // cuda/backward_params.h
}
// The operands of the backward's `keys` products where its states are bfloat16
// (backward_bf16_states; cuda::KeysProducts): FLASHDELTA_BACKWARD_KEYS `tf32` (unset, empty or
// `auto`), `mixed` or `bf16` (opt-in: 2-5% slower than tf32 on an H100, bench/NOTES.md (ba)).
// Any other value throws Error(invalid_argument) naming the variable.
cuda::KeysProducts cuda_backward_keys_products();
// Whether grads' first products take bfloat16 operands where the backward's states are
// bfloat16 (cuda::BackwardParams::joint_bf16): FLASHDELTA_BACKWARD_JOINT `tf32` (unset, empty or
// `auto`) or `bf16` (opt-in: within 2% of tf32 on an H100, bench/NOTES.md (ba)). Any other
// value throws Error(invalid_argument) naming the variable.
bool cuda_backward_joint_bf16();
// Where grads finishes the gradients it can in their dtypes (cuda::BackwardParams::
// gate_in_grads, rows_in_grads), leaving the outputs stage the rest: FLASHDELTA_BACKWARD_FINISH
// `auto` (unset or empty; where measured faster, cuda_backward_split), `grads` (wherever it
// can) or `outputs` (nowhere: the outputs stage finishes every gradient). Any other value
// throws Error(invalid_argument) naming the variable.
enum class BackwardFinish { automatic, grads, outputs };
BackwardFinish cuda_backward_finish();
// What grads finishes for p (cuda::BackwardParams). Nothing with cu_seqlens (a device-side
// table may leave token rows that only the outputs stage's pass over every row reaches).
// Where it can (`grads`): a scalar gate's gradient in its short form
// (cuda_backward_scalar_pairs; a vector gate's stays the outputs stage's), and dq, dk, dv and
// d beta where each key head has one value head. `auto` takes that only for a scalar gate's
// short form: for Gated DeltaNet it saved 0.35 ms of kernels a B8 step on an H100, while for
// KDA, finishing the vector gate in each key slice (since removed) and the rows in a tail
// lengthened grads by 1.4 ms against the outputs stage's 0.9 (bench/NOTES.md (bw)); the
// rows alone for KDA measured even (9.765 against 9.731 ms, bench/NOTES.md (bx)).
struct CudaBackwardSplit {
  bool gate = false, rows = false;
};
CudaBackwardSplit cuda_backward_split(const Problem& p);
// Segments each sequence of `chunks` chunks is split into by the scans in registers
// (K <= 128; 1 otherwise), for `scans` (sequence, value head) pairs of V columns:
// split_scan (cuda/host_params.h: a device-independent model unless forced) under
// FLASHDELTA_BACKWARD_SCAN_SEGMENTS.
int64_t cuda_backward_scan_segments(int64_t scans, int64_t K, int64_t V, int64_t chunks);

}  // namespace flashdelta::detail
