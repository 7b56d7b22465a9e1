// The gate's derivative in the CUDA backward (cuda/backward_params.h): from the gradient of
// the log gate g (the one Gamma = cumsum(g) takes) to the raw gate's, through the fused
// activation (DESIGN.md section 1) and the floor the backward puts under g, with A_log's
// share. The outputs stage takes it per token; grads per chunk row where it finishes a scalar
// gate's gradient itself (BackwardParams::gate_in_grads).
#pragma once

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Decays below e^-128 are 0 in float32 (its smallest denormal is e^-103.3); flooring the
// gate there keeps Gamma finite for gates of -inf, so differences of Gamma never give NaN.
constexpr float kMinGate = -128.f;

__device__ __forceinline__ float sigmoid_exact(float x) { return 1.f / (1.f + expf(-x)); }

// exp(A_log[hv]) or 1 without A_log.
__device__ __forceinline__ float gate_scale(const RecurrentParams& p, int64_t hv) {
  return p.A_log ? expf(load_float(p.A_log, p.A_log_dtype, hv * p.A_log_stride)) : 1.f;
}

// dt_bias of channel c where the gate is activated here (added to its raw input), else 0.
__device__ __forceinline__ float gate_bias(const RecurrentParams& p, int64_t hv, int c) {
  return p.gate_in_kernel && p.dt_bias
             ? load_float(p.dt_bias, p.dt_bias_dtype,
                          hv * p.dt_bias_head_stride + c * p.dt_bias_key_stride)
             : 0.f;
}

// The raw gate input at element `off` of g, of value head hv and channel c (0 for a scalar
// gate), dt_bias added where the gate is activated here.
__device__ __forceinline__ float raw_gate(const RecurrentParams& p, int64_t off, int64_t hv,
                                          int c) {
  return load_float(p.g.data, p.g.dtype, off) + gate_bias(p, hv, c);
}

__device__ __forceinline__ float activated_gate(const RecurrentParams& p, float x, float a) {
  return p.gate_in_kernel ? activate_gate(p, x, a) : x;
}

// The raw gate's gradient and A_log's share of it, from the log gate's gradient d at raw
// input x (dt_bias added; a = gate_scale). The floor at kMinGate passes no gradient (the
// reference's is 0 there too: e^g S = 0).
struct GateGrad {
  float raw, A_log;
};

__device__ GateGrad gate_grad(const RecurrentParams& p, float x, float a, float d) {
  const float de = !(activated_gate(p, x, a) < kMinGate) ? d : 0.f;
  // de times d gate / d raw and d gate / d A_log (the reference's gate_derivative).
  if (!p.gate_in_kernel) return {de, de * 0.f};
  const bool has_a = p.A_log != nullptr;
  if (p.has_lower_bound) {
    const float z = has_a ? a * x : x;
    const float dz = p.lower_bound * sigmoid_exact(z) * sigmoid_exact(-z);
    return has_a ? GateGrad{de * (dz * a), de * (dz * z)} : GateGrad{de * dz, de * 0.f};
  }
  return {de * (-a * sigmoid_exact(x)), de * (-a * softplusf(x))};
}

}  // namespace
}  // namespace flashdelta::detail::cuda
