// Host side of the CUDA recurrent schedule: turns a validated problem into the kernel's
// plain-data arguments (cuda/recurrent_params.h) and picks the thread mapping.
#include <cstdint>
#include <string>

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

// Picks the tile, and the vector path when both state tensors allow it, then launches.
void launch(RecurrentParams& r, DType state_dtype, bool key_contiguous, void* stream) {
  const auto tiles = [&](cuda::RecurrentTile t) {
    const int64_t vt = cuda::recurrent_block_columns(r.K, t);
    return (r.V + vt - 1) / vt;
  };
  r.value_tiles = tiles(cuda::RecurrentTile::wide);
  if (cuda_recurrent_narrow_tile(r.N * r.HV * r.value_tiles, sm_count())) {
    r.tile = cuda::RecurrentTile::narrow;
    r.value_tiles = tiles(r.tile);
  }
  const int64_t elem = dtype_size(state_dtype);
  r.vector_ok = allows_vectors(r.state_in, key_contiguous, cuda::kStateRunLength, elem) &&
                allows_vectors(r.state_out, key_contiguous, cuda::kStateRunLength, elem);
  cuda::launch_recurrent(r, state_dtype, key_contiguous, stream);
}

}  // namespace

bool cuda_recurrent_narrow_tile(int64_t wide_blocks, int sms) {
  const std::string setting = env_setting("FLASHDELTA_RECURRENT_TILE", {"auto", "wide", "narrow"});
  if (setting.empty() || setting == "auto") return wide_blocks < sms;
  return setting == "narrow";
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
