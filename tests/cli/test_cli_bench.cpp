// `flashdelta bench --quick`: runs the tiny sweep and writes JSON with the machine details,
// the settings and one entry per measured case. Checks structure and sanity, not speed.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_harness.h"

namespace flashdelta::testing {
namespace {

using nlohmann::json;

void expect_timing(const json& r) {
  const json& t = r.at("timing");
  EXPECT_GE(t.at("samples").get<int>(), 2) << r.dump();
  EXPECT_GT(t.at("min_ms").get<double>(), 0) << r.dump();
  EXPECT_GE(t.at("median_ms").get<double>(), t.at("min_ms").get<double>()) << r.dump();
}

using BenchCommand = CliTest;

TEST_F(BenchCommand, QuickWritesValidJson) {
  const CliResult r =
      cli({"bench", "--quick", "--repeats", "2", "--json", path("b.json").string()});
  ASSERT_EQ(r.exit_code, 0) << "stderr:\n" << r.err;
  EXPECT_NE(r.out.find("GFLOP/s"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("[1/"), std::string::npos) << "progress goes to stderr: " << r.err;

  json j;
  ASSERT_NO_THROW(j = json::parse(read_file(path("b.json")))) << read_file(path("b.json"));
  EXPECT_EQ(j.at("flashdelta_version"), version());
  EXPECT_NE(j.at("command_line").get<std::string>().find("--quick"), std::string::npos);
  EXPECT_EQ(j.at("date").get<std::string>().size(), 20u)
      << "ISO 8601 UTC, e.g. 2025-01-31T12:00:00Z";
  const json& m = j.at("machine");
  EXPECT_FALSE(m.at("cpu_model").get<std::string>().empty());
  EXPECT_EQ(m.at("simd_target"), cpu_simd_target());
  EXPECT_GE(m.at("threads").get<int>(), 1);
  EXPECT_GT(m.at("peak_gflops_fp32").get<double>(), 0);
  EXPECT_TRUE(j.at("formulas").is_object());

  // Two mechanisms x two input forms (fused, prepared) x two schedules of the quick case.
  const json& prefill = j.at("prefill");
  ASSERT_EQ(prefill.size(), 8u) << prefill.dump(2);
  for (const json& p : prefill) {
    expect_timing(p);
    const json& s = p.at("shape");
    const double tokens = s.at("B").get<double>() * s.at("T").get<double>();
    EXPECT_NEAR(p.at("tokens_per_s").get<double>() * p.at("timing").at("median_ms").get<double>(),
                tokens * 1e3, tokens * 1e3 * 1e-9)
        << "tokens/s = B T / median";
    EXPECT_GT(p.at("gflops").get<double>(), 0);
    EXPECT_NEAR(p.at("fraction_of_peak").get<double>() * m.at("peak_gflops_fp32").get<double>(),
                p.at("gflops").get<double>(), 1e-9 * p.at("gflops").get<double>());
  }

  // One decode entry per mechanism and input form, with the memcpy and rewrite baselines.
  const json& decode = j.at("decode");
  ASSERT_EQ(decode.size(), 4u) << decode.dump(2);
  for (const json& d : decode) {
    expect_timing(d);
    const json& s = d.at("shape");
    const double bytes = 2.0 * s.at("B").get<double>() * s.at("HV").get<double>() *
                         s.at("K").get<double>() * s.at("V").get<double>() * 4;
    EXPECT_NEAR(d.at("state_gbps").get<double>() * d.at("timing").at("median_ms").get<double>() *
                    1e-3 * 1e9,
                bytes, bytes * 1e-9)
        << "GB/s = 2 N HV K V 4 / median";
    EXPECT_GE(d.at("state_pools").at("pools").get<int>(), 4);
    EXPECT_GT(d.at("memcpy").at("gbps").get<double>(), 0);
    EXPECT_GT(d.at("fraction_of_memcpy").get<double>(), 0);
    EXPECT_GT(d.at("rewrite").at("gbps").get<double>(), 0);
    EXPECT_GT(d.at("fraction_of_rewrite").get<double>(), 0);
  }
}

TEST_F(BenchCommand, RejectsAnUnknownCase) {
  const CliResult r = cli({"bench", "--cases", "prefill-1x1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("prefill-1x1"), std::string::npos) << r.err;
}

TEST_F(BenchCommand, RejectsAJsonPathInAMissingDirectory) {
  const std::string json_path = path("no/such/dir/b.json").string();
  const CliResult r = cli({"bench", "--quick", "--json", json_path});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(path("no/such/dir").string()), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("[1/"), std::string::npos) << "failed before measuring: " << r.err;
}

}  // namespace
}  // namespace flashdelta::testing
