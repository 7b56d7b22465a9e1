// The chunkwise CPU schedule against the fp64 reference on random problems: every
// mechanism, lengths around the chunk and sub-chunk boundaries, head sizes that are not
// multiples of the vector length, every chunk size, GVA, varlen, strong gates, fused
// transforms, dtypes, state layouts, strided views, in-place state and determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "test_util.h"

namespace flashdelta::testing {
namespace {

constexpr Mechanism kMechanisms[] = {
    Mechanism::linear_attention, Mechanism::simple_gla,     Mechanism::gla,
    Mechanism::deltanet,         Mechanism::gated_deltanet, Mechanism::kda};

// How a case is run: schedule options and the dtypes of the outputs.
struct RunConfig {
  int chunk_size = 64;
  int num_threads = 0;
  DType out_dtype = DType::f32;
  DType state_dtype = DType::f32;
};

struct Result {
  std::vector<double> o, state;
};

Result run(const Case& c, Schedule schedule, const RunConfig& rc) {
  HostTensor o = c.make_output(rc.out_dtype);
  HostTensor s(rc.state_dtype, c.state_shape());
  Options options = c.options;
  options.chunk_size = rc.chunk_size;
  options.num_threads = rc.num_threads;
  forward(c.args(o, &s), options, schedule);
  return {o.to_double(), s.to_double()};
}

std::string describe(const CaseConfig& c, const RunConfig& rc) {
  std::ostringstream os;
  os << mechanism_name(c.mechanism) << " " << dtype_name(c.dtype) << " B=" << c.B << " T=" << c.T
     << " H=" << c.H << " HV=" << c.HV << " K=" << c.K << " V=" << c.V << " C=" << rc.chunk_size
     << " threads=" << rc.num_threads << " gate_min=" << c.gate_min;
  if (!c.seqlens.empty()) {
    os << " seqlens=";
    for (int64_t l : c.seqlens) os << l << ",";
  }
  if (c.layout == StateLayout::v_first) os << " v_first";
  if (!c.initial_state) os << " no_initial_state";
  if (c.qk_l2norm) os << " qk_l2norm";
  if (c.beta_sigmoid) os << " beta_sigmoid" << (c.allow_neg_eigval ? "(neg)" : "");
  if (c.gate_in_kernel) {
    os << " gate_in_kernel";
    if (c.lower_bound) os << " lower_bound=" << *c.lower_bound;
    os << (c.with_A_log ? " A_log" : "") << (c.with_dt_bias ? " dt_bias" : "");
  }
  if (c.beta_value) os << " beta=" << *c.beta_value;
  return os.str();
}

// The chunk schedule matches the reference on o and the final state, within the input
// dtype's tolerance.
void expect_matches_reference(const Case& c, const RunConfig& rc) {
  const CaseConfig& cfg = c.cfg;
  const Result ref = run(c, Schedule::reference, rc);
  const Result got = run(c, Schedule::chunk, rc);
  const double tol = tolerance(cfg.dtype);
  const double err_o = rel_error(got.o, ref.o), err_s = rel_error(got.state, ref.state);
  EXPECT_LE(err_o, tol) << "output, " << describe(cfg, rc) << ", tolerance " << tol;
  EXPECT_LE(err_s, tol) << "final state, " << describe(cfg, rc) << ", tolerance " << tol;
}
void expect_matches_reference(const CaseConfig& cfg, const RunConfig& rc) {
  expect_matches_reference(make_case(cfg), rc);
}

// ---- The covering grid: every mechanism x length, head sizes, chunk sizes and GVA groups
// cycled so that each value appears several times; large heads only with short sequences.
struct GridCase {
  CaseConfig cfg;
  RunConfig rc;
};

std::vector<GridCase> grid() {
  const int64_t lengths[] = {1, 15, 16, 17, 63, 64, 65, 1000};
  const int64_t head_sizes[] = {16, 60, 64, 100, 128, 256};
  const int64_t small_heads[] = {16, 60, 64};
  const int chunks[] = {16, 32, 64, 128};
  const int64_t groups[] = {1, 2, 4};
  std::vector<GridCase> cases;
  int i = 0;
  for (Mechanism m : kMechanisms)
    for (int64_t T : lengths) {
      GridCase g;
      g.cfg.mechanism = m;
      g.cfg.T = T;
      g.cfg.seed = 100 + i;
      if (T >= 1000) {
        g.cfg.K = small_heads[i % 3];
        g.cfg.V = small_heads[(i + 1) % 3];
      } else {
        g.cfg.K = head_sizes[i % 6];
        g.cfg.V = head_sizes[(i * 5 + 2) % 6];
      }
      const int64_t group = groups[i % 3];
      g.cfg.H = T >= 1000 || g.cfg.K * g.cfg.V > 128 * 128 ? 1 : 2;
      g.cfg.HV = g.cfg.H * group;
      g.cfg.gate_min = -2.0;
      g.rc.chunk_size = chunks[(i / 2) % 4];
      cases.push_back(g);
      ++i;
    }
  return cases;
}

void PrintTo(const GridCase& g, std::ostream* os) { *os << describe(g.cfg, g.rc); }

class ChunkGrid : public ::testing::TestWithParam<GridCase> {};

TEST_P(ChunkGrid, MatchesReference) { expect_matches_reference(GetParam().cfg, GetParam().rc); }

INSTANTIATE_TEST_SUITE_P(Chunk, ChunkGrid, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<GridCase>& info) {
                           const CaseConfig& c = info.param.cfg;
                           return std::string(mechanism_name(c.mechanism)) + "_T" +
                                  std::to_string(c.T) + "_K" + std::to_string(c.K) + "_V" +
                                  std::to_string(c.V) + "_G" + std::to_string(c.HV / c.H) + "_C" +
                                  std::to_string(info.param.rc.chunk_size);
                         });

// ---- Targeted cases.

TEST(Chunk, VarlenWithEmptyAndOneTokenSequences) {
  int i = 0;
  for (Mechanism m : kMechanisms) {
    CaseConfig cfg;
    cfg.mechanism = m;
    cfg.seqlens = {0, 1, 37, 0, 130, 1, 64};
    cfg.T = 233;
    cfg.H = 1;
    cfg.HV = 2;
    cfg.K = 60;
    cfg.V = 32;
    cfg.seed = 7 + i;
    RunConfig rc;
    rc.chunk_size = i % 2 ? 32 : 64;
    expect_matches_reference(cfg, rc);
    ++i;
  }
}

TEST(Chunk, TinyAndOddHeadSizes) {
  const int64_t sizes[][2] = {{1, 1}, {3, 5}, {17, 33}, {255, 7}};
  int i = 0;
  for (const auto& kv : sizes)
    for (Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::linear_attention}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 37;
      cfg.K = kv[0];
      cfg.V = kv[1];
      cfg.seed = 200 + i++;
      expect_matches_reference(cfg, RunConfig{16});
    }
}

TEST(Chunk, StrongGates) {
  // -8 per step: the factorised form k e^-Gamma overflows past ~11 tokens, so the diagonal
  // blocks take the exact path and the off-diagonal blocks rely on their reference points.
  for (Mechanism m :
       {Mechanism::kda, Mechanism::gla, Mechanism::gated_deltanet, Mechanism::simple_gla})
    for (int chunk : {16, 32, 64, 128}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 150;
      cfg.K = 32;
      cfg.V = 48;
      cfg.gate_min = -8.0;
      cfg.seed = 11 + chunk;
      RunConfig rc;
      rc.chunk_size = chunk;
      expect_matches_reference(cfg, rc);
    }
}

TEST(Chunk, ExtremeGatesStayFinite) {
  for (Mechanism m :
       {Mechanism::kda, Mechanism::gla, Mechanism::gated_deltanet, Mechanism::simple_gla})
    for (int chunk : {16, 64, 128}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 140;
      cfg.K = 16;
      cfg.V = 16;
      cfg.gate_min = -1000.0;
      cfg.seed = 3 + chunk;
      RunConfig rc;
      rc.chunk_size = chunk;
      const Case c = make_case(cfg);
      const Result got = run(c, Schedule::chunk, rc);
      bool finite = true;
      for (double x : got.o) finite = finite && std::isfinite(x);
      for (double x : got.state) finite = finite && std::isfinite(x);
      EXPECT_TRUE(finite) << describe(cfg, rc);
      expect_matches_reference(cfg, rc);
    }
}

TEST(Chunk, OneSidedBlockDecayAndResetGates) {
  for (Mechanism m : {Mechanism::kda, Mechanism::gla, Mechanism::gated_deltanet})
    for (const bool one_sided : {true, false})
      for (int chunk : {16, 64}) {
        SCOPED_TRACE(one_sided ? "one-sided block decay" : "reset gates of -inf");
        const Case c = stressed_gate_case(m, one_sided, 77);
        RunConfig rc;
        rc.chunk_size = chunk;
        expect_matches_reference(c, rc);
      }
}

TEST(Chunk, GateActivationInKernel) {
  struct Form {
    std::optional<double> lower_bound;
    bool with_A_log;
  };
  for (const Form f : {Form{{}, true}, Form{-5.0, true}, Form{-3.0, false}})
    for (Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::gla}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 70;
      cfg.K = 64;
      cfg.V = 64;
      cfg.HV = 4;
      cfg.gate_in_kernel = true;
      cfg.lower_bound = f.lower_bound;
      cfg.with_A_log = f.with_A_log;
      cfg.seed = 21;
      expect_matches_reference(cfg, RunConfig{});
    }
}

TEST(Chunk, BetaZeroAndOne) {
  for (double beta : {0.0, 1.0})
    for (Mechanism m : {Mechanism::deltanet, Mechanism::gated_deltanet, Mechanism::kda}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 80;
      cfg.K = 64;
      cfg.V = 16;
      cfg.beta_value = beta;
      cfg.seed = 31;
      expect_matches_reference(cfg, RunConfig{16});
    }
}

TEST(Chunk, L2NormAndBetaSigmoid) {
  for (bool neg : {false, true})
    for (Mechanism m : kMechanisms) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 90;
      cfg.K = 100;
      cfg.V = 60;
      cfg.qk_l2norm = true;
      cfg.beta_sigmoid = traits(m).delta;
      cfg.allow_neg_eigval = neg && traits(m).delta;
      cfg.seed = 41;
      expect_matches_reference(cfg, RunConfig{32});
    }
}

TEST(Chunk, EveryDtype) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::gla}) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.dtype = dtype;
      cfg.T = 100;
      cfg.K = 64;
      cfg.V = 48;
      cfg.seed = 51;
      RunConfig rc;
      rc.out_dtype = dtype;
      // A float32 state would cap a float64 run at float32 precision.
      rc.state_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
      expect_matches_reference(cfg, rc);
    }
}

TEST(Chunk, StateLayoutsAndAbsentStates) {
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    for (bool initial : {true, false}) {
      CaseConfig cfg;
      cfg.T = 40;
      cfg.K = 60;
      cfg.V = 100;
      cfg.layout = layout;
      cfg.initial_state = initial;
      cfg.seed = 61;
      expect_matches_reference(cfg, RunConfig{32});
    }
  // Without a final state the output is unchanged.
  CaseConfig cfg;
  cfg.T = 40;
  cfg.seed = 62;
  const Case c = make_case(cfg);
  HostTensor with = c.make_output(DType::f32), without = c.make_output(DType::f32);
  HostTensor state = c.make_state();
  forward(c.args(with, &state), c.options, Schedule::chunk);
  forward(c.args(without, nullptr), c.options, Schedule::chunk);
  EXPECT_EQ(with.to_double(), without.to_double());
}

TEST(Chunk, StridedQueryAndOutput) {
  // q read from a [B, H, T, K] buffer, o written into a [B, HV, T, V] buffer, both viewed
  // as [B, T, H(V), *].
  CaseConfig cfg;
  cfg.B = 2;
  cfg.T = 33;
  cfg.H = 2;
  cfg.HV = 4;
  cfg.K = 60;
  cfg.V = 16;
  cfg.seed = 71;
  const Case c = make_case(cfg);
  const auto q = c.q.to_double();
  HostTensor q_bhtk(DType::f32, {cfg.B, cfg.H, cfg.T, cfg.K});
  std::vector<double> buf(q.size());
  for (int64_t b = 0; b < cfg.B; ++b)
    for (int64_t t = 0; t < cfg.T; ++t)
      for (int64_t h = 0; h < cfg.H; ++h)
        for (int64_t i = 0; i < cfg.K; ++i)
          buf[((b * cfg.H + h) * cfg.T + t) * cfg.K + i] =
              q[((b * cfg.T + t) * cfg.H + h) * cfg.K + i];
  q_bhtk.set(buf);
  HostTensor o_bhtv(DType::f32, {cfg.B, cfg.HV, cfg.T, cfg.V});
  HostTensor state = c.make_state();
  ForwardArgs a = c.args(o_bhtv, &state);
  a.q = q_bhtk.view;
  std::swap(a.q.shape[1], a.q.shape[2]);
  std::swap(a.q.stride[1], a.q.stride[2]);
  std::swap(a.o.shape[1], a.o.shape[2]);
  std::swap(a.o.stride[1], a.o.stride[2]);
  Options options = c.options;
  options.chunk_size = 16;
  forward(a, options, Schedule::chunk);
  const Result ref = run(c, Schedule::reference, RunConfig{16});
  const auto o = o_bhtv.to_double();
  std::vector<double> o_bthv(o.size());
  for (int64_t b = 0; b < cfg.B; ++b)
    for (int64_t t = 0; t < cfg.T; ++t)
      for (int64_t h = 0; h < cfg.HV; ++h)
        for (int64_t j = 0; j < cfg.V; ++j)
          o_bthv[((b * cfg.T + t) * cfg.HV + h) * cfg.V + j] =
              o[((b * cfg.HV + h) * cfg.T + t) * cfg.V + j];
  EXPECT_LE(rel_error(o_bthv, ref.o), tolerance(DType::f32));
  EXPECT_LE(rel_error(state.to_double(), ref.state), tolerance(DType::f32));
}

TEST(Chunk, InPlaceState) {
  for (int threads : {1, 8}) {  // 3 items: fused order with 1 thread, phased with 8
    CaseConfig cfg;
    cfg.seqlens = {20, 0, 45};
    cfg.T = 65;
    cfg.H = 1;
    cfg.HV = 1;
    cfg.K = 32;
    cfg.V = 32;
    cfg.seed = 81;
    const Case c = make_case(cfg);
    RunConfig rc;
    rc.chunk_size = 16;
    rc.num_threads = threads;
    const Result ref = run(c, Schedule::reference, rc);
    HostTensor o = c.make_output(DType::f32);
    HostTensor state = c.initial_state;
    ForwardArgs a = c.args(o, nullptr);
    a.initial_state = state.view;
    a.final_state = state.view;
    Options options = c.options;
    options.chunk_size = rc.chunk_size;
    options.num_threads = threads;
    forward(a, options, Schedule::chunk);
    EXPECT_LE(rel_error(o.to_double(), ref.o), tolerance(DType::f32)) << describe(cfg, rc);
    EXPECT_LE(rel_error(state.to_double(), ref.state), tolerance(DType::f32)) << describe(cfg, rc);
  }
}

TEST(Chunk, PhasedOrderOverManyWindows) {
  // Fewer items than threads: steps 1-3 and 5 run in parallel over chunks, in windows.
  CaseConfig cfg;
  cfg.seqlens = {0, 1, 700, 17};
  cfg.T = 718;
  cfg.H = 1;
  cfg.HV = 1;
  cfg.K = 48;
  cfg.V = 32;
  cfg.seed = 91;
  RunConfig rc;
  rc.chunk_size = 16;
  rc.num_threads = 8;
  expect_matches_reference(cfg, rc);
}

TEST(Chunk, EveryCompiledSimdTarget) {
  // The schedule dispatches at run time; force each compiled target this CPU supports in
  // turn (AVX-512, AVX2, scalar: 16, 8 and 1 float lanes).
  const int64_t supported = hwy::SupportedTargets();
  for (int64_t target : {int64_t{HWY_AVX3}, int64_t{HWY_AVX2}, int64_t{HWY_SCALAR}}) {
    if ((supported & target) == 0) continue;
    hwy::SetSupportedTargetsForTest(target);
    int i = 0;
    for (Mechanism m : kMechanisms) {
      CaseConfig cfg;
      cfg.mechanism = m;
      cfg.T = 40;
      cfg.K = 60;
      cfg.V = 24;
      cfg.gate_min = i % 2 ? -8.0 : -1.0;
      cfg.seed = 111 + i;
      RunConfig rc;
      rc.chunk_size = 32;
      SCOPED_TRACE(hwy::TargetName(target));
      expect_matches_reference(cfg, rc);
      ++i;
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

// The fused transforms run vectorised in the schedules (cpu/token_transforms-inl.h), in
// float and (float64 inputs) double: every gate form on head sizes with and without a
// partial last vector, raw gates and betas from small to huge (exp underflow, softplus(x) =
// x, saturated sigmoids), on every compiled SIMD target.
TEST(Chunk, VectorisedTransformsOnEveryTarget) {
  const int64_t supported = hwy::SupportedTargets();
  for (int64_t target : {int64_t{HWY_AVX3}, int64_t{HWY_AVX2}, int64_t{HWY_SCALAR}}) {
    if ((supported & target) == 0) continue;
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    for (DType dtype : {DType::f32, DType::f64})
      for (int64_t K : {1, 7, 33, 128})
        for (std::optional<double> lower_bound : {std::optional<double>(), {-5.0}})
          for (double spread : {1.0, 40.0}) {
            const Case c = make_transform_case(dtype, K, lower_bound, spread);
            SCOPED_TRACE("raw gates and betas x" + std::to_string(spread));
            expect_matches_reference(c, RunConfig{16});
          }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Chunk, DeterministicAcrossRunsAndThreadCounts) {
  // One item (phased order with two threads) and several (fused order either way).
  for (int64_t hv : {1, 4}) {
    CaseConfig cfg;
    cfg.mechanism = Mechanism::kda;
    cfg.T = 300;
    cfg.H = 1;
    cfg.HV = hv;
    cfg.K = 64;
    cfg.V = 64;
    cfg.seed = 101;
    const Case c = make_case(cfg);
    RunConfig rc;
    rc.chunk_size = 16;
    rc.num_threads = 1;
    const Result one = run(c, Schedule::chunk, rc);
    rc.num_threads = 2;
    const Result two = run(c, Schedule::chunk, rc);
    const Result again = run(c, Schedule::chunk, rc);
    EXPECT_EQ(one.o, two.o) << "HV=" << hv;
    EXPECT_EQ(one.state, two.state) << "HV=" << hv;
    EXPECT_EQ(two.o, again.o) << "HV=" << hv;
    EXPECT_EQ(two.state, again.state) << "HV=" << hv;
  }
}

}  // namespace
}  // namespace flashdelta::testing
