// The reference backward against central finite differences of the reference forward, in
// fp64, for a random scalar loss L = <W_o, o> + <W_s, final_state>; and its contract
// (absent outputs, empty sequences, dtypes, determinism).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "grad_inputs.h"
#include "test_util.h"

namespace flashdelta::testing {
namespace {

// Relative error of each analytic gradient against its finite-difference estimate.
constexpr double kGradTolerance = 1e-6;
// Central-difference step: truncation error ~ h^2, rounding ~ 1e-16 |L| / h.
constexpr double kStep = 1e-5;

size_t input_index(const std::string& name) {
  for (size_t i = 0; i < std::size(kGradInputs); ++i)
    if (name == kGradInputs[i].name) return i;
  return std::size(kGradInputs);
}

HostTensor converted(const HostTensor& t, DType dtype) {
  HostTensor out(dtype,
                 std::vector<int64_t>(t.view.shape.begin(), t.view.shape.begin() + t.view.rank));
  out.set(t.to_double());
  return out;
}

void reshape(HostTensor& t, std::vector<int64_t> shape) {
  t.view.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = t.view.rank - 1; d >= 0; --d) {
    t.view.shape[d] = shape[d];
    t.view.stride[d] = stride;
    stride *= shape[d];
  }
}

// A case plus the loss weights. Every tensor is float64 unless the test says otherwise.
struct GradCase {
  Case c;
  HostTensor W_o, W_s;
  bool use_d_final_state = true;  // false: the loss ignores the final state

  double loss() const {
    HostTensor o = c.make_output(DType::f64);
    HostTensor s(DType::f64, c.state_shape());
    // One thread: thousands of tiny forwards, each would otherwise wake a thread team.
    Options single_thread = c.options;
    single_thread.num_threads = 1;
    forward(c.args(o, &s), single_thread, Schedule::reference);
    double l = 0;
    const auto ov = o.to_double(), wo = W_o.to_double();
    for (size_t i = 0; i < ov.size(); ++i) l += wo[i] * ov[i];
    if (use_d_final_state) {
      const auto sv = s.to_double(), ws = W_s.to_double();
      for (size_t i = 0; i < sv.size(); ++i) l += ws[i] * sv[i];
    }
    return l;
  }

  // Backward arguments with the inputs of the case and d_o = W_o, d_final_state = W_s.
  BackwardArgs args() const {
    HostTensor unused_o = c.make_output(DType::f64);
    const ForwardArgs f = c.args(unused_o, nullptr);
    BackwardArgs a;
    a.q = f.q;
    a.k = f.k;
    a.v = f.v;
    a.g = f.g;
    a.beta = f.beta;
    a.initial_state = f.initial_state;
    a.cu_seqlens = f.cu_seqlens;
    a.A_log = f.A_log;
    a.dt_bias = f.dt_bias;
    a.d_o = W_o.view;
    if (use_d_final_state) a.d_final_state = W_s.view;
    return a;
  }
};

struct GradConfig {
  std::string name;
  CaseConfig cfg;
  bool use_d_final_state = true;
  bool dt_bias_rank2 = false;
};

GradCase make_grad_case(const GradConfig& gc, DType dtype = DType::f64) {
  CaseConfig cfg = gc.cfg;
  cfg.dtype = dtype;
  GradCase out{make_case(cfg), {}, {}, gc.use_d_final_state};
  Case& c = out.c;
  // make_case keeps the state and gate parameters in float32; differentiate them in float64.
  c.initial_state = converted(c.initial_state, DType::f64);
  c.A_log = converted(c.A_log, DType::f64);
  c.dt_bias = converted(c.dt_bias, DType::f64);
  if (traits(cfg.mechanism).gate != GateKind::none) c.g = converted(c.g, dtype);
  if (gc.dt_bias_rank2) reshape(c.dt_bias, {cfg.HV, cfg.K});
  std::mt19937_64 rng(cfg.seed + 1000);
  out.W_o = HostTensor(DType::f64, {cfg.B, cfg.T, cfg.HV, cfg.V});
  out.W_o.set(random_normal(rng, out.W_o.numel()));
  out.W_s = HostTensor(DType::f64, c.state_shape());
  out.W_s.set(random_normal(rng, out.W_s.numel()));
  return out;
}

// Gradient outputs, one per present input, in `dtype`.
struct Grads {
  HostTensor t[std::size(kGradInputs)];
};

Grads run_backward(const GradCase& gc, DType dtype = DType::f64, int num_threads = 0) {
  Grads g;
  BackwardArgs a = gc.args();
  for (size_t i = 0; i < std::size(kGradInputs); ++i) {
    const TensorView& in = a.*kGradInputs[i].value;
    if (!in.present()) continue;
    g.t[i] = converted(gc.c.*kGradInputs[i].tensor, dtype);
    g.t[i].fill(std::numeric_limits<double>::quiet_NaN());  // every element must be written
    a.*kGradInputs[i].grad = g.t[i].view;
  }
  Options o = gc.c.options;
  o.num_threads = num_threads;
  backward(a, o, Schedule::reference);
  return g;
}

// Central finite differences of the loss with respect to every element of one input.
std::vector<double> finite_difference(GradCase& gc, HostTensor Case::*tensor) {
  HostTensor& x = gc.c.*tensor;
  std::vector<double> values = x.to_double(), fd(values.size());
  for (size_t e = 0; e < values.size(); ++e) {
    const double x0 = values[e];
    values[e] = x0 + kStep;
    x.set(values);
    const double plus = gc.loss();
    values[e] = x0 - kStep;
    x.set(values);
    const double minus = gc.loss();
    values[e] = x0;
    fd[e] = (plus - minus) / (2 * kStep);
  }
  x.set(values);
  return fd;
}

// gtest prints a failing parameter by its name.
void PrintTo(const GradConfig& config, std::ostream* os) { *os << config.name; }

class FiniteDifference : public ::testing::TestWithParam<GradConfig> {};

TEST_P(FiniteDifference, EveryGradientMatches) {
  GradCase gc = make_grad_case(GetParam());
  const Grads grads = run_backward(gc);
  const BackwardArgs a = gc.args();
  int checked = 0;
  for (size_t i = 0; i < std::size(kGradInputs); ++i) {
    if (!(a.*kGradInputs[i].value).present()) continue;
    const std::vector<double> analytic = grads.t[i].to_double();
    const std::vector<double> fd = finite_difference(gc, kGradInputs[i].tensor);
    const double err = rel_error(analytic, fd);
    EXPECT_LT(err, kGradTolerance)
        << "d" << kGradInputs[i].name << ": relative error " << err << " > tolerance " << kGradTolerance
        << " (max abs diff " << max_abs_diff(analytic, fd) << ")";
    ++checked;
  }
  EXPECT_GE(checked, 3);  // at least q, k, v
}

CaseConfig small(Mechanism m, int64_t T = 5, int64_t K = 4, int64_t V = 3) {
  CaseConfig c;
  c.mechanism = m;
  c.T = T;
  c.K = K;
  c.V = V;
  c.H = 1;
  c.HV = 2;  // grouped value heads: dq, dk sum over two value heads
  return c;
}

std::vector<GradConfig> grad_configs() {
  using M = Mechanism;
  std::vector<GradConfig> out;
  auto add = [&](std::string name, CaseConfig cfg, bool d_final = true, bool rank2 = false) {
    cfg.seed = out.size() + 1;
    out.push_back({std::move(name), cfg, d_final, rank2});
  };
  for (M m : {M::linear_attention, M::simple_gla, M::gla, M::deltanet, M::gated_deltanet, M::kda})
    add(mechanism_name(m), small(m));
  add("kda_T1", small(M::kda, 1));
  add("kda_T17_K7_V3", small(M::kda, 17, 7, 3));
  add("gated_deltanet_T17_K3_V7", small(M::gated_deltanet, 17, 3, 7));
  add("gla_T17_K7_V4", small(M::gla, 17, 7, 4));

  CaseConfig strong = small(M::kda, 9);
  strong.gate_min = -8.0;
  strong.scale = 1.3;
  add("kda_strong_gate_scale", strong);

  CaseConfig varlen = small(M::kda, 9);
  varlen.seqlens = {3, 0, 6};
  add("kda_varlen_empty", varlen);
  varlen.mechanism = M::linear_attention;
  varlen.seqlens = {0, 8, 1};
  add("linear_varlen_empty_first", varlen);
  CaseConfig batch = small(M::simple_gla, 4);
  batch.B = 2;
  add("simple_gla_batch2", batch);

  CaseConfig vfirst = small(M::kda, 5, 4, 7);
  vfirst.layout = StateLayout::v_first;
  add("kda_v_first", vfirst);
  vfirst.mechanism = M::gla;
  add("gla_v_first", vfirst);

  CaseConfig no_state = small(M::deltanet);
  no_state.initial_state = false;
  add("deltanet_no_initial_state", no_state);
  no_state.mechanism = M::kda;
  add("kda_no_initial_state", no_state);
  add("kda_no_d_final_state", small(M::kda), false);

  CaseConfig l2 = small(M::kda);
  l2.qk_l2norm = true;
  add("kda_qk_l2norm", l2);
  l2.mechanism = M::linear_attention;
  add("linear_qk_l2norm", l2);

  CaseConfig sig = small(M::gated_deltanet);
  sig.beta_sigmoid = true;
  add("gated_deltanet_beta_sigmoid", sig);
  sig.mechanism = M::kda;
  sig.allow_neg_eigval = true;
  add("kda_beta_sigmoid_neg_eigval", sig);

  CaseConfig gate = small(M::kda);
  gate.gate_in_kernel = true;
  add("kda_gate_softplus", gate);
  add("kda_gate_softplus_dt_bias_rank2", gate, true, true);
  gate.with_dt_bias = false;
  add("kda_gate_softplus_no_dt_bias", gate);
  gate.with_dt_bias = true;
  gate.mechanism = M::gated_deltanet;
  add("gated_deltanet_gate_softplus", gate);
  gate.mechanism = M::kda;
  gate.lower_bound = -5.0;
  add("kda_gate_lower_bound_A_log", gate);
  add("kda_gate_lower_bound_A_log_dt_bias_rank2", gate, true, true);
  gate.mechanism = M::simple_gla;
  gate.lower_bound = -3.0;
  add("simple_gla_gate_lower_bound_A_log", gate);
  gate.with_A_log = false;
  add("simple_gla_gate_lower_bound", gate);
  gate.mechanism = M::gla;
  add("gla_gate_lower_bound", gate);

  // Everything at once.
  CaseConfig all = small(M::kda, 11, 7, 4);
  all.H = 2;
  all.HV = 4;
  all.seqlens = {4, 0, 7};
  all.layout = StateLayout::v_first;
  all.qk_l2norm = true;
  all.beta_sigmoid = true;
  all.allow_neg_eigval = true;
  all.gate_in_kernel = true;
  all.lower_bound = -5.0;
  all.scale = 0.7;
  add("kda_all_options", all, true, true);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Backward, FiniteDifference, ::testing::ValuesIn(grad_configs()),
                         [](const ::testing::TestParamInfo<GradConfig>& info) {
                           return info.param.name;
                         });

// A long sequence crosses many checkpoint segments: compare the directional derivative along
// a random direction per input with <gradient, direction>.
TEST(Backward, DirectionalDerivativeOnLongSequence) {
  for (Mechanism m : {Mechanism::kda, Mechanism::gla}) {
    CaseConfig cfg = small(m, 300, 5, 4);
    cfg.qk_l2norm = true;
    cfg.gate_in_kernel = true;
    cfg.seqlens = {170, 0, 130};
    GradCase gc = make_grad_case({"long", cfg});
    const Grads grads = run_backward(gc);
    const BackwardArgs a = gc.args();
    std::mt19937_64 rng(7);
    for (size_t i = 0; i < std::size(kGradInputs); ++i) {
      if (!(a.*kGradInputs[i].value).present()) continue;
      HostTensor& x = gc.c.*kGradInputs[i].tensor;
      const std::vector<double> x0 = x.to_double(), grad = grads.t[i].to_double();
      const std::vector<double> u = random_normal(rng, x.numel());
      double analytic = 0;
      for (size_t e = 0; e < u.size(); ++e) analytic += grad[e] * u[e];
      auto loss_at = [&](double h) {
        std::vector<double> xs = x0;
        for (size_t e = 0; e < xs.size(); ++e) xs[e] += h * u[e];
        x.set(xs);
        return gc.loss();
      };
      const double fd = (loss_at(kStep) - loss_at(-kStep)) / (2 * kStep);
      x.set(x0);
      const double err = std::fabs(analytic - fd) / std::max(std::fabs(fd), 1e-30);
      EXPECT_LT(err, kGradTolerance)
          << mechanism_name(m) << " d" << kGradInputs[i].name << ": analytic " << analytic
          << ", finite difference " << fd << ", relative error " << err;
    }
  }
}

GradConfig all_options_config() {
  const std::vector<GradConfig> configs = grad_configs();
  return configs.back();
}

// Each gradient output requested alone equals the same output requested with all others,
// and is fully written (run_backward poisons outputs with NaN).
TEST(Backward, EachGradientAloneMatchesAll) {
  const GradCase gc = make_grad_case(all_options_config());
  const Grads all = run_backward(gc);
  const BackwardArgs base = gc.args();
  for (size_t i = 0; i < std::size(kGradInputs); ++i) {
    if (!(base.*kGradInputs[i].value).present()) continue;
    const std::vector<double> expect = all.t[i].to_double();
    for (double x : expect) ASSERT_TRUE(std::isfinite(x)) << "d" << kGradInputs[i].name;
    HostTensor alone = converted(gc.c.*kGradInputs[i].tensor, DType::f64);
    alone.fill(std::numeric_limits<double>::quiet_NaN());
    BackwardArgs a = base;
    a.*kGradInputs[i].grad = alone.view;
    backward(a, gc.c.options, Schedule::reference);
    EXPECT_EQ(alone.to_double(), expect) << "d" << kGradInputs[i].name;
  }
}

TEST(Backward, StridedGradientOutputs) {
  // dq written through a [B, H, T, K] buffer viewed as [B, T, H, K] equals the dense dq.
  const GradCase gc = make_grad_case(all_options_config());
  const Grads all = run_backward(gc);
  const CaseConfig& cfg = gc.c.cfg;
  HostTensor buffer(DType::f64, {cfg.B, cfg.H, cfg.T, cfg.K});
  BackwardArgs a = gc.args();
  a.dq = buffer.view;
  std::swap(a.dq.shape[1], a.dq.shape[2]);
  std::swap(a.dq.stride[1], a.dq.stride[2]);
  backward(a, gc.c.options, Schedule::reference);
  const std::vector<double> dense = all.t[input_index("q")].to_double(),
                            strided = buffer.to_double();
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; ++h)
      for (int64_t i = 0; i < cfg.K; ++i)
        EXPECT_EQ(strided[(h * cfg.T + t) * cfg.K + i], dense[(t * cfg.H + h) * cfg.K + i]);
}

TEST(Backward, EmptySequencePassesStateGradientThrough) {
  CaseConfig cfg = small(Mechanism::kda, 5);
  cfg.seqlens = {2, 0, 3};
  for (bool with_d_final : {true, false}) {
    GradConfig config{"empty", cfg, with_d_final};
    const GradCase gc = make_grad_case(config);
    const Grads g = run_backward(gc);
    const std::vector<double> d_init = g.t[input_index("initial_state")].to_double(),
                              d_final = gc.W_s.to_double();
    const int64_t per_seq = cfg.HV * cfg.K * cfg.V;
    for (int64_t e = per_seq; e < 2 * per_seq; ++e)
      EXPECT_EQ(d_init[e], with_d_final ? d_final[e] : 0.0) << "element " << e;
  }
}

TEST(Backward, DeterministicAcrossThreadCounts) {
  const GradCase gc = make_grad_case(all_options_config());
  const Grads one = run_backward(gc, DType::f64, 1), two = run_backward(gc, DType::f64, 2);
  for (size_t i = 0; i < std::size(kGradInputs); ++i)
    EXPECT_EQ(one.t[i].to_double(), two.t[i].to_double()) << "d" << kGradInputs[i].name;
}

// Relative error of a gradient stored in `dtype`: its unit roundoff (exact for f64).
double rounding_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f32: return 6e-8;
    case DType::f16: return 4.9e-4;
    case DType::bf16: return 3.9e-3;
    default: return 0.0;
  }
}

TEST(Backward, ReducedPrecisionInputsAndOutputs) {
  // bf16 and f16 inputs (and d_o) are read exactly into fp64, so the gradients equal those of
  // the same values given in f64; gradient outputs of every float dtype hold them to their
  // precision.
  for (DType in_dtype : {DType::bf16, DType::f16}) {
    GradCase low = make_grad_case(all_options_config(), in_dtype);
    low.W_o = converted(low.W_o, in_dtype);  // d_o too
    GradCase exact = low;
    for (const GradInput& in : kGradInputs)
      if ((low.c.*in.tensor).view.present())
        exact.c.*in.tensor = converted(low.c.*in.tensor, DType::f64);
    exact.W_o = converted(low.W_o, DType::f64);
    const Grads ref = run_backward(exact, DType::f64);
    for (DType out_dtype : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
      const Grads g = run_backward(low, out_dtype);
      const double tol = rounding_tolerance(out_dtype);
      for (size_t i = 0; i < std::size(kGradInputs); ++i) {
        if (!g.t[i].view.present()) continue;
        const std::vector<double> got = g.t[i].to_double(), want = ref.t[i].to_double();
        for (double x : got) ASSERT_TRUE(std::isfinite(x)) << "d" << kGradInputs[i].name;
        const double err = rel_error(got, want);
        EXPECT_LE(err, tol) << dtype_name(in_dtype) << " inputs, " << dtype_name(out_dtype) << " d"
                            << kGradInputs[i].name << ": relative error " << err;
      }
    }
  }
}

// BackwardArgs::chunk_states (the opt-in to keep the forward's states). Cases cross several
// 64-token chunks, with an empty sequence, partial last chunks and both layouts.
std::vector<GradConfig> kept_state_configs() {
  CaseConfig kda = small(Mechanism::kda, 200, 5, 4);
  kda.seqlens = {70, 0, 130};
  kda.qk_l2norm = true;
  kda.gate_in_kernel = true;
  CaseConfig gdn = small(Mechanism::gated_deltanet, 150, 4, 6);
  gdn.B = 2;
  gdn.layout = StateLayout::v_first;
  CaseConfig linear = small(Mechanism::linear_attention, 65, 3, 5);
  linear.initial_state = false;
  return {{"kda_varlen", kda}, {"gated_deltanet_v_first_batch2", gdn},
          {"linear_no_initial_state", linear, false}};
}

// The chunk states the reference forward records for `gc`'s inputs, in `dtype`.
HostTensor recorded_chunk_states(const GradCase& gc, DType dtype) {
  HostTensor o = gc.c.make_output(DType::f64), h = gc.c.make_chunk_states(dtype);
  ForwardArgs f = gc.c.args(o, nullptr);
  f.chunk_states = h.view;
  forward(f, gc.c.options, Schedule::reference);
  return h;
}

Grads run_backward_with_states(const GradCase& gc, const HostTensor& states) {
  Grads g;
  BackwardArgs a = gc.args();
  a.chunk_states = states.view;
  for (size_t i = 0; i < std::size(kGradInputs); ++i) {
    if (!(a.*kGradInputs[i].value).present()) continue;
    g.t[i] = converted(gc.c.*kGradInputs[i].tensor, DType::f64);
    g.t[i].fill(std::numeric_limits<double>::quiet_NaN());
    a.*kGradInputs[i].grad = g.t[i].view;
  }
  backward(a, gc.c.options, Schedule::reference);
  return g;
}

// The forward's own states, kept (float64, or float32 as a training loop keeps them), give
// the gradients of recomputing them, up to the states' rounding.
TEST(Backward, KeptChunkStatesGiveTheRecomputedGradients) {
  for (const GradConfig& config : kept_state_configs()) {
    const GradCase gc = make_grad_case(config);
    const Grads recomputed = run_backward(gc);
    for (DType dtype : {DType::f64, DType::f32}) {
      const Grads kept = run_backward_with_states(gc, recorded_chunk_states(gc, dtype));
      const double tol = dtype == DType::f64 ? 1e-12 : 1e-6;
      for (size_t i = 0; i < std::size(kGradInputs); ++i) {
        if (!kept.t[i].view.present()) continue;
        const double err = rel_error(kept.t[i].to_double(), recomputed.t[i].to_double());
        EXPECT_LE(err, tol) << config.name << ", " << dtype_name(dtype) << " states: d"
                            << kGradInputs[i].name << " relative error " << err;
      }
    }
  }
}

// The given states are what the backward uses: states recorded from another initial state
// give that forward's gradients (the initial state enters only through the states), not
// those of the initial state passed. dv and d_initial_state do not depend on the states
// (the adjoint recurrence is linear and independent of them), every other gradient does.
TEST(Backward, KeptChunkStatesAreTheOnesUsed) {
  int checked = 0;
  for (const GradConfig& config : kept_state_configs()) {
    if (!config.cfg.initial_state) continue;
    ++checked;
    const GradCase gc = make_grad_case(config);
    GradCase other = gc;
    std::vector<double> h0 = other.c.initial_state.to_double();
    for (double& x : h0) x = 2.0 * x + 0.5;
    other.c.initial_state.set(h0);
    const Grads want = run_backward(other), given_own = run_backward(gc);
    const Grads got = run_backward_with_states(gc, recorded_chunk_states(other, DType::f64));
    for (size_t i = 0; i < std::size(kGradInputs); ++i) {
      if (!got.t[i].view.present()) continue;
      const std::vector<double> g = got.t[i].to_double();
      EXPECT_LE(rel_error(g, want.t[i].to_double()), 1e-12) << config.name << " d" << kGradInputs[i].name;
      const std::string name = kGradInputs[i].name;
      if (name != "initial_state" && name != "v") {
        EXPECT_GT(rel_error(g, given_own.t[i].to_double()), 1e-6)
            << config.name << " d" << name << " ignores the given states";
      }
    }
  }
  EXPECT_EQ(checked, 2);
}

}  // namespace
}  // namespace flashdelta::testing
