// `flashdelta run` end to end: input files for every mechanism over a spread of options,
// dtypes and schedules, the output file compared with the reference run in-process; and
// the built-in check with no arguments.
#include <gtest/gtest.h>

#include <algorithm>

#include "cli_harness.h"

namespace flashdelta::testing {
namespace {

struct RunCase {
  std::string name;
  CaseConfig cfg;
  Schedule schedule = Schedule::chunk;
  std::vector<std::string> extra_flags;  // execution settings: chunk size, threads, device
  bool chunk_states = false;             // --chunk-states: the file also holds chunk_states
};

// gtest prints a failing parameter with this, instead of its bytes.
void PrintTo(const RunCase& rc, std::ostream* os) { *os << rc.name; }

std::vector<RunCase> run_cases() {
  std::vector<RunCase> cases;
  auto add = [&](std::string name, Schedule schedule, std::vector<std::string> extra,
                 auto&& configure) {
    RunCase rc{std::move(name), CaseConfig{}, schedule, std::move(extra)};
    rc.chunk_states = std::find(rc.extra_flags.begin(), rc.extra_flags.end(),
                                "--chunk-states") != rc.extra_flags.end();
    rc.cfg.T = 29;
    rc.cfg.seed = 1000 + cases.size();
    configure(rc.cfg);
    cases.push_back(std::move(rc));
  };
  add("linear_f32_reference_no_state", Schedule::reference, {}, [](CaseConfig& c) {
    c.mechanism = Mechanism::linear_attention;
    c.B = 2;
    c.K = 16;
    c.V = 24;
    c.initial_state = false;
  });
  add("simple_gla_bf16_recurrent_gva_scale", Schedule::recurrent, {"--threads", "1"},
      [](CaseConfig& c) {
        c.mechanism = Mechanism::simple_gla;
        c.dtype = DType::bf16;
        c.H = 2;
        c.HV = 4;
        c.scale = 0.5;
      });
  add("gla_f16_chunk16_varlen", Schedule::chunk, {"--chunk-size", "16"}, [](CaseConfig& c) {
    c.mechanism = Mechanism::gla;
    c.dtype = DType::f16;
    c.seqlens = {5, 0, 19, 1};
    c.T = 25;
  });
  add("kda_f32_chunk16_varlen_chunk_states", Schedule::chunk,
      {"--chunk-size", "16", "--chunk-states"}, [](CaseConfig& c) {
        c.mechanism = Mechanism::kda;
        c.seqlens = {130, 0, 64, 1, 65};
        c.T = 260;
        c.K = 16;
        c.V = 24;
      });
  add("gated_deltanet_f32_recurrent_chunk_states_v_first", Schedule::recurrent,
      {"--chunk-states"}, [](CaseConfig& c) {
        c.mechanism = Mechanism::gated_deltanet;
        c.layout = StateLayout::v_first;
        c.B = 2;
        c.T = 129;
        c.K = 16;
        c.V = 8;
      });
  add("gla_f32_recurrent_lower_bound_with_A_log", Schedule::recurrent, {}, [](CaseConfig& c) {
    c.mechanism = Mechanism::gla;
    c.gate_in_kernel = true;
    c.lower_bound = -2.0;
    c.with_dt_bias = false;
  });
  add("deltanet_f32_chunk32_l2norm_neg_eigval", Schedule::chunk, {"--chunk-size", "32"},
      [](CaseConfig& c) {
        c.mechanism = Mechanism::deltanet;
        c.T = 70;
        c.qk_l2norm = true;
        c.beta_sigmoid = true;
        c.allow_neg_eigval = true;
      });
  add("gated_deltanet_f32_recurrent_softplus_gate_v_first", Schedule::recurrent,
      {"--device", "cpu"}, [](CaseConfig& c) {
        c.mechanism = Mechanism::gated_deltanet;
        c.gate_in_kernel = true;
        c.layout = StateLayout::v_first;
        c.H = 1;
        c.HV = 2;
      });
  add("gated_deltanet_f16_chunk_varlen_l2norm", Schedule::chunk, {}, [](CaseConfig& c) {
    c.mechanism = Mechanism::gated_deltanet;
    c.dtype = DType::f16;
    c.seqlens = {40, 3};
    c.T = 43;
    c.qk_l2norm = true;
  });
  add("kda_bf16_chunk_lower_bound_without_A_log", Schedule::chunk, {"--threads", "2"},
      [](CaseConfig& c) {
        c.mechanism = Mechanism::kda;
        c.dtype = DType::bf16;
        c.gate_in_kernel = true;
        c.lower_bound = -5.0;
        c.with_A_log = false;
        c.qk_l2norm = true;
        c.beta_sigmoid = true;
      });
  add("kda_f32_reference_odd_dims_gva", Schedule::reference, {}, [](CaseConfig& c) {
    c.mechanism = Mechanism::kda;
    c.H = 1;
    c.HV = 3;
    c.K = 24;
    c.V = 40;
  });
  add("kda_f32_chunk128_several_chunks", Schedule::chunk, {"--chunk-size", "128"},
      [](CaseConfig& c) {
        c.mechanism = Mechanism::kda;
        c.T = 150;
        c.K = 32;
        c.V = 32;
        c.gate_min = -4.0;
      });
  return cases;
}

using RunCommand = CliTest;

class RunFile : public CliTest, public ::testing::WithParamInterface<RunCase> {};

TEST_P(RunFile, MatchesTheReference) {
  const RunCase& rc = GetParam();
  const Case c = make_case(rc.cfg);
  io::write_safetensors(path("in.safetensors").string(), case_tensors(c));

  std::vector<std::string> args = {"run",
                                   "--in",
                                   path("in.safetensors").string(),
                                   "--out",
                                   path("out.safetensors").string(),
                                   "--schedule",
                                   schedule_name(rc.schedule)};
  const std::vector<std::string> opts = option_flags(rc.cfg);
  args.insert(args.end(), opts.begin(), opts.end());
  args.insert(args.end(), rc.extra_flags.begin(), rc.extra_flags.end());
  const CliResult r = cli(args);
  ASSERT_EQ(r.exit_code, 0) << "stderr: " << r.err;
  EXPECT_EQ(r.err, "");

  HostTensor o_ref = c.make_output(DType::f64);
  HostTensor state_ref = c.make_state();
  HostTensor chunk_states_ref = c.make_chunk_states(DType::f64);
  ForwardArgs ref_args = c.args(o_ref, &state_ref);
  if (rc.chunk_states) ref_args.chunk_states = chunk_states_ref.view;
  forward(ref_args, c.options, Schedule::reference);

  io::TensorMap out = io::read_safetensors(path("out.safetensors").string());
  ASSERT_EQ(out.size(), rc.chunk_states ? 3u : 2u);
  ASSERT_EQ(out.count("o"), 1u);
  ASSERT_EQ(out.count("final_state"), 1u);
  io::OwnedTensor& o = out.at("o");
  io::OwnedTensor& state = out.at("final_state");
  EXPECT_EQ(o.dtype, rc.cfg.dtype) << "o has the dtype of v";
  EXPECT_EQ(o.shape, (std::vector<int64_t>{rc.cfg.B, rc.cfg.T, rc.cfg.HV, rc.cfg.V}));
  EXPECT_EQ(state.dtype, DType::f32);
  EXPECT_EQ(state.shape, c.state_shape());

  const double tol = tolerance(rc.cfg.dtype);
  const double err_o = rel_error(to_double(o), o_ref.to_double());
  const double err_state = rel_error(to_double(state), state_ref.to_double());
  EXPECT_LE(err_o, tol) << "o: relative error " << err_o << ", tolerance " << tol << " ("
                        << dtype_name(rc.cfg.dtype) << ")";
  EXPECT_LE(err_state, tol) << "final_state: relative error " << err_state << ", tolerance " << tol
                            << " (" << dtype_name(rc.cfg.dtype) << ")";
  if (rc.chunk_states) {
    ASSERT_EQ(out.count("chunk_states"), 1u);
    io::OwnedTensor& chunk_states = out.at("chunk_states");
    EXPECT_EQ(chunk_states.dtype, DType::f32);
    std::vector<int64_t> shape = c.state_shape();
    shape[0] = c.chunk_count();
    EXPECT_EQ(chunk_states.shape, shape);
    const double err = rel_error(to_double(chunk_states), chunk_states_ref.to_double());
    EXPECT_LE(err, tol) << "chunk_states: relative error " << err << ", tolerance " << tol;
  }
}

INSTANTIATE_TEST_SUITE_P(Cli, RunFile, ::testing::ValuesIn(run_cases()),
                         [](const ::testing::TestParamInfo<RunCase>& info) {
                           return info.param.name;
                         });

TEST_F(RunCommand, ReplacesAnExistingOutput) {
  CaseConfig cfg;
  cfg.mechanism = Mechanism::deltanet;
  const Case c = make_case(cfg);
  io::write_safetensors(path("in.safetensors").string(), case_tensors(c));
  write_file(path("out.safetensors"), "an older file, longer than nothing");
  const CliResult r = cli({"run", "--in", path("in.safetensors").string(), "--out",
                           path("out.safetensors").string(), "--mechanism", "deltanet"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const io::TensorMap out = io::read_safetensors(path("out.safetensors").string());
  EXPECT_EQ(out.count("o"), 1u);
  // The atomic writer leaves no temporary file beside the output.
  EXPECT_EQ(listing(), (std::set<std::string>{"in.safetensors", "out.safetensors"}));
}

TEST_F(RunCommand, WithoutArgumentsChecksBothSchedulesOfKdaAndGdn) {
  const CliResult r = cli({"run"});
  ASSERT_EQ(r.exit_code, 0) << "stdout:\n" << r.out << "stderr:\n" << r.err;
  for (const char* word : {"kda", "gated_deltanet", "reference", "recurrent", "chunk"})
    EXPECT_NE(r.out.find(word), std::string::npos) << "missing '" << word << "' in:\n" << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace flashdelta::testing
