// `flashdelta grad` end to end: input files (the forward's inputs, d_o, and as the case has
// them d_final_state and the kept chunk_states) for several mechanisms and options, the
// output file compared bit for bit with the library's backward run in-process on the same
// tensors; with --device cuda on a GPU, the chunkwise CUDA backward against the same within
// its tolerance; and its errors (one line, exit status 1, an existing --out untouched).
#include <gtest/gtest.h>
#ifdef FLASHDELTA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cli_harness.h"

namespace flashdelta::testing {
namespace {

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

struct GradCase {
  std::string name;
  CaseConfig cfg;
  bool d_final_state = true;
  bool chunk_states = false;  // the file holds the forward's kept states
};

void PrintTo(const GradCase& gc, std::ostream* os) { *os << gc.name; }

std::vector<GradCase> grad_cases() {
  std::vector<GradCase> cases;
  auto add = [&](std::string name, bool d_final, bool chunk_states, auto&& configure) {
    GradCase gc{std::move(name), CaseConfig{}, d_final, chunk_states};
    gc.cfg.T = 29;
    gc.cfg.K = 8;
    gc.cfg.V = 6;
    gc.cfg.seed = 2000 + cases.size();
    configure(gc.cfg);
    cases.push_back(std::move(gc));
  };
  add("kda_f64_varlen_lower_bound_v_first", true, false, [](CaseConfig& c) {
    c.dtype = DType::f64;
    c.seqlens = {10, 0, 19};
    c.gate_in_kernel = true;
    c.lower_bound = -5.0;
    c.layout = StateLayout::v_first;
  });
  add("gated_deltanet_bf16_gva_l2norm_sigmoid_no_d_final", false, false, [](CaseConfig& c) {
    c.mechanism = Mechanism::gated_deltanet;
    c.dtype = DType::bf16;
    c.H = 1;
    c.HV = 2;
    c.qk_l2norm = true;
    c.beta_sigmoid = true;
  });
  add("linear_f32_no_initial_state", true, false, [](CaseConfig& c) {
    c.mechanism = Mechanism::linear_attention;
    c.initial_state = false;
  });
  add("kda_f32_kept_chunk_states", true, true, [](CaseConfig& c) {
    c.T = 150;
    c.seqlens = {70, 80};
    c.gate_in_kernel = true;
  });
  return cases;
}

// The file's tensors for a case: its inputs, d_o in the inputs' dtype, and as asked
// d_final_state (float32) and the chunk states the reference forward records (float64).
io::TensorMap grad_file(const Case& c, const GradCase& gc) {
  io::TensorMap m = case_tensors(c);
  std::mt19937_64 rng(gc.cfg.seed + 7);
  HostTensor d_o = c.make_output(gc.cfg.dtype);
  d_o.set(random_normal(rng, d_o.numel()));
  m["d_o"] = owned(d_o.view);
  if (gc.d_final_state) {
    HostTensor d_final = c.make_state();
    d_final.set(random_normal(rng, d_final.numel()));
    m["d_final_state"] = owned(d_final.view);
  }
  if (gc.chunk_states) {
    HostTensor o = c.make_output(DType::f64), h = c.make_chunk_states(DType::f64);
    ForwardArgs f = c.args(o, nullptr);
    f.chunk_states = h.view;
    forward(f, c.options, Schedule::reference);
    m["chunk_states"] = owned(h.view);
  }
  return m;
}

// The in-process backward on the file's tensors: the gradient of every differentiable input
// present, float32 (float64 for float64 inputs), by the name the command writes.
io::TensorMap expected_gradients(io::TensorMap file, const Options& options) {
  const auto view = [&](const char* name) {
    const auto it = file.find(name);
    return it == file.end() ? TensorView{} : it->second.view();
  };
  BackwardArgs a;
  a.q = view("q"), a.k = view("k"), a.v = view("v"), a.g = view("g"), a.beta = view("beta");
  a.initial_state = view("initial_state"), a.cu_seqlens = view("cu_seqlens");
  a.A_log = view("A_log"), a.dt_bias = view("dt_bias"), a.d_o = view("d_o");
  a.d_final_state = view("d_final_state"), a.chunk_states = view("chunk_states");
  const std::tuple<const char*, const char*, TensorView BackwardArgs::*> grads[] = {
      {"q", "dq", &BackwardArgs::dq},
      {"k", "dk", &BackwardArgs::dk},
      {"v", "dv", &BackwardArgs::dv},
      {"g", "dg", &BackwardArgs::dg},
      {"beta", "dbeta", &BackwardArgs::dbeta},
      {"initial_state", "d_initial_state", &BackwardArgs::d_initial_state},
      {"A_log", "dA_log", &BackwardArgs::dA_log},
      {"dt_bias", "ddt_bias", &BackwardArgs::ddt_bias}};
  io::TensorMap out;
  for (const auto& [input, name, field] : grads) {
    const auto it = file.find(input);
    if (it == file.end()) continue;
    const DType dtype = it->second.dtype == DType::f64 ? DType::f64 : DType::f32;
    a.*field = out.emplace(name, io::OwnedTensor(dtype, it->second.shape)).first->second.view();
  }
  backward(a, options, Schedule::reference);
  return out;
}

class GradFile : public CliTest, public ::testing::WithParamInterface<GradCase> {};

TEST_P(GradFile, MatchesTheLibrarysBackward) {
  const GradCase& gc = GetParam();
  const Case c = make_case(gc.cfg);
  const io::TensorMap file = grad_file(c, gc);
  io::write_safetensors(path("in.safetensors").string(), file);
  std::vector<std::string> args = {"grad", "--in", path("in.safetensors").string(), "--out",
                                   path("out.safetensors").string()};
  const std::vector<std::string> opts = option_flags(gc.cfg);
  args.insert(args.end(), opts.begin(), opts.end());
  const CliResult r = cli(args);
  ASSERT_EQ(r.exit_code, 0) << "stderr: " << r.err;
  EXPECT_EQ(r.err, "");

  io::TensorMap want = expected_gradients(file, c.options);
  io::TensorMap got = io::read_safetensors(path("out.safetensors").string());
  ASSERT_EQ(got.size(), want.size());
  ASSERT_GE(got.size(), 3u);  // at least dq, dk, dv
  for (auto& [name, tensor] : want) {
    ASSERT_EQ(got.count(name), 1u) << "missing " << name;
    io::OwnedTensor& g = got.at(name);
    EXPECT_EQ(g.dtype, tensor.dtype) << name;
    EXPECT_EQ(g.shape, tensor.shape) << name;
    const std::vector<double> values = to_double(g);
    for (double x : values) ASSERT_TRUE(std::isfinite(x)) << name;
    EXPECT_EQ(values, to_double(tensor)) << name << " differs from the in-process backward";
  }
}

INSTANTIATE_TEST_SUITE_P(Cli, GradFile, ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<GradCase>& info) {
                           return info.param.name;
                         });

bool has_gpu() {
#ifdef FLASHDELTA_WITH_CUDA
  int gpus = 0;
  return cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0;
#else
  return false;
#endif
}

using GradCommand = CliTest;

// dA_log and dt_bias's gradients sum a term per token (and channel) of both signs, so their
// sums can be far smaller than their terms: their error is measured against the largest sum
// of the terms' magnitudes, which the reference's dg gives. With x = g + dt_bias and no lower
// bound, the gate is -e^A_log softplus(x): ddt_bias[h, c] sums dg[t, h, c] over the tokens,
// dA_log[h] sums dg[t, h, c] softplus(x) / sigmoid(x) over tokens and channels.
// gate_parameter_terms(..., magnitudes) returns those sums of |term| ([HV] and [HV * K]);
// without `magnitudes`, the sums themselves (the gradients).
std::pair<std::vector<double>, std::vector<double>> gate_parameter_terms(io::TensorMap& file,
                                                                         io::TensorMap& grads,
                                                                         bool magnitudes) {
  const std::vector<double> dg = to_double(grads.at("dg")), g = to_double(file.at("g")),
                            bias = to_double(file.at("dt_bias"));
  const std::vector<int64_t>& shape = file.at("g").shape;  // [B, T, HV, K]
  const int64_t HV = shape[2], K = shape[3];
  std::vector<double> a_log(HV, 0.0), dt(HV * K, 0.0);
  for (size_t e = 0; e < dg.size(); ++e) {
    const int64_t hk = static_cast<int64_t>(e) % (HV * K);
    const double x = g[e] + bias[hk], softplus = std::log1p(std::exp(x));
    const double d = magnitudes ? std::abs(dg[e]) : dg[e];
    dt[hk] += d;
    a_log[hk / K] += d * softplus * (1.0 + std::exp(-x));
  }
  return {a_log, dt};
}

double param_term_scale(const std::string& name, io::TensorMap& file, io::TensorMap& want) {
  const auto [a_log, dt] = gate_parameter_terms(file, want, true);
  const std::vector<double>& terms = name == "dA_log" ? a_log : dt;
  return *std::max_element(terms.begin(), terms.end());
}

// The derivation param_term_scale rests on, checked on the reference (no GPU needed): the
// gate parameters' gradients are the sums of those terms.
TEST(GradTerms, GateParameterGradientsSumTheGateGradient) {
  const GradCase gc = grad_cases().back();
  ASSERT_TRUE(gc.cfg.gate_in_kernel && !gc.cfg.lower_bound) << gc.name;
  io::TensorMap file = grad_file(make_case(gc.cfg), gc);
  io::TensorMap want = expected_gradients(file, make_case(gc.cfg).options);
  const auto [a_log, dt] = gate_parameter_terms(file, want, false);
  EXPECT_LT(rel_error(a_log, to_double(want.at("dA_log"))), 1e-5);
  EXPECT_LT(rel_error(dt, to_double(want.at("ddt_bias"))), 1e-5);
}

// --device cuda runs the chunkwise CUDA backward (tf32 products, float32 sums): the reference's
// gradients to 2e-3 of the largest (tests/cuda/test_cuda_backward.cpp's bound), the gate
// parameters' to 2e-3 of their terms' scale, the kept chunk states included.
TEST_F(GradCommand, OnTheGpuMatchesTheReference) {
  if (!has_gpu()) GTEST_SKIP() << "needs a CUDA build and a GPU";
  for (const GradCase& gc : grad_cases()) {
    if (gc.cfg.dtype == DType::f64) continue;  // float64 inputs: the CPU reference's domain
    const Case c = make_case(gc.cfg);
    io::TensorMap file = grad_file(c, gc);
    io::write_safetensors(path("in.safetensors").string(), file);
    std::vector<std::string> args = {"grad", "--device", "cuda", "--in",
                                     path("in.safetensors").string(), "--out",
                                     path("out.safetensors").string()};
    const std::vector<std::string> opts = option_flags(gc.cfg);
    args.insert(args.end(), opts.begin(), opts.end());
    const CliResult r = cli(args);
    ASSERT_EQ(r.exit_code, 0) << gc.name << ": " << r.err;
    io::TensorMap want = expected_gradients(file, c.options);
    io::TensorMap got = io::read_safetensors(path("out.safetensors").string());
    for (auto& [name, tensor] : want) {
      ASSERT_EQ(got.count(name), 1u) << gc.name << ": missing " << name;
      const bool param = name == "dA_log" || name == "ddt_bias";
      if (param) {
        ASSERT_TRUE(gc.cfg.gate_in_kernel && !gc.cfg.lower_bound) << gc.name;
      }
      const std::vector<double> a = to_double(got.at(name)), b = to_double(tensor);
      double err = rel_error(a, b);
      if (param) {
        double worst = 0;
        for (size_t e = 0; e < a.size(); ++e) worst = std::max(worst, std::abs(a[e] - b[e]));
        err = worst / param_term_scale(name, file, want);
      }
      EXPECT_LE(err, 2e-3) << gc.name << ": " << name << " error";
    }
  }
}

// Without a CUDA build, or without a GPU, --device cuda fails with a message naming cuda.
TEST_F(GradCommand, OnCudaWithoutAGpuFailsNamingIt) {
  if (has_gpu()) GTEST_SKIP() << "this machine runs --device cuda";
  GradCase gc{"small", CaseConfig{}};
  gc.cfg.T = 9;
  io::write_safetensors(path("in.safetensors").string(), grad_file(make_case(gc.cfg), gc));
  const CliResult r = cli({"grad", "--device", "cuda", "--mechanism", "kda", "--in",
                           path("in.safetensors").string(), "--out",
                           path("out.safetensors").string()});
  EXPECT_EQ(r.exit_code, kExitError) << r.err;
  EXPECT_NE(r.err.find("cuda"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(path("out.safetensors")));
}

class GradRejects : public CliTest {
 protected:
  // Runs `grad` on `file` with --out already in place; expects `code`, stderr naming each of
  // `words` and --out unchanged.
  void expect_rejected(const io::TensorMap& file, const std::vector<std::string>& flags, int code,
                       const std::vector<std::string>& words) {
    const std::string previous = "previous output";
    io::write_safetensors(path("in.safetensors").string(), file);
    write_file(path("out.safetensors"), previous);
    std::vector<std::string> args = {"grad", "--in", path("in.safetensors").string(), "--out",
                                     path("out.safetensors").string()};
    args.insert(args.end(), flags.begin(), flags.end());
    const CliResult r = cli(args);
    EXPECT_EQ(r.exit_code, code) << "stderr: " << r.err;
    for (const std::string& w : words)
      EXPECT_NE(r.err.find(w), std::string::npos) << "stderr should name '" << w << "': " << r.err;
    if (code == kExitError) {
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
    }
    EXPECT_EQ(read_file(path("out.safetensors")), previous) << "--out was modified";
  }

  static GradCase small() {
    GradCase gc{"small", CaseConfig{}};
    gc.cfg.T = 9;
    gc.cfg.K = 8;
    gc.cfg.V = 8;
    return gc;
  }
};

TEST_F(GradRejects, WithoutTheOutputGradient) {
  const GradCase gc = small();
  io::TensorMap file = grad_file(make_case(gc.cfg), gc);
  file.erase("d_o");
  expect_rejected(file, {"--mechanism", "kda"}, kExitError, {"'d_o'"});
}

TEST_F(GradRejects, UnknownTensorName) {
  const GradCase gc = small();
  io::TensorMap file = grad_file(make_case(gc.cfg), gc);
  file["dq"] = file.at("q");  // a gradient is an output, never read
  expect_rejected(file, {"--mechanism", "kda"}, kExitError, {"'dq'", "d_o"});
}

TEST_F(GradRejects, MisShapedKeptStates) {
  const GradCase gc = small();
  io::TensorMap file = grad_file(make_case(gc.cfg), gc);
  io::OwnedTensor states = file.at("initial_state");
  states.shape[0] = 2;  // the problem has one 64-token chunk
  states.bytes.resize(states.bytes.size() * 2);
  file["chunk_states"] = states;
  expect_rejected(file, {"--mechanism", "kda"}, kExitError, {"'chunk_states'"});
}

TEST_F(GradRejects, WithoutAMechanism) {
  const GradCase gc = small();
  expect_rejected(grad_file(make_case(gc.cfg), gc), {}, kExitUsage, {"--mechanism"});
}

}  // namespace
}  // namespace flashdelta::testing
