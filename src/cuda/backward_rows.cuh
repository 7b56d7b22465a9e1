// A token row's gradients finished (cuda/backward_params.h): dq and dk through the scale and
// the L2 norm, dv and d beta from d(beta v), each in its dtype, by the lanes of a warp that
// share the row. The outputs stage takes them per token; grads per chunk row where it
// finishes them itself (BackwardParams::rows_in_grads).
#pragma once

#include "cuda/backward_gate.cuh"
#include "cuda/backward_params.h"
#include "cuda/device_io.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

// A lane handles a run of 8 adjacent channels of a row (a token of one head), so that it reads
// and writes 16-byte words where the tensors allow: the per-token stages move bytes and little
// else. A row takes 32 lanes when K or V is above 128 (up to 256), else 16, two rows per warp:
// at K = V = 128 a row per warp left half the lanes idle, halving the loads in flight.
__host__ __device__ inline int rows_per_warp(const RecurrentParams& p) {
  return p.K > 128 || p.V > 128 ? 1 : 2;
}

struct RowLanes {
  bool wide;  // 32 lanes per row
  int sub;    // the lane's row of the warp's rows
  int c0;     // the lane's first channel
  __device__ explicit RowLanes(const RecurrentParams& p) : wide(rows_per_warp(p) == 1) {
    const int lane = threadIdx.x % 32;
    sub = wide ? 0 : lane / 16;
    c0 = 8 * (wide ? lane : lane % 16);
  }
  __device__ int rows() const { return wide ? 1 : 2; }
  __device__ bool leader() const { return c0 == 0; }
  // The sum over the row's lanes (every lane of the warp calls it: `wide` is the kernel's).
  __device__ float sum(float x) const {
    x = lane_sum<1, 8>(x);
    return wide ? x + __shfl_xor_sync(0xffffffffu, x, 16) : x;
  }
};

// dx of q or k from y, the sum of its value heads' gradients, and the raw input's run (x's
// dtype): scaled, through the L2 norm, stored at element `at` of dx (the lane's first
// channel). Every lane calls it (the norm's lane sums); `store` says whether this lane's run
// is stored.
__device__ void finish_key_grad(const RecurrentParams& p, const RowLanes& rl, const Run8& raw,
                                DType x_dtype, const TokenTensor& dx, int64_t at, float scale,
                                int valid, bool store, float (&y)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] *= scale;
  if (p.qk_l2norm) {
    // y = x / n, n = sqrt(sum x^2 + eps): dx = (dy - y (y . dy)) / n.
    float xs[8] = {}, ss = 0.f;
    if (store) run8_to_float(raw, x_dtype, xs);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += xs[e] * xs[e];
    const float inv = rsqrtf(rl.sum(ss) + kL2NormEps);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += xs[e] * inv * y[e];
    dot = rl.sum(dot);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = (y[e] - xs[e] * inv * dot) * inv;
  }
  if (store) store_run8(dx, at, valid, y);
}

// A value row's dv and d beta from d (the lane's run of d(beta v), `valid` channels), the raw
// v run and beta: dv = beta d(beta v), stored at element dv_at of b.dv; where v_dot (d beta
// wanted, with the delta rule; the same in every lane) d beta gains its product with v summed
// over the row, goes through beta's sigmoid and is stored by the row's leader (beta_lane) at
// element dbeta_at of b.dbeta, from `dbeta` (its other terms). Every lane calls it (the lane
// sums).
__device__ void finish_value_row(const BackwardParams& b, const RowLanes& rl, float (&d)[8],
                                 const Run8& vraw, int valid, float beta, int64_t dv_at,
                                 bool v_dot, bool beta_lane, float dbeta, float raw_beta,
                                 int64_t dbeta_at) {
  const RecurrentParams& p = b.p;
  float vals[8] = {};
  if (v_dot && valid > 0) run8_to_float(vraw, p.v.dtype, vals);
  float dot = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    dot = fmaf(d[e], vals[e], dot);
    d[e] *= beta;
  }
  if (v_dot) dbeta += rl.sum(dot);
  if (b.dv.data && valid > 0) store_run8(b.dv, dv_at, valid, d);
  if (!beta_lane) return;
  if (p.beta_sigmoid) dbeta *= p.beta_factor * sigmoid_exact(raw_beta) * sigmoid_exact(-raw_beta);
  store_float(const_cast<void*>(b.dbeta.data), b.dbeta.dtype, dbeta_at, dbeta);
}

}  // namespace
}  // namespace flashdelta::detail::cuda
