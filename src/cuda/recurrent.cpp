// Host side of the CUDA recurrent schedule: turns a validated problem into the kernel's
// plain-data arguments (cuda/recurrent_params.h) and picks the thread mapping.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda/cuda.h"
#include "cuda/host_params.h"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail {
namespace {

using cuda::RecurrentParams;
using cuda::StateTensor;

// Whether a state tensor allows the kernel's aligned vector runs: the run's axis is dense
// and every other stride and the base address are multiples of the run's load word.
bool allows_vectors(const StateTensor& s, bool key_contiguous, int64_t run, int64_t elem_bytes) {
  if (!s.data) return true;
  const int64_t word_bytes = run * elem_bytes < 16 ? run * elem_bytes : 16;
  const int64_t word = word_bytes / elem_bytes;
  const int64_t dense = key_contiguous ? s.key_stride : s.value_stride;
  const int64_t across = key_contiguous ? s.value_stride : s.key_stride;
  return dense == 1 && s.slot_stride % word == 0 && s.head_stride % word == 0 &&
         across % word == 0 && reinterpret_cast<uintptr_t>(s.data) % word_bytes == 0;
}

// Whether runs of 4 channels from element offset 4 i of every row are aligned vector loads
// (the warp kernel's token access): float32 or 16-bit, unit channel stride, the other
// strides multiples of 4 and the base aligned to a run.
bool allows_runs_of_4(const void* data, DType dtype, std::initializer_list<int64_t> strides,
                      int64_t channel_stride) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16) return false;
  for (const int64_t s : strides)
    if (s % 4 != 0) return false;
  return channel_stride == 1 && reinterpret_cast<uintptr_t>(data) % (4 * dtype_size(dtype)) == 0;
}
bool allows_runs_of_4(const cuda::TokenTensor& x) {
  return allows_runs_of_4(x.data, x.dtype, {x.stride[0], x.stride[1], x.stride[2]}, x.stride[3]);
}

// Whether the warp kernel takes the problem (see cuda/recurrent_warp_kernel.cu).
bool warp_kernel_fits(const RecurrentParams& r, bool key_contiguous) {
  const int64_t columns = cuda::recurrent_warp_columns(r.K, r.warp_keys);
  const bool vector_gate = r.gate == cuda::GateForm::vector;
  // The kernel addresses within a head's tile in 32 bits (strides may be negative).
  const auto tile_fits_32_bits = [&](const StateTensor& s) {
    return !s.data || (r.V - 1) * std::abs(s.value_stride) + r.K <= INT32_MAX;
  };
  return key_contiguous && columns > 0 && r.V % columns == 0 && r.vector_ok &&
         tile_fits_32_bits(r.state_in) && tile_fits_32_bits(r.state_out) &&
         allows_runs_of_4(r.q) && allows_runs_of_4(r.k) && allows_runs_of_4(r.v) &&
         allows_runs_of_4(r.o) && (!vector_gate || allows_runs_of_4(r.g)) &&
         (!vector_gate || !r.gate_in_kernel || !r.dt_bias ||
          allows_runs_of_4(r.dt_bias, r.dt_bias_dtype, {r.dt_bias_head_stride},
                           r.dt_bias_key_stride));
}

// Picks the vector path when both state tensors allow it, then the kernel, and launches.
void launch(RecurrentParams& r, DType state_dtype, bool key_contiguous, void* stream) {
  const int64_t elem = dtype_size(state_dtype);
  r.vector_ok = allows_vectors(r.state_in, key_contiguous, cuda::kStateRunLength, elem) &&
                allows_vectors(r.state_out, key_contiguous, cuda::kStateRunLength, elem);
  const auto tiles = [&](int64_t columns) { return (r.V + columns - 1) / columns; };
  const int sms = sm_count();
  const int64_t wide_blocks =
      r.N * r.HV * tiles(cuda::recurrent_block_columns(r.K, cuda::RecurrentTile::wide));
  // An unknown bandwidth (0) keeps the defaults measured before the distinction: fast.
  const double bandwidth = peak_memory_bandwidth();
  const bool fast_memory = bandwidth == 0 || bandwidth >= kFastMemoryBandwidth;
  r.warp_keys =
      cuda_recurrent_warp_keys(r.K, r.V, r.N * r.HV, state_dtype == DType::bf16, sms, fast_memory);
  const int64_t warp_columns = cuda::recurrent_warp_columns(r.K, r.warp_keys);
  const int64_t warp_tasks =
      warp_kernel_fits(r, key_contiguous) ? r.N * r.HV * (r.V / warp_columns) : 0;
  switch (cuda_recurrent_kernel(wide_blocks, sms, warp_tasks)) {
    case RecurrentKernel::warp:
      r.value_tiles = r.V / warp_columns;
      r.task_grid = cuda_recurrent_task_grid(r.N, r.HV);
      // used on the task grid; auto's measured case: a one-token step on a pool in place
      r.prefetch_eighths = cuda_recurrent_warp_prefetch_eighths(
          r.serving && r.T == 1 && !r.cu_seqlens.data, fast_memory);
      r.sms = sms;
      return cuda::launch_recurrent_warp(r, state_dtype, stream);
    case RecurrentKernel::narrow: r.tile = cuda::RecurrentTile::narrow; break;
    case RecurrentKernel::wide: r.tile = cuda::RecurrentTile::wide; break;
  }
  r.value_tiles = tiles(cuda::recurrent_block_columns(r.K, r.tile));
  r.task_grid = r.tile == cuda::RecurrentTile::narrow && cuda_recurrent_task_grid(r.N, r.HV);
  cuda::launch_recurrent(r, state_dtype, key_contiguous, stream);
}

}  // namespace

RecurrentKernel cuda_recurrent_kernel(int64_t wide_blocks, int sms, int64_t warp_tasks) {
  const std::string setting =
      env_setting("FLASHDELTA_RECURRENT_TILE", {"auto", "wide", "narrow", "warp"});
  if (setting == "wide") return RecurrentKernel::wide;
  if (setting == "narrow") return RecurrentKernel::narrow;
  if (warp_tasks > 0) return RecurrentKernel::warp;
  return wide_blocks < sms ? RecurrentKernel::narrow : RecurrentKernel::wide;
}

bool cuda_recurrent_task_grid(int64_t N, int64_t HV) {
  const std::string setting = env_setting("FLASHDELTA_RECURRENT_GRID", {"auto", "loop"});
  constexpr int64_t kGridYZ = 65535;
  return setting != "loop" && N <= kGridYZ && HV <= kGridYZ;  // unset reads as ""
}

int cuda_recurrent_warp_prefetch_eighths(bool one_token_in_place, bool fast_memory) {
  constexpr const char* kName = "FLASHDELTA_RECURRENT_WARP_PREFETCH";
  const char* env = std::getenv(kName);
  const std::string value = env ? env : "";
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (!value.empty() && value.size() <= 2 && std::all_of(value.begin(), value.end(), digit) &&
      std::stoi(value) <= 16)
    return std::stoi(value);  // a count of eighths
  constexpr std::pair<const char*, int> kNamed[] = {
      {"off", 0}, {"quarter", 2}, {"half", 4}, {"one", 8}, {"double", 16}};
  for (const auto& [named, eighths] : kNamed)
    if (value == named) return eighths;
  if (value.empty() || value == "auto") return one_token_in_place && fast_memory ? 4 : 0;
  throw Error(ErrorCode::invalid_argument,
              std::string("environment variable ") + kName +
                  ": expected auto, off, quarter, half, one, double or a count of eighths 0 .. 16, "
                  "got '" + value + "'");
}

int cuda_recurrent_warp_keys(int64_t K, int64_t V, int64_t pairs, bool bf16_state, int sms,
                             bool fast_memory) {
  const std::string setting = env_setting("FLASHDELTA_RECURRENT_WARP_KEYS", {"auto", "4", "8"});
  if (K >= 256) return 8;
  if (K != 128) return 4;
  if (setting == "4" || setting == "8") return setting == "8" ? 8 : 4;
  const int64_t slots = int64_t{12} * (sms > 0 ? sms : 1);  // 12 warps per SM at 8 keys
  const bool fill = V % 16 == 0 && pairs * (V / 16) >= kWarpWavesForEightKeys * slots;
  return fill && (bf16_state || !fast_memory) ? 8 : 4;
}

void cuda_recurrent_forward(const Problem& p, const ForwardIO& io, void* stream) {
  require_f32_state(io.initial_state.t, "initial_state");
  require_f32_state(io.final_state.t, "final_state");
  RecurrentParams r = problem_params(p);
  r.o = token_tensor(io.o);
  r.state_in = state_tensor(io.initial_state);
  r.state_out = state_tensor(io.final_state);
  launch(r, DType::f32, p.options.state_layout == StateLayout::v_first, stream);
}

void cuda_recurrent_decode(const DecodeProblem& d, const TensorView& o, void* stream) {
  RecurrentParams r = problem_params(d.p);
  r.o = token_tensor(o);
  r.serving = true;
  r.state_in = r.state_out = state_tensor(d.pool);
  r.pool_slots = d.pool.t.shape[0];
  r.state_indices = index_tensor(d.state_indices);
  r.num_accepted = index_tensor(d.num_accepted_tokens);
  r.per_token_slots = d.per_token_slots;
  launch(r, d.pool.t.dtype, d.p.options.state_layout == StateLayout::v_first, stream);
}

}  // namespace flashdelta::detail
