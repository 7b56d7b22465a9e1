// One token's inputs after the fused transforms (q/k L2 norm, beta sigmoid, gate
// activation), in precision T. The reference (T = double) and the CPU schedules (T = float)
// both read through this, so the transforms are written once; the schedules swap in a
// vectorised form of the two per-channel ones (cpu/token_transforms-inl.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/problem.h"
#include "core/tensor_io.h"

namespace flashdelta::detail {

inline constexpr double kL2NormEps = 1e-6;

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// log(1 + e^x) without overflow.
template <class T>
T softplus(T x) {
  return (x > T(0) ? x : T(0)) + std::log1p(std::exp(-std::fabs(x)));
}

template <class T>
void l2_normalize(T* x, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  const T inv = T(1) / std::sqrt(s + T(kL2NormEps));
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Gate parameters of one value head, loaded once per head: a = exp(A_log[hv]) and the
// dt_bias row (K values for a vector gate, 1 for a scalar gate).
template <class T>
struct GateParams {
  bool has_a = false;
  T a = T(1);
  T bias[256] = {};
};

template <class T>
GateParams<T> load_gate_params(const Problem& p, int64_t hv) {
  GateParams<T> gp;
  const TokenViews& in = p.in;
  if (!p.options.gate_in_kernel) return gp;
  if (in.A_log.present()) {
    gp.has_a = true;
    gp.a = std::exp(load_scalar<T>(in.A_log, offset_of(in.A_log, hv)));
  }
  if (in.dt_bias.present()) {
    const int64_t n = p.gate == GateKind::vector ? p.K : 1;
    const int64_t off = in.dt_bias.rank == 2 ? offset_of(in.dt_bias, hv, 0)
                                             : offset_of(in.dt_bias, hv * n);
    const int64_t step = in.dt_bias.rank == 2 ? in.dt_bias.stride[1] : in.dt_bias.stride[0];
    load_row(in.dt_bias, off, n, step, gp.bias);
  }
  return gp;
}

// g from the raw pre-activation x of key channel i (channel 0 for a scalar gate).
template <class T>
T gate_activation(const Options& o, const GateParams<T>& gp, int64_t i, T x) {
  x += gp.bias[i];
  if (o.lower_bound) return static_cast<T>(*o.lower_bound) * sigmoid(gp.has_a ? gp.a * x : x);
  return -gp.a * softplus(x);
}

// The per-channel transforms of a token (over K values) as written above: the reference's
// arithmetic. The CPU schedules pass load_token a vectorised class of the same shape.
struct ScalarTransforms {
  template <class T>
  static void l2_normalize(T* x, int64_t n) {
    detail::l2_normalize(x, n);
  }
  template <class T>
  static void activate_gate(const Options& o, const GateParams<T>& gp, T* g, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] = gate_activation(o, gp, i, g[i]);
  }
};

// Loads token t of batch row b for value head hv. q and k are the (normalised) rows of key
// head hv / group, unscaled; g receives K values (vector gate), 1 (scalar) or nothing; beta
// is written only for delta mechanisms. Transforms: see ScalarTransforms.
template <class T, class Transforms = ScalarTransforms>
void load_token(const Problem& p, const GateParams<T>& gp, int64_t b, int64_t t, int64_t hv,
                T* q, T* k, T* v, T* g, T* beta) {
  const TokenViews& in = p.in;
  const int64_t h = p.key_head(hv);
  load_row(in.q, offset_of(in.q, b, t, h, 0), p.K, in.q.stride[3], q);
  load_row(in.k, offset_of(in.k, b, t, h, 0), p.K, in.k.stride[3], k);
  load_row(in.v, offset_of(in.v, b, t, hv, 0), p.V, in.v.stride[3], v);
  if (p.options.qk_l2norm) {
    Transforms::l2_normalize(q, p.K);
    Transforms::l2_normalize(k, p.K);
  }
  if (p.gate == GateKind::vector) {
    load_row(in.g, offset_of(in.g, b, t, hv, 0), p.K, in.g.stride[3], g);
    if (p.options.gate_in_kernel) Transforms::activate_gate(p.options, gp, g, p.K);
  } else if (p.gate == GateKind::scalar) {
    g[0] = load_scalar<T>(in.g, offset_of(in.g, b, t, hv));
    if (p.options.gate_in_kernel) g[0] = gate_activation(p.options, gp, 0, g[0]);
  }
  if (p.delta) {
    T x = load_scalar<T>(in.beta, offset_of(in.beta, b, t, hv));
    if (p.options.beta_sigmoid) x = (p.options.allow_neg_eigval ? T(2) : T(1)) * sigmoid(x);
    *beta = x;
  }
}

}  // namespace flashdelta::detail
