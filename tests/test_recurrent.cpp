// The recurrent schedule (forward and decode) against the fp64 reference on random inputs.
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "decode_case.h"
#include "test_util.h"

namespace flashdelta::testing {
namespace {

// The schedule computes in fp32, so fp64 inputs are held to the fp32 tolerance.
double schedule_tolerance(DType dtype) {
  return tolerance(dtype == DType::f64 ? DType::f32 : dtype);
}

// ---------------------------------------------------------------------------------------
// Forward

struct Outputs {
  std::vector<double> o, state;
};

// Runs one schedule; o in `o_dtype`, final state float32 (or `state_dtype`).
Outputs run_forward(const Case& c, Schedule schedule, DType o_dtype, DType state_dtype = DType::f32,
                    int threads = 0) {
  HostTensor o = c.make_output(o_dtype);
  HostTensor s(state_dtype, c.state_shape());
  Options options = c.options;
  options.num_threads = threads;
  forward(c.args(o, &s), options, schedule);
  return {o.to_double(), s.to_double()};
}

void expect_matches_reference(const Case& c, const std::string& what) {
  const Outputs ref = run_forward(c, Schedule::reference, DType::f64);
  const Outputs fast = run_forward(c, Schedule::recurrent, c.cfg.dtype);
  const double tol = schedule_tolerance(c.cfg.dtype);
  EXPECT_LT(rel_error(fast.o, ref.o), tol) << what << ": output relative error, tolerance " << tol
                                           << " (" << dtype_name(c.cfg.dtype) << ")";
  EXPECT_LT(rel_error(fast.state, ref.state), tol)
      << what << ": final state relative error, tolerance " << tol << " ("
      << dtype_name(c.cfg.dtype) << ")";
}

std::string describe(const CaseConfig& c) {
  std::string s = std::string(mechanism_name(c.mechanism)) + "_T" + std::to_string(c.T) + "_K" +
                  std::to_string(c.K) + "_V" + std::to_string(c.V) + "_H" + std::to_string(c.H) +
                  "_HV" + std::to_string(c.HV);
  if (c.layout == StateLayout::v_first) s += "_vfirst";
  if (!c.initial_state) s += "_zero_state";
  return s;
}

// The covering grid: every mechanism at every length, with K / V, GVA group and state layout
// rotating so each value appears several times; big heads only with short sequences.
std::vector<CaseConfig> forward_grid() {
  const Mechanism mechanisms[] = {
      Mechanism::linear_attention, Mechanism::simple_gla,     Mechanism::gla,
      Mechanism::deltanet,         Mechanism::gated_deltanet, Mechanism::kda};
  const int64_t lengths[] = {1, 15, 16, 17, 63, 64, 65, 1000};
  const int64_t dims[][2] = {{16, 16},  {60, 100}, {64, 64},   {100, 60}, {128, 128},
                             {256, 16}, {16, 256}, {128, 60},  {60, 256}, {256, 100},
                             {64, 128}, {100, 16}, {256, 256}, {16, 64}};
  const int64_t heads[][2] = {{2, 2}, {1, 2}, {1, 4}};  // (H, HV): GVA group 1, 2, 4
  std::vector<CaseConfig> grid;
  size_t rotation = 0;
  for (const Mechanism m : mechanisms)
    for (const int64_t T : lengths) {
      CaseConfig c;
      c.mechanism = m;
      c.T = T;
      // Next (K, V) in the rotation whose cost T * K * V * HV stays small.
      for (;; ++rotation) {
        const auto& kv = dims[rotation % std::size(dims)];
        if (T * kv[0] * kv[1] <= 5'000'000) {
          c.K = kv[0];
          c.V = kv[1];
          break;
        }
      }
      c.H = heads[rotation % 3][0];
      c.HV = heads[rotation % 3][1];
      c.layout = rotation % 2 ? StateLayout::v_first : StateLayout::k_first;
      c.initial_state = rotation % 5 != 4;
      c.seed = 100 + rotation;
      ++rotation;
      grid.push_back(c);
    }
  return grid;
}

class RecurrentGrid : public ::testing::TestWithParam<CaseConfig> {};

TEST_P(RecurrentGrid, MatchesReference) {
  expect_matches_reference(make_case(GetParam()), describe(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Forward, RecurrentGrid, ::testing::ValuesIn(forward_grid()),
                         [](const ::testing::TestParamInfo<CaseConfig>& info) {
                           return describe(info.param);
                         });

const Mechanism kGated[] = {Mechanism::simple_gla, Mechanism::gla, Mechanism::gated_deltanet,
                            Mechanism::kda};
const Mechanism kDelta[] = {Mechanism::deltanet, Mechanism::gated_deltanet, Mechanism::kda};

TEST(Recurrent, VarlenWithEmptyAndOneTokenSequences) {
  for (const Mechanism m : kAllMechanisms) {
    CaseConfig cfg;
    cfg.mechanism = m;
    cfg.seqlens = {5, 0, 1, 40, 0, 17, 1};
    cfg.T = 64;
    cfg.K = 64;
    cfg.V = 60;
    cfg.H = 1;
    cfg.HV = 2;
    expect_matches_reference(make_case(cfg), std::string("varlen ") + mechanism_name(m));
  }
}

TEST(Recurrent, EmptySequencePassesStateThroughExactly) {
  CaseConfig cfg;
  cfg.seqlens = {3, 0, 2};
  cfg.T = 5;
  cfg.K = 20;
  cfg.V = 36;
  const Case c = make_case(cfg);
  const Outputs r = run_forward(c, Schedule::recurrent, DType::f32);
  const std::vector<double> s0 = c.initial_state.to_double();
  const size_t per_seq = static_cast<size_t>(cfg.HV * cfg.K * cfg.V);
  for (size_t i = 0; i < per_seq; ++i) ASSERT_EQ(r.state[per_seq + i], s0[per_seq + i]) << i;
}

TEST(Recurrent, EmptyBatchAndEmptySequences) {
  // B = 0: nothing to do. T = 0: every state passes through unchanged.
  for (const int64_t B : {0, 3}) {
    CaseConfig cfg;
    cfg.B = B;
    cfg.T = B == 0 ? 5 : 0;
    const Case c = make_case(cfg);
    const Outputs fast = run_forward(c, Schedule::recurrent, DType::f32);
    const Outputs ref = run_forward(c, Schedule::reference, DType::f64);
    EXPECT_EQ(fast.o.size(), ref.o.size());
    EXPECT_EQ(fast.state, c.initial_state.to_double()) << "B=" << B;
  }
}

TEST(Recurrent, StrongAndWeakGates) {
  // -8 per step rebases the rescaled state nearly every token; -1e-3 never rebases before
  // the last of 1000 tokens, so the rescaled state accumulates over the whole sequence.
  for (const double gate_min : {-8.0, -1e-3})
    for (const Mechanism m : kGated) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.gate_min = gate_min;
      cfg.T = gate_min < -1 ? 300 : 1000;
      cfg.K = 33;
      cfg.V = 48;
      expect_matches_reference(
          make_case(cfg), std::string(mechanism_name(m)) + " gate_min " + std::to_string(gate_min));
    }
}

TEST(Recurrent, GateActivationInKernel) {
  struct Form {
    std::optional<double> lower_bound;
    bool with_A_log, with_dt_bias;
  };
  const Form forms[] = {{std::nullopt, true, true},
                        {std::nullopt, true, false},
                        {-5.0, true, true},
                        {-5.0, false, true},
                        {-2.0, false, false}};
  for (const Mechanism m : kGated)
    for (const Form& f : forms) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.gate_in_kernel = true;
      cfg.lower_bound = f.lower_bound;
      cfg.with_A_log = f.with_A_log;
      cfg.with_dt_bias = f.with_dt_bias;
      cfg.T = 70;
      cfg.K = 24;
      cfg.V = 40;
      cfg.H = 1;
      cfg.HV = 2;
      expect_matches_reference(make_case(cfg),
                               std::string(mechanism_name(m)) + " gate_in_kernel lower_bound=" +
                                   (f.lower_bound ? std::to_string(*f.lower_bound) : "none") +
                                   " A_log=" + std::to_string(f.with_A_log) +
                                   " dt_bias=" + std::to_string(f.with_dt_bias));
    }
}

TEST(Recurrent, BetaZeroAndOne) {
  for (const double beta : {0.0, 1.0})
    for (const Mechanism m : kDelta) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.beta_value = beta;
      cfg.T = 50;
      cfg.K = 48;
      cfg.V = 20;
      expect_matches_reference(make_case(cfg),
                               std::string(mechanism_name(m)) + " beta=" + std::to_string(beta));
    }
}

TEST(Recurrent, FusedInputTransforms) {
  for (const Mechanism m : kAllMechanisms)
    for (const bool neg_eig : {false, true}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.qk_l2norm = true;
      cfg.beta_sigmoid = traits(m).delta;
      cfg.allow_neg_eigval = cfg.beta_sigmoid && neg_eig;
      cfg.T = 40;
      cfg.K = 61;
      cfg.V = 28;
      expect_matches_reference(make_case(cfg),
                               std::string(mechanism_name(m)) +
                                   " l2norm, beta sigmoid, neg_eigval=" + std::to_string(neg_eig));
    }
}

TEST(Recurrent, EachInputDtype) {
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (const Mechanism m : {Mechanism::gla, Mechanism::gated_deltanet, Mechanism::kda}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.dtype = dtype;
      cfg.T = 65;
      cfg.K = 64;
      cfg.V = 100;
      cfg.H = 1;
      cfg.HV = 2;
      expect_matches_reference(make_case(cfg),
                               std::string(mechanism_name(m)) + " " + dtype_name(dtype));
    }
}

TEST(Recurrent, BothStateLayoutsAndFloat64States) {
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    for (const DType state_dtype : {DType::f32, DType::f64}) {
      CaseConfig cfg;
      cfg.layout = layout;
      cfg.T = 33;
      cfg.K = 60;
      cfg.V = 100;
      Case c = make_case(cfg);
      HostTensor s0(state_dtype, c.state_shape());
      s0.set(c.initial_state.to_double());
      c.initial_state = s0;
      const std::string what = std::string(layout == StateLayout::k_first ? "k_first" : "v_first") +
                               " " + dtype_name(state_dtype) + " state";
      const Outputs ref = run_forward(c, Schedule::reference, DType::f64, state_dtype);
      const Outputs fast = run_forward(c, Schedule::recurrent, DType::f32, state_dtype);
      const double tol = tolerance(DType::f32);
      EXPECT_LT(rel_error(fast.o, ref.o), tol) << what << ": output, tolerance " << tol;
      EXPECT_LT(rel_error(fast.state, ref.state), tol) << what << ": state, tolerance " << tol;
    }
}

TEST(Recurrent, StridedQueryAndOutput) {
  CaseConfig cfg;
  cfg.H = cfg.HV = 2;
  cfg.T = 21;
  cfg.K = 40;
  cfg.V = 24;
  const Case c = make_case(cfg);
  // q as a [B, T, H, K] view of a [B, H, T, K] buffer.
  const std::vector<double> q = c.q.to_double();
  HostTensor qt(DType::f32, {cfg.B, cfg.H, cfg.T, cfg.K});
  std::vector<double> buf(q.size());
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; ++h)
      for (int64_t i = 0; i < cfg.K; ++i)
        buf[static_cast<size_t>((h * cfg.T + t) * cfg.K + i)] =
            q[static_cast<size_t>((t * cfg.H + h) * cfg.K + i)];
  qt.set(buf);
  // o with every element 3 floats apart, inside a buffer poisoned with NaN.
  HostTensor o_buf(DType::f32, {cfg.B * cfg.T * cfg.HV * cfg.V * 3});
  o_buf.fill(std::nan(""));
  HostTensor o = c.make_output(DType::f32);
  HostTensor s(DType::f32, c.state_shape());
  ForwardArgs a = c.args(o, &s);
  a.o.data = o_buf.view.data;
  for (int d = 0; d < 4; ++d) a.o.stride[d] *= 3;
  a.q = qt.view;
  std::swap(a.q.shape[1], a.q.shape[2]);
  std::swap(a.q.stride[1], a.q.stride[2]);
  forward(a, c.options, Schedule::recurrent);

  const Outputs ref = run_forward(c, Schedule::reference, DType::f64);
  const std::vector<double> all = o_buf.to_double();
  std::vector<double> strided_o(all.size() / 3), gaps;
  for (size_t e = 0; e < strided_o.size(); ++e) {
    strided_o[e] = all[3 * e];
    gaps.push_back(all[3 * e + 1]);
    gaps.push_back(all[3 * e + 2]);
  }
  const double tol = tolerance(DType::f32);
  EXPECT_LT(rel_error(strided_o, ref.o), tol) << "strided output, tolerance " << tol;
  EXPECT_LT(rel_error(s.to_double(), ref.state), tol) << "state, tolerance " << tol;
  for (const double x : gaps) ASSERT_TRUE(std::isnan(x)) << "wrote between strided elements";
}

TEST(Recurrent, FinalStateMayAliasInitialState) {
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    CaseConfig cfg;
    cfg.layout = layout;
    cfg.seqlens = {9, 0, 30};
    cfg.T = 39;
    cfg.K = 36;
    cfg.V = 72;
    Case c = make_case(cfg);
    const Outputs ref = run_forward(c, Schedule::reference, DType::f64);
    HostTensor o = c.make_output(DType::f32);
    ForwardArgs a = c.args(o, nullptr);
    a.final_state = a.initial_state;  // in place
    forward(a, c.options, Schedule::recurrent);
    const double tol = tolerance(DType::f32);
    EXPECT_LT(rel_error(o.to_double(), ref.o), tol) << "in-place output, tolerance " << tol;
    EXPECT_LT(rel_error(c.initial_state.to_double(), ref.state), tol)
        << "in-place state, tolerance " << tol;
  }
}

TEST(Recurrent, WithoutFinalState) {
  CaseConfig cfg;
  cfg.mechanism = Mechanism::gated_deltanet;
  cfg.T = 30;
  const Case c = make_case(cfg);
  HostTensor ref = c.make_output(DType::f64), fast = c.make_output(DType::f32);
  forward(c.args(ref, nullptr), c.options, Schedule::reference);
  forward(c.args(fast, nullptr), c.options, Schedule::recurrent);
  EXPECT_LT(rel_error(fast.to_double(), ref.to_double()), tolerance(DType::f32));
}

TEST(Recurrent, DeterministicAcrossRunsAndThreadCounts) {
  CaseConfig cfg;
  cfg.seqlens = {70, 3, 0, 41};
  cfg.T = 114;
  cfg.K = 64;
  cfg.V = 80;
  cfg.H = 2;
  cfg.HV = 4;
  cfg.gate_min = -6;
  const Case c = make_case(cfg);
  const Outputs a = run_forward(c, Schedule::recurrent, DType::f32, DType::f32, 2);
  const Outputs b = run_forward(c, Schedule::recurrent, DType::f32, DType::f32, 2);
  const Outputs one = run_forward(c, Schedule::recurrent, DType::f32, DType::f32, 1);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.state, b.state);
  EXPECT_EQ(a.o, one.o);
  EXPECT_EQ(a.state, one.state);
}

TEST(Recurrent, ReportsItsSimdTarget) {
  const std::string name = cpu_simd_target();
  EXPECT_FALSE(name.empty());
  EXPECT_NE(name, "Unknown");
}

// ---------------------------------------------------------------------------------------
// Decode


TEST(RecurrentDecode, InPlaceSlotsWithPaddingRows) {
  uint64_t seed = 1;
  for (const Mechanism m : kAllMechanisms)
    for (const int64_t T : {1, 2, 4, 8}) {
      const CaseConfig cfg = decode_config(m, 4, T, 64, 48, seed++);
      const DecodeCase d = make_decode_case(cfg, 9, DType::f32, {{7}, {-1}, {2}, {4}});
      expect_decode_matches_reference(d,
                                      std::string(mechanism_name(m)) + " T=" + std::to_string(T));
    }
}

TEST(RecurrentDecode, PaddingRowWritesZerosOnly) {
  const CaseConfig cfg = decode_config(Mechanism::kda, 2, 3, 16, 20, 5);
  const DecodeCase d = make_decode_case(cfg, 3, DType::f32, {{-1}, {-1}});
  HostTensor pool = d.pool;
  HostTensor o = d.c.make_output(DType::f32);
  o.fill(kPoison);
  decode(d.args(o, pool), d.c.options, Schedule::recurrent);
  for (const double x : o.to_double()) ASSERT_EQ(x, 0.0);
  EXPECT_EQ(pool.bytes, d.pool.bytes);
}

TEST(RecurrentDecode, PerTokenSlotsWithAcceptedTokens) {
  uint64_t seed = 50;
  for (const Mechanism m : {Mechanism::gla, Mechanism::deltanet, Mechanism::kda})
    for (const int64_t T : {2, 4}) {
      const CaseConfig cfg = decode_config(m, 3, T, 32, 40, seed++);
      // Row 0 resumes from its 2nd slot and rewrites it; row 1 skips writing one token;
      // row 2 is padding (its start slot, at a = 1, is -1).
      std::vector<std::vector<int64_t>> slots = {{0, 1, 2, 3}, {4, -1, 5, 6}, {-1, 7, 8, 9}};
      for (auto& row : slots) row.resize(static_cast<size_t>(std::max<int64_t>(T, 4)));
      const DecodeCase d = make_decode_case(cfg, 12, DType::f32, slots, {2, 1, 1});
      expect_decode_matches_reference(
          d, std::string(mechanism_name(m)) + " per-token T=" + std::to_string(T));
    }
}

TEST(RecurrentDecode, BFloat16PoolOddSizesVFirst) {
  uint64_t seed = 80;
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    for (const Mechanism m : {Mechanism::gated_deltanet, Mechanism::kda, Mechanism::simple_gla}) {
      CaseConfig cfg = decode_config(m, 3, 2, 33, 47, seed++);
      cfg.layout = layout;
      for (const DType pool : {DType::f32, DType::bf16}) {
        const DecodeCase d = make_decode_case(cfg, 6, pool, {{5}, {0}, {3}});
        expect_decode_matches_reference(
            d, std::string(mechanism_name(m)) + " pool " + dtype_name(pool) +
                   (layout == StateLayout::v_first ? " v_first" : " k_first"));
      }
    }
}

TEST(RecurrentDecode, VarlenRowsAndBFloat16Inputs) {
  const DecodeCase d = varlen_fused_decode_case();
  expect_decode_matches_reference(d, "varlen kda bf16 inputs");
}

TEST(RecurrentDecode, Deterministic) {
  const CaseConfig cfg = decode_config(Mechanism::kda, 4, 2, 64, 64, 7);
  const DecodeCase d = make_decode_case(cfg, 4, DType::f32, {{0}, {1}, {2}, {3}});
  HostTensor pool_a = d.pool, pool_b = d.pool;
  HostTensor o_a = d.c.make_output(DType::f32), o_b = d.c.make_output(DType::f32);
  decode(d.args(o_a, pool_a), d.c.options, Schedule::recurrent);
  decode(d.args(o_b, pool_b), d.c.options, Schedule::recurrent);
  EXPECT_EQ(o_a.bytes, o_b.bytes);
  EXPECT_EQ(pool_a.bytes, pool_b.bytes);
}

// Every SIMD target this CPU runs gives the reference's results, not only the best one:
// Highway's test hook restricts the dispatch to one target at a time.
TEST(RecurrentTargets, EachSupportedTargetMatchesReference) {
  const int64_t supported = hwy::SupportedTargets();
  std::vector<std::string> seen;
  for (const int64_t target : {int64_t{HWY_AVX3}, int64_t{HWY_AVX2}, int64_t{HWY_SSE4},
                               int64_t{HWY_EMU128 | HWY_SCALAR}}) {
    if ((supported & target) == 0) continue;
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = cpu_simd_target();
    seen.push_back(name);

    CaseConfig kda;
    kda.seqlens = {20, 0, 37};
    kda.T = 57;
    kda.K = 33;
    kda.V = 48;
    kda.gate_min = -6;
    expect_matches_reference(make_case(kda), name + ": kda varlen");
    CaseConfig gla;
    gla.mechanism = Mechanism::gla;
    gla.layout = StateLayout::v_first;
    gla.T = 40;
    gla.K = 60;
    gla.V = 100;
    expect_matches_reference(make_case(gla), name + ": gla v_first");
    for (const int64_t V : {48, 47}) {  // in place where V is whole vectors, else tiles
      const CaseConfig cfg = decode_config(Mechanism::gated_deltanet, 3, 2, 40, V, 11);
      expect_decode_matches_reference(make_decode_case(cfg, 5, DType::f32, {{4}, {-1}, {0}}),
                                      name + ": decode V=" + std::to_string(V));
    }
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the CPU's own targets
  EXPECT_FALSE(seen.empty());
  std::string list;
  for (const std::string& name : seen) list += name + " ";
  std::cout << "[          ] targets checked: " << list << "\n";
}

// The fused transforms run vectorised in the schedules (cpu/token_transforms-inl.h): every
// gate form on head sizes with and without a partial last vector, raw gates and betas from
// small to huge (exp underflow, softplus(x) = x, saturated sigmoids), on every SIMD target.
TEST(RecurrentTargets, VectorisedTransformsMatchReference) {
  const int64_t supported = hwy::SupportedTargets();
  for (const int64_t target : {int64_t{HWY_AVX3}, int64_t{HWY_AVX2}, int64_t{HWY_SSE4},
                               int64_t{HWY_EMU128 | HWY_SCALAR}}) {
    if ((supported & target) == 0) continue;
    hwy::SetSupportedTargetsForTest(target);
    for (const int64_t K : {1, 7, 33, 128})
      for (const std::optional<double> lower_bound : {std::optional<double>(), {-5.0}})
        for (const double spread : {1.0, 40.0}) {
          const Case c = make_transform_case(DType::f32, K, lower_bound, spread);
          expect_matches_reference(c, std::string(cpu_simd_target()) + ": K=" + std::to_string(K) +
                                          (lower_bound ? " lower_bound" : " softplus") +
                                          " spread=" + std::to_string(spread));
        }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace flashdelta::testing
