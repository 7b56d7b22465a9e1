// Host side of the CUDA recurrent schedule: turns a validated problem into the kernel's
// plain-data arguments (cuda/recurrent_params.h) and picks the thread mapping.
#include <cstdint>
#include <string>

#include "cuda/cuda.h"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail {
namespace {

using cuda::IndexTensor;
using cuda::RecurrentParams;
using cuda::StateTensor;
using cuda::TokenTensor;

TokenTensor token_tensor(const TensorView& t) {
  TokenTensor x;
  if (!t.present()) return x;
  x.data = t.data;
  x.dtype = t.dtype;
  for (int i = 0; i < t.rank && i < 4; ++i) x.stride[i] = t.stride[i];
  return x;
}

StateTensor state_tensor(const StateView& s) {
  StateTensor x;
  if (!s.t.present()) return x;
  x.data = s.t.data;
  x.slot_stride = s.t.stride[0];
  x.head_stride = s.t.stride[1];
  x.key_stride = s.key_step();
  x.value_stride = s.value_step();
  return x;
}

IndexTensor index_tensor(const TensorView& t) {
  IndexTensor x;
  if (!t.present()) return x;
  x.data = t.data;
  x.is_i64 = t.dtype == DType::i64;
  x.stride[0] = t.stride[0];
  x.stride[1] = t.rank == 2 ? t.stride[1] : 0;
  x.cols = t.rank == 2 ? t.shape[1] : 1;
  return x;
}

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

RecurrentParams problem_params(const Problem& p) {
  RecurrentParams r;
  const TokenViews& in = p.in;
  r.N = p.N;
  r.T = p.T;
  r.HV = p.HV;
  r.group = p.group;
  r.K = p.K;
  r.V = p.V;
  const int64_t vt = cuda::recurrent_block_columns(p.K);
  r.value_tiles = (p.V + vt - 1) / vt;
  r.gate = p.gate == GateKind::vector   ? cuda::GateForm::vector
           : p.gate == GateKind::scalar ? cuda::GateForm::scalar
                                        : cuda::GateForm::none;
  r.delta = p.delta;
  r.scale = static_cast<float>(p.scale);
  const Options& o = p.options;
  r.qk_l2norm = o.qk_l2norm;
  r.beta_sigmoid = o.beta_sigmoid;
  r.beta_factor = o.allow_neg_eigval ? 2.f : 1.f;
  r.gate_in_kernel = o.gate_in_kernel;
  r.has_lower_bound = o.lower_bound.has_value();
  r.lower_bound = o.lower_bound ? static_cast<float>(*o.lower_bound) : 0.f;
  r.q = token_tensor(in.q);
  r.k = token_tensor(in.k);
  r.v = token_tensor(in.v);
  r.g = token_tensor(in.g);
  r.beta = token_tensor(in.beta);
  r.cu_seqlens = index_tensor(p.cu_seqlens);  // device-resident: read by the kernel
  if (o.gate_in_kernel && in.A_log.present()) {
    r.A_log = in.A_log.data;
    r.A_log_dtype = in.A_log.dtype;
    r.A_log_stride = in.A_log.stride[0];
  }
  if (o.gate_in_kernel && in.dt_bias.present()) {
    const TensorView& b = in.dt_bias;
    r.dt_bias = b.data;
    r.dt_bias_dtype = b.dtype;
    const int64_t per_head = p.gate == GateKind::vector ? p.K : 1;
    r.dt_bias_head_stride = b.rank == 2 ? b.stride[0] : per_head * b.stride[0];
    r.dt_bias_key_stride = b.rank == 2 ? b.stride[1] : b.stride[0];
  }
  return r;
}

// Picks the vector path when both state tensors allow it, then launches.
void launch(RecurrentParams& r, DType state_dtype, bool key_contiguous, void* stream) {
  const int64_t elem = dtype_size(state_dtype);
  r.vector_ok = allows_vectors(r.state_in, key_contiguous, cuda::kStateRunLength, elem) &&
                allows_vectors(r.state_out, key_contiguous, cuda::kStateRunLength, elem);
  cuda::launch_recurrent(r, state_dtype, key_contiguous, stream);
}

void require_f32_state(const TensorView& s, const char* name) {
  if (s.present() && s.dtype != DType::f32)
    throw Error(ErrorCode::unsupported, std::string("argument '") + name +
                                            "': the CUDA schedules keep float32 states, got " +
                                            dtype_name(s.dtype));
}

}  // namespace

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
