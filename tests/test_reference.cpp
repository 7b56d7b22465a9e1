// The reference against facts of the math that can be checked by hand.
#include <gtest/gtest.h>

#include <cmath>

#include "test_util.h"

namespace flashdelta::testing {
namespace {

// Runs the reference and returns (o, final_state) as doubles.
struct Result {
  std::vector<double> o, state;
};
Result run_reference(const Case& c) {
  HostTensor o = c.make_output(DType::f64);
  HostTensor s = c.make_state();
  forward(c.args(o, &s), c.options, Schedule::reference);
  return {o.to_double(), s.to_double()};
}

TEST(Reference, DeltaWriteWithBetaOneReadsBackV) {
  // One token, q = k (unit), scale 1, beta 1: o = S'^T k = v exactly, whatever S0 was.
  CaseConfig cfg;
  cfg.mechanism = Mechanism::deltanet;
  cfg.T = 1;
  cfg.K = 8;
  cfg.V = 5;
  cfg.H = cfg.HV = 1;
  cfg.beta_value = 1.0;
  cfg.scale = 1.0;
  cfg.dtype = DType::f64;
  Case c = make_case(cfg);
  c.q = c.k;
  const Result r = run_reference(c);
  const std::vector<double> v = c.v.to_double();
  for (int j = 0; j < 5; ++j) EXPECT_NEAR(r.o[j], v[j], 1e-12) << "value " << j;
}

TEST(Reference, OrthogonalQueryIsUnaffectedByTheWrite) {
  // k = e0, q = e1: the write changes S only in row 0, so o = S0^T q = row 1 of S0.
  CaseConfig cfg;
  cfg.mechanism = Mechanism::deltanet;
  cfg.T = 1;
  cfg.K = 4;
  cfg.V = 3;
  cfg.H = cfg.HV = 1;
  cfg.scale = 1.0;
  cfg.dtype = DType::f64;
  Case c = make_case(cfg);
  c.k.set({1, 0, 0, 0});
  c.q.set({0, 1, 0, 0});
  const Result r = run_reference(c);
  const std::vector<double> s0 = c.initial_state.to_double();
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(r.o[j], s0[1 * 3 + j], 1e-12);
  // Row 1 of the state is unchanged; row 0 now reads back beta-corrected v.
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(r.state[1 * 3 + j], s0[1 * 3 + j], 1e-12);
}

TEST(Reference, LinearAttentionIsCausalSumOfOuterProducts) {
  CaseConfig cfg;
  cfg.mechanism = Mechanism::linear_attention;
  cfg.T = 6;
  cfg.K = 5;
  cfg.V = 4;
  cfg.H = cfg.HV = 1;
  cfg.initial_state = false;
  cfg.dtype = DType::f64;
  const Case c = make_case(cfg);
  const Result r = run_reference(c);
  const auto q = c.q.to_double(), k = c.k.to_double(), v = c.v.to_double();
  const double scale = 1.0 / std::sqrt(5.0);
  for (int t = 0; t < 6; ++t)
    for (int j = 0; j < 4; ++j) {
      double expect = 0;
      for (int s = 0; s <= t; ++s) {
        double qk = 0;
        for (int i = 0; i < 5; ++i) qk += q[t * 5 + i] * k[s * 5 + i];
        expect += scale * qk * v[s * 4 + j];
      }
      EXPECT_NEAR(r.o[t * 4 + j], expect, 1e-12) << "t=" << t << " j=" << j;
    }
}

TEST(Reference, ScalarGateDecaysTheState) {
  // simple GLA, one token with v = 0: the state is S0 * exp(g), o = scale * S^T q.
  CaseConfig cfg;
  cfg.mechanism = Mechanism::simple_gla;
  cfg.T = 1;
  cfg.K = 3;
  cfg.V = 2;
  cfg.H = cfg.HV = 1;
  cfg.dtype = DType::f64;
  Case c = make_case(cfg);
  c.v.fill(0.0);
  c.g.set({-0.7});
  const Result r = run_reference(c);
  const auto s0 = c.initial_state.to_double();
  // The final state is float32: compare to its precision.
  for (size_t i = 0; i < s0.size(); ++i) EXPECT_NEAR(r.state[i], s0[i] * std::exp(-0.7), 1e-7);
}

TEST(Reference, ZeroLengthSequencePassesStateThrough) {
  CaseConfig cfg;
  cfg.seqlens = {3, 0, 2};
  cfg.T = 5;
  const Case c = make_case(cfg);
  const Result r = run_reference(c);
  const auto s0 = c.initial_state.to_double();
  const int64_t per_seq = cfg.HV * cfg.K * cfg.V;
  for (int64_t i = 0; i < per_seq; ++i) EXPECT_EQ(r.state[per_seq + i], s0[per_seq + i]);
}

TEST(Reference, VarlenEqualsSeparateRuns) {
  CaseConfig cfg;
  cfg.seqlens = {4, 1, 7};
  cfg.T = 12;
  const Case packed = make_case(cfg);
  const Result all = run_reference(packed);
  // Run the third sequence alone from its slice of the inputs.
  CaseConfig one = cfg;
  one.seqlens.clear();
  one.T = 7;
  Case alone = make_case(one);
  auto slice = [&](const HostTensor& src, HostTensor& dst, int64_t t0, int64_t row) {
    const auto d = src.to_double();
    dst.set(std::vector<double>(d.begin() + t0 * row, d.begin() + (t0 + 7) * row));
  };
  slice(packed.q, alone.q, 5, cfg.H * cfg.K);
  slice(packed.k, alone.k, 5, cfg.H * cfg.K);
  slice(packed.v, alone.v, 5, cfg.HV * cfg.V);
  slice(packed.g, alone.g, 5, cfg.HV * cfg.K);
  slice(packed.beta, alone.beta, 5, cfg.HV);
  const auto s0 = packed.initial_state.to_double();
  const int64_t per_seq = cfg.HV * cfg.K * cfg.V;
  alone.initial_state.set(std::vector<double>(s0.begin() + 2 * per_seq, s0.end()));
  const Result r = run_reference(alone);
  for (int64_t i = 0; i < 7 * cfg.HV * cfg.V; ++i)
    EXPECT_NEAR(all.o[5 * cfg.HV * cfg.V + i], r.o[i], 1e-6);
  for (int64_t i = 0; i < per_seq; ++i) EXPECT_NEAR(all.state[2 * per_seq + i], r.state[i], 1e-6);
}

TEST(Reference, GroupedValueHeadsShareKeys) {
  // HV = 2H: value head hv reads key head hv / 2; duplicating q, k to H = HV is the same.
  CaseConfig cfg;
  cfg.H = 1;
  cfg.HV = 2;
  cfg.T = 5;
  cfg.dtype = DType::f64;
  const Case gva = make_case(cfg);
  CaseConfig full = cfg;
  full.H = 2;
  Case dup = make_case(full);
  auto dup_heads = [&](const HostTensor& src, HostTensor& dst) {
    const auto d = src.to_double();
    std::vector<double> out;
    for (int64_t t = 0; t < cfg.T; ++t)
      for (int rep = 0; rep < 2; ++rep) out.insert(out.end(), d.begin() + t * cfg.K, d.begin() + (t + 1) * cfg.K);
    dst.set(out);
  };
  dup_heads(gva.q, dup.q);
  dup_heads(gva.k, dup.k);
  dup.v = gva.v;
  dup.g = gva.g;
  dup.beta = gva.beta;
  dup.initial_state = gva.initial_state;
  const Result a = run_reference(gva), b = run_reference(dup);
  EXPECT_LT(rel_error(a.o, b.o), 1e-14);
  EXPECT_LT(rel_error(a.state, b.state), 1e-14);
}

TEST(Reference, VFirstLayoutIsTheTranspose) {
  CaseConfig cfg;
  cfg.K = 6;
  cfg.V = 3;
  cfg.dtype = DType::f64;
  const Case kf = make_case(cfg);
  CaseConfig vcfg = cfg;
  vcfg.layout = StateLayout::v_first;
  Case vf = make_case(vcfg);
  const auto s0 = kf.initial_state.to_double();
  std::vector<double> t(s0.size());
  for (int64_t nh = 0; nh < kf.N * cfg.HV; ++nh)
    for (int64_t i = 0; i < cfg.K; ++i)
      for (int64_t j = 0; j < cfg.V; ++j)
        t[nh * cfg.K * cfg.V + j * cfg.K + i] = s0[nh * cfg.K * cfg.V + i * cfg.V + j];
  vf.initial_state.set(t);
  const Result a = run_reference(kf), b = run_reference(vf);
  EXPECT_LT(rel_error(a.o, b.o), 1e-14);
  for (int64_t nh = 0; nh < kf.N * cfg.HV; ++nh)
    for (int64_t i = 0; i < cfg.K; ++i)
      for (int64_t j = 0; j < cfg.V; ++j)
        EXPECT_EQ(a.state[nh * cfg.K * cfg.V + i * cfg.V + j], b.state[nh * cfg.K * cfg.V + j * cfg.K + i]);
}

TEST(Reference, GateActivationMatchesItsFormula) {
  // gate_in_kernel (softplus form and lower-bound form) equals the precomputed gate.
  for (const std::optional<double> lb : {std::optional<double>{}, std::optional<double>{-5.0}}) {
    CaseConfig cfg;
    cfg.gate_in_kernel = true;
    cfg.lower_bound = lb;
    cfg.dtype = DType::f64;
    const Case raw = make_case(cfg);
    CaseConfig pre = cfg;
    pre.gate_in_kernel = false;
    pre.lower_bound.reset();
    Case c = make_case(pre);
    const auto g = raw.g.to_double(), A = raw.A_log.to_double(), bias = raw.dt_bias.to_double();
    std::vector<double> act(g.size());
    for (size_t e = 0; e < g.size(); ++e) {
      const int64_t i = static_cast<int64_t>(e % cfg.K), hv = static_cast<int64_t>((e / cfg.K) % cfg.HV);
      const double x = g[e] + bias[hv * cfg.K + i];
      act[e] = lb ? *lb / (1 + std::exp(-std::exp(A[hv]) * x))
                  : -std::exp(A[hv]) * std::log1p(std::exp(x));
    }
    c.g.set(act);
    c.q = raw.q;
    c.k = raw.k;
    c.v = raw.v;
    c.beta = raw.beta;
    c.initial_state = raw.initial_state;
    const Result a = run_reference(raw), b = run_reference(c);
    EXPECT_LT(rel_error(a.o, b.o), 1e-12);
    EXPECT_LT(rel_error(a.state, b.state), 1e-12);
  }
}

TEST(Reference, StridedInputsReadCorrectly) {
  // q given as a transposed view of a [B, H, T, K] buffer equals the contiguous q.
  CaseConfig cfg;
  cfg.H = cfg.HV = 2;
  cfg.T = 4;
  cfg.dtype = DType::f64;
  const Case c = make_case(cfg);
  const auto q = c.q.to_double();
  HostTensor qt(DType::f64, {cfg.B, cfg.H, cfg.T, cfg.K});
  std::vector<double> buf(q.size());
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; ++h)
      for (int64_t i = 0; i < cfg.K; ++i)
        buf[(h * cfg.T + t) * cfg.K + i] = q[(t * cfg.H + h) * cfg.K + i];
  qt.set(buf);
  HostTensor o1 = c.make_output(DType::f64), o2 = c.make_output(DType::f64);
  forward(c.args(o1, nullptr), c.options, Schedule::reference);
  ForwardArgs a = c.args(o2, nullptr);
  a.q = qt.view;
  std::swap(a.q.shape[1], a.q.shape[2]);
  std::swap(a.q.stride[1], a.q.stride[2]);
  forward(a, c.options, Schedule::reference);
  EXPECT_EQ(o1.to_double(), o2.to_double());
}

}  // namespace
}  // namespace flashdelta::testing
