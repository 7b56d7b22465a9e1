// Host-side translation of validated problems (core/problem.h) into the CUDA kernels'
// plain-data arguments (cuda/recurrent_params.h), shared by the CUDA schedules.
#pragma once

#include <initializer_list>
#include <string>

#include "core/problem.h"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail {

cuda::TokenTensor token_tensor(const TensorView& t);
cuda::StateTensor state_tensor(const StateView& s);
cuda::IndexTensor index_tensor(const TensorView& t);
// Whether x is bfloat16 with unit channel stride, `channels` a multiple of 8, and every run
// of 8 channels from a multiple of 8 on 16-byte aligned, at any batch, token and head: the
// kernels then read it by TokenRuns<true> (cuda/device_io.cuh).
bool bf16_dense_runs(const cuda::TokenTensor& x, int64_t channels);
// Sizes, options, token inputs and cu_seqlens of a problem; outputs and states are set by
// the caller.
cuda::RecurrentParams problem_params(const Problem& p);
// Throws Error(unsupported) naming the argument unless the state tensor is float32.
void require_f32_state(const TensorView& s, const char* name);
// Throws Error(unsupported) unless the current device is sm_80 or later (tensor cores with
// bfloat16, cp.async); `what` names the schedule.
void require_sm80(const char* what);
// Throws Error(runtime) when the last kernel launch failed; `what` names the kernel.
void check_kernel_launch(const char* what);
// The value of environment variable `name` ("" when unset or empty), one of `allowed`; any
// other throws Error(invalid_argument) naming the variable, what it takes and what it got.
std::string env_setting(const char* name, std::initializer_list<const char*> allowed);
// Streaming multiprocessors of the current device (0 without one); cached per device, as
// the decode path asks on every call.
int sm_count();
// Peak DRAM bandwidth of the current device in bytes per second (read + write: twice the
// memory clock times the bus width), 0 without a device; cached per device like sm_count.
double peak_memory_bandwidth();

// Chunks of C tokens per row of T (a varlen batch's T is its total, and no sequence has more),
// and an upper bound of the chunks of all sequences: with cu_seqlens each sequence adds at
// most one partial chunk to T / C whole ones.
int64_t chunks_per_row(const Problem& p);
int64_t chunk_count_bound(const Problem& p);

// Throws Error(unsupported) naming q past 2^31 - 1 chunk records (chunks x value heads): the
// per-record kernels' grids. `what` names the schedule. Called before a workspace is sized,
// whose products it keeps far inside int64.
void check_chunk_records(const Problem& p, const char* what);

// How a sequential scan over at most `chunks` chunks per sequence is split (DESIGN.md section
// 3): `segments` runs of segment_chunks chunks (1: not split).
struct ScanSplit {
  int64_t segments = 1, segment_chunks = 0;
};
// The split of the scans over K x V states in blocks of 64 columns (both sides' scans in
// registers; K <= 128, else not split), for `scans` (sequence, value head) pairs, with the
// environment variable `setting` (one of auto, 1, 2, 3, 4, 8; unset or `auto`: the model)
// deciding. The model: the fewest chunk steps one after another, the segments' maps (V's and
// the identity's K columns, for every segment but one) in their waves of a segment's
// chunks, each map step `maps_step` of a scan step (a side's maps skip its outputs), a carry
// per earlier segment, then the scan in its waves; one block per SM and 128 SMs a wave (the
// same split on every GPU, so the same results); segments of 16 chunks at the least. A
// forced count is at most `chunks`. Throws Error(invalid_argument) naming the variable for
// any other value.
ScanSplit split_scan(const char* setting, int64_t scans, int64_t K, int64_t V, int64_t chunks,
                     double maps_step);

}  // namespace flashdelta::detail
