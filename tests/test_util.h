// Test helpers: owning host tensors, random problems of every shape and option, and error
// measures. Inputs are random (fixed seeds), never zeros.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/tensor_io.h"
#include "flashdelta/flashdelta.h"

namespace flashdelta::testing {

// A dense row-major tensor owning its bytes.
struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;

  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    bytes.assign(static_cast<size_t>(std::max<int64_t>(n, 1) * dtype_size(dtype)), 0);
    view.data = bytes.data();
    view.dtype = dtype;
    view.rank = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int d = view.rank - 1; d >= 0; --d) {
      view.shape[d] = shape[d];
      view.stride[d] = st;
      st *= shape[d];
    }
  }
  HostTensor(const HostTensor& o) : bytes(o.bytes), view(o.view) { view.data = bytes.data(); }
  HostTensor& operator=(const HostTensor& o) {
    bytes = o.bytes;
    view = o.view;
    view.data = bytes.data();
    return *this;
  }

  int64_t numel() const { return view.numel(); }
  std::vector<double> to_double() const {
    std::vector<double> out(static_cast<size_t>(numel()));
    detail::load_row(view, 0, numel(), 1, out.data());
    return out;
  }
  void set(const std::vector<double>& values) {
    detail::store_row(view, 0, numel(), 1, values.data());
  }
  void fill(double value) { set(std::vector<double>(static_cast<size_t>(numel()), value)); }
};

inline std::vector<double> random_normal(std::mt19937_64& rng, int64_t n, double mean = 0,
                                         double stddev = 1) {
  std::normal_distribution<double> d(mean, stddev);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = d(rng);
  return v;
}

inline std::vector<double> random_uniform(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = d(rng);
  return v;
}

inline constexpr Mechanism kAllMechanisms[] = {
    Mechanism::linear_attention, Mechanism::simple_gla,     Mechanism::gla,
    Mechanism::deltanet,         Mechanism::gated_deltanet, Mechanism::kda};

// One random problem. Fields left at their defaults give a small KDA case.
struct CaseConfig {
  Mechanism mechanism = Mechanism::kda;
  int64_t B = 1, T = 17, H = 2, HV = 2, K = 16, V = 16;
  DType dtype = DType::f32;
  std::vector<int64_t> seqlens;  // non-empty: varlen (B must be 1, T = sum)
  bool initial_state = true;
  StateLayout layout = StateLayout::k_first;
  bool qk_l2norm = false;       // when false, k is unit-normalised by the generator
  bool beta_sigmoid = false;
  bool allow_neg_eigval = false;
  bool gate_in_kernel = false;
  bool with_A_log = true;       // gate_in_kernel with lower_bound: A_log optional
  bool with_dt_bias = true;
  std::optional<double> lower_bound;
  double gate_min = -1.0;       // per-step log gate drawn from [gate_min, 0) (precomputed gate)
  std::optional<double> beta_value;  // fixed beta (e.g. 0 or 1) instead of random in [0, 1]
  std::optional<double> scale;
  uint64_t seed = 1;
};

struct Case {
  CaseConfig cfg;
  Options options;
  HostTensor q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias;
  int64_t N = 0;

  std::vector<int64_t> state_shape() const {
    return cfg.layout == StateLayout::k_first ? std::vector<int64_t>{N, cfg.HV, cfg.K, cfg.V}
                                              : std::vector<int64_t>{N, cfg.HV, cfg.V, cfg.K};
  }
  HostTensor make_output(DType dtype) const { return HostTensor(dtype, {cfg.B, cfg.T, cfg.HV, cfg.V}); }
  HostTensor make_state() const { return HostTensor(DType::f32, state_shape()); }

  // ForwardArgs::chunk_states: ceil(L / 64) entries per sequence of L tokens, in order.
  int64_t chunk_count() const {
    if (cfg.seqlens.empty()) return cfg.B * chunk_state_count(cfg.T);
    int64_t total = 0;
    for (int64_t len : cfg.seqlens) total += chunk_state_count(len);
    return total;
  }
  HostTensor make_chunk_states(DType dtype) const {
    std::vector<int64_t> shape = state_shape();
    shape[0] = chunk_count();
    return HostTensor(dtype, shape);
  }

  // Forward arguments writing into o (and final_state when given).
  ForwardArgs args(HostTensor& o, HostTensor* final_state) const {
    ForwardArgs a;
    a.q = q.view;
    a.k = k.view;
    a.v = v.view;
    const MechanismTraits mt = traits(cfg.mechanism);
    if (mt.gate != GateKind::none) a.g = g.view;
    if (mt.delta) a.beta = beta.view;
    if (cfg.initial_state) a.initial_state = initial_state.view;
    if (!cfg.seqlens.empty()) a.cu_seqlens = cu_seqlens.view;
    if (cfg.gate_in_kernel && cfg.with_A_log) a.A_log = A_log.view;
    if (cfg.gate_in_kernel && cfg.with_dt_bias) a.dt_bias = dt_bias.view;
    a.o = o.view;
    if (final_state) a.final_state = final_state->view;
    return a;
  }
};

inline Case make_case(const CaseConfig& c) {
  Case out;
  out.cfg = c;
  std::mt19937_64 rng(c.seed);
  const MechanismTraits mt = traits(c.mechanism);
  out.N = c.seqlens.empty() ? c.B : static_cast<int64_t>(c.seqlens.size());

  out.q = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  out.q.set(random_normal(rng, out.q.numel()));
  out.k = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  std::vector<double> kv = random_normal(rng, out.k.numel());
  if (!c.qk_l2norm) {  // keep the delta-rule transition contractive: unit keys
    for (int64_t r = 0; r < out.k.numel() / c.K; ++r) {
      double s = 0;
      for (int64_t i = 0; i < c.K; ++i) s += kv[r * c.K + i] * kv[r * c.K + i];
      for (int64_t i = 0; i < c.K; ++i) kv[r * c.K + i] /= std::sqrt(s);
    }
  }
  out.k.set(kv);
  out.v = HostTensor(c.dtype, {c.B, c.T, c.HV, c.V});
  out.v.set(random_normal(rng, out.v.numel()));

  if (mt.gate != GateKind::none) {
    std::vector<int64_t> gshape = {c.B, c.T, c.HV};
    if (mt.gate == GateKind::vector) gshape.push_back(c.K);
    out.g = HostTensor(c.gate_in_kernel || c.dtype == DType::f64 ? c.dtype : DType::f32, gshape);
    out.g.set(c.gate_in_kernel ? random_normal(rng, out.g.numel())
                               : random_uniform(rng, out.g.numel(), c.gate_min, 0.0));
  }
  if (mt.delta) {
    out.beta = HostTensor(c.dtype, {c.B, c.T, c.HV});
    if (c.beta_value)
      out.beta.fill(*c.beta_value);
    else
      out.beta.set(c.beta_sigmoid ? random_normal(rng, out.beta.numel())
                                  : random_uniform(rng, out.beta.numel(), 0.0, 1.0));
  }
  out.initial_state = HostTensor(DType::f32, out.state_shape());
  out.initial_state.set(random_normal(rng, out.initial_state.numel(), 0, 0.5));
  if (!c.seqlens.empty()) {
    out.cu_seqlens = HostTensor(DType::i64, {out.N + 1});
    auto* cu = static_cast<int64_t*>(out.cu_seqlens.view.data);
    cu[0] = 0;
    for (int64_t i = 0; i < out.N; ++i) cu[i + 1] = cu[i] + c.seqlens[i];
  }
  out.A_log = HostTensor(DType::f32, {c.HV});
  out.A_log.set(random_uniform(rng, c.HV, -1.0, 1.0));
  const int64_t bias_n = mt.gate == GateKind::vector ? c.HV * c.K : c.HV;
  out.dt_bias = HostTensor(DType::f32, {bias_n});
  out.dt_bias.set(random_normal(rng, bias_n, 0, 0.5));

  Options& o = out.options;
  o.mechanism = c.mechanism;
  o.scale = c.scale;
  o.qk_l2norm = c.qk_l2norm;
  o.beta_sigmoid = c.beta_sigmoid;
  o.allow_neg_eigval = c.allow_neg_eigval;
  o.gate_in_kernel = c.gate_in_kernel;
  o.lower_bound = c.lower_bound;
  o.state_layout = c.layout;
  return out;
}

// A case with every fused transform on (q/k L2 norm, beta sigmoid, gate activation in the
// softplus or lower-bound form), T = 24, V = 16, and the raw gates and betas scaled by
// `spread` so that the activations reach their saturated ranges.
inline Case make_transform_case(DType dtype, int64_t K, std::optional<double> lower_bound,
                                double spread) {
  CaseConfig cfg;
  cfg.dtype = dtype;
  cfg.qk_l2norm = cfg.beta_sigmoid = cfg.gate_in_kernel = true;
  cfg.lower_bound = lower_bound;
  cfg.T = 24;
  cfg.K = K;
  cfg.V = 16;
  Case c = make_case(cfg);
  for (HostTensor* raw : {&c.g, &c.beta}) {
    std::vector<double> x = raw->to_double();
    for (double& e : x) e *= spread;
    raw->set(x);
  }
  return c;
}

// Relative Frobenius error ||a - b|| / max(||b||, tiny).
// Gates that stress a chunkwise schedule's factorisation (precomputed gates, f32):
// - one_sided: in every 16-token block, tokens 1..7 decay by 11.9 nats each (about 119 bits
//   over the block, just inside a 120-bit exact bound) and the rest barely at all, with q
//   scaled by 1000: a reference point in the middle token would make factors of 2^119.
// - resets: a gate of -inf (a hard reset, exp(g) = 0) on every 23rd token.
inline Case stressed_gate_case(Mechanism m, bool one_sided, uint64_t seed) {
  CaseConfig cfg;
  cfg.mechanism = m;
  cfg.T = 150;
  cfg.H = cfg.HV = 1;
  cfg.K = 64;
  cfg.V = 32;
  cfg.seed = seed;
  Case c = make_case(cfg);
  const int64_t per_token = c.g.numel() / cfg.T;  // K for vector gates, 1 for scalar
  std::vector<double> g = c.g.to_double();
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t i = 0; i < per_token; ++i) {
      double& x = g[static_cast<size_t>(t * per_token + i)];
      if (one_sided) x = t % 16 >= 1 && t % 16 <= 7 ? -11.9 : -0.01;
      else if (t % 23 == 5) x = -INFINITY;
    }
  c.g.set(g);
  if (one_sided) {
    std::vector<double> q = c.q.to_double();
    for (double& x : q) x *= 1000;
    c.q.set(q);
  }
  return c;
}

inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (a.size() != b.size()) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Tolerance on the relative error of a fast schedule against the reference, by input dtype.
inline double tolerance(DType dtype) {
  switch (dtype) {
    case DType::f64: return 1e-9;
    case DType::f32: return 2e-4;
    default: return 1e-2;
  }
}

}  // namespace flashdelta::testing
