// The fused input transforms on the device (DESIGN.md section 1), shared by the CUDA
// schedules: L2 norm epsilon, beta sigmoid and the gate activation.
#pragma once

#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {
namespace {

constexpr float kL2NormEps = 1e-6f;
constexpr float kLog2e = 1.4426950408889634f;

// 2^x by the hardware's approximation alone (ex2.approx.ftz: ~2 ulp, results below 2^-126
// flushed to 0; -inf gives 0 and NaN stays NaN). exp2f adds a range check and two
// multiplies around the same instruction so that results down to 2^-149 stay denormal. For
// the chunk kernels' decay factors, which are rounded to bfloat16 or multiply values of
// order 1, such results are 0 to the sums they enter, and the check is three of four
// instructions.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x by the hardware's approximation alone (rcp.approx.ftz: ~1 ulp, subnormal x taken as
// 0, so 1 / 0 = inf): the chunk kernels' reciprocals of factors within 2^+-60.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The fast exponential and division (a few ulp; the inputs are bf16-level data): the gate's
// sigmoid runs once per key channel and token. It is __fdividef(1, 1 + __expf(-x)) bit for
// bit: __expf is 2^(-x log2e) by the same instruction, and the denormal results that its
// range check keeps are below half an ulp of the 1 they are added to.
__device__ __forceinline__ float sigmoidf(float x) {
  return __fdividef(1.f, 1.f + exp2_approx(-x * kLog2e));
}
__device__ __forceinline__ float softplusf(float x) {
  return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x)));
}

// Sum over the lanes whose index differs in the bits first..last (powers of two).
template <int First, int Last>
__device__ __forceinline__ float lane_sum(float x) {
#pragma unroll
  for (int off = First; off <= Last; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// The gate in log space from its raw pre-activation x (dt_bias already added); a is
// exp(A_log[hv]), or 1 without A_log.
__device__ __forceinline__ float activate_gate(const RecurrentParams& p, float x, float a) {
  return p.has_lower_bound ? p.lower_bound * sigmoidf(a * x) : -a * softplusf(x);
}

// activate_gate over a run of channels, the form chosen once for the run (per element, the
// branch and both forms' set-up were 8% of the chunk prepare kernel's instructions).
template <int N>
__device__ __forceinline__ void activate_gates(const RecurrentParams& p, float (&x)[N], float a) {
  if (p.has_lower_bound) {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = p.lower_bound * sigmoidf(a * x[e]);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = -a * softplusf(x[e]);
  }
}

// beta from its raw input (sigmoid when fused).
__device__ __forceinline__ float activate_beta(const RecurrentParams& p, float b) {
  return p.beta_sigmoid ? p.beta_factor * sigmoidf(b) : b;
}

}  // namespace
}  // namespace flashdelta::detail::cuda
