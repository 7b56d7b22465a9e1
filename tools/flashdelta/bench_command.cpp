#include "bench_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_formulas.h"
#include "flashdelta/flashdelta.h"
#include "forward_tensors.h"
#include "machine_info.h"
#include "peak_flops.h"
#include "synthetic.h"
#include "timing.h"

namespace flashdelta::cli {
namespace {

using nlohmann::json;

enum class CaseKind { prefill, decode };

// One problem of the sweep. Decode cases read shape.B as the number of sequences and
// shape.T as 1 (one token per sequence and step).
struct BenchCase {
  const char* name;
  CaseKind kind;
  ProblemShape shape;
  bool quick;  // part of the --quick sweep instead of the default one
};

// The cases the team reports (float32, K = V = 128), and a tiny sweep for smoke tests.
constexpr BenchCase kCases[] = {
    {"prefill-4096x16", CaseKind::prefill, {1, 4096, 16, 16, 128, 128}, false},
    {"prefill-1024x32", CaseKind::prefill, {1, 1024, 32, 32, 128, 128}, false},
    {"decode-16x32", CaseKind::decode, {16, 1, 32, 32, 128, 128}, false},
    {"quick-prefill", CaseKind::prefill, {1, 96, 2, 4, 32, 32}, true},
    {"quick-decode", CaseKind::decode, {4, 1, 2, 4, 32, 32}, true},
};
constexpr Mechanism kMechanisms[] = {Mechanism::kda, Mechanism::gated_deltanet};
constexpr Schedule kPrefillSchedules[] = {Schedule::recurrent, Schedule::chunk};
// Each case runs with the transforms in the kernel (as models call fla) and with inputs
// transformed beforehand (as ggml's op takes them), to compare with both.
constexpr Transforms kTransforms[] = {Transforms::fused, Transforms::prepared};
// Decode state pools (and memcpy pools) in all: this many times the last-level cache.
constexpr int64_t kCacheMultiple = 4;
constexpr uint64_t kSeed = 20240917;

// Everything one sweep needs to know besides the case.
struct Sweep {
  const BenchFlags& flags;
  int threads = 1;
  double budget_s = 0;  // per measurement, see measure()
  double peak_gflops = 0;
  int64_t l3_bytes = 0;
  int step = 0, steps = 0;  // progress
  json prefill = json::array(), decode = json::array();
};

void progress(Sweep& sw, const std::string& what) {
  std::fprintf(stderr, "flashdelta bench: [%d/%d] %s\n", ++sw.step, sw.steps, what.c_str());
}

json timing_json(const TimingStats& t) {
  return {{"median_ms", t.median_s * 1e3}, {"min_ms", t.min_s * 1e3}, {"samples", t.samples}};
}

json shape_json(const ProblemShape& s) {
  return {{"B", s.B}, {"T", s.T}, {"H", s.H}, {"HV", s.HV}, {"K", s.K}, {"V", s.V}};
}

void bench_prefill(Sweep& sw, const BenchCase& c) {
  const ProblemShape& s = c.shape;
  for (Mechanism m : kMechanisms) {
    for (Transforms tr : kTransforms) {
      io::TensorMap inputs = random_layer_inputs(m, s, kSeed, /*with_initial_state=*/true, tr);
      Options options = layer_options(m, tr);
      options.num_threads = sw.threads;
      ForwardOutputs outputs = make_forward_outputs(inputs, options.state_layout);
      const ForwardArgs args = make_forward_args(inputs, outputs);
      const MechanismTraits mt = traits(m);
      for (Schedule schedule : kPrefillSchedules) {
        progress(sw, std::string(c.name) + " " + mechanism_name(m) + " " + transforms_name(tr) +
                         " " + schedule_name(schedule));
        const TimingStats t =
            measure([&] { forward(args, options, schedule); }, sw.flags.repeats, sw.budget_s);
        const double per_token =
            schedule == Schedule::chunk
                ? formulas::chunk_flops_per_token(s.K, s.V, options.chunk_size, mt.delta)
                : formulas::recurrent_flops_per_token(s.K, s.V, mt.gate != GateKind::none,
                                                      mt.delta);
        const double tokens = static_cast<double>(s.B * s.T);
        const double gflop = tokens * static_cast<double>(s.HV) * per_token * 1e-9;
        json r = {{"case", c.name},
                  {"mechanism", mechanism_name(m)},
                  {"transforms", transforms_name(tr)},
                  {"schedule", schedule_name(schedule)},
                  {"shape", shape_json(s)},
                  {"chunk_size", options.chunk_size},
                  {"timing", timing_json(t)},
                  {"tokens_per_s", tokens / t.median_s},
                  {"gflop", gflop},
                  {"gflops", gflop / t.median_s},
                  {"fraction_of_peak", gflop / t.median_s / sw.peak_gflops}};
        sw.prefill.push_back(r);
      }
    }
  }
}

// Copies `bytes` from src to dst, split in one contiguous part per thread.
void parallel_memcpy(char* dst, const char* src, int64_t bytes, int threads) {
  const int64_t part = (bytes + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int i = 0; i < threads; ++i) {
    const int64_t begin = std::min<int64_t>(bytes, i * part);
    const int64_t end = std::min<int64_t>(bytes, begin + part);
    std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin));
  }
}

// Reads and writes back every float of x in place, one contiguous part per thread: the
// memory traffic of a decode step (each state read and written once) without its arithmetic.
// (x + 0 is not folded away: it turns -0 into +0.)
void parallel_rewrite(float* x, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] += 0.0f;
}

// Times kinds of steps over rotating pools, pass after pass: one warm-up pass, then up to
// `repeats` passes within the time budget. A pass runs every kind over all pools in turn,
// so all kinds see the same machine: the load of a shared machine drifts within seconds.
// Every step is one sample; returns one TimingStats per kind.
std::vector<TimingStats> measure_pool_steps(
    const Sweep& sw, int64_t pools, const std::vector<std::function<void(int64_t)>>& kinds) {
  for (const auto& step : kinds)
    for (int64_t r = 0; r < pools; ++r) step(r);
  std::vector<std::vector<double>> samples(kinds.size());
  const double start = seconds_now();
  for (int pass = 0; pass < sw.flags.repeats; ++pass) {
    for (size_t k = 0; k < kinds.size(); ++k)
      for (int64_t r = 0; r < pools; ++r) {
        const double t0 = seconds_now();
        kinds[k](r);
        samples[k].push_back(seconds_now() - t0);
      }
    if (pass >= 1 && seconds_now() - start > sw.budget_s) break;
  }
  std::vector<TimingStats> stats;
  for (std::vector<double>& s : samples) stats.push_back(summarize(std::move(s)));
  return stats;
}

// One decode variant: a mechanism with its inputs in one form, over the state pools.
struct DecodeRun {
  Mechanism mechanism;
  Transforms transforms;
  io::TensorMap inputs;
  Options options;
  ForwardOutputs outputs;
  DecodeArgs args;
};

// Decode steps over rotating state pools of at least kCacheMultiple x the last-level cache
// in all, so each step reads its states from memory, as a server with many sequences does.
// Two baselines on the same threads, in the same passes, over pools of the same size:
// memcpy between pools of separate memory (as large in all), the yardstick, and the
// in-place rewrite of the state pools, the traffic of a decode step. All three count bytes
// read plus bytes written; memcpy's stores also read their line first (it is below glibc's
// non-temporal threshold), which the in-place rewrite does not need.
void bench_decode(Sweep& sw, const BenchCase& c) {
  const ProblemShape& s = c.shape;
  const int64_t N = s.B;
  const int64_t pool_floats = N * s.HV * s.K * s.V;
  const int64_t pool_bytes = pool_floats * static_cast<int64_t>(sizeof(float));
  const int64_t pools = std::max<int64_t>(
      4, c.quick ? 4 : (kCacheMultiple * sw.l3_bytes + pool_bytes - 1) / pool_bytes);
  std::vector<float> pool_memory(static_cast<size_t>(pools * pool_floats));
  std::vector<float> copy_memory(pool_memory.size());
  fill_uniform(pool_memory.data(), static_cast<int64_t>(pool_memory.size()), -0.1f, 0.1f, kSeed);
  const json cache = {{"pools", pools},
                      {"pool_bytes", pool_bytes},
                      {"total_bytes", pools * pool_bytes},
                      {"l3_bytes", sw.l3_bytes},
                      {"exceeds_l3", pools * pool_bytes > sw.l3_bytes}};

  // Step r of the copy reads pool r and writes the pool half the rotation away, which no
  // step has touched for a while either.
  char* copy_base = reinterpret_cast<char*>(copy_memory.data());
  std::vector<std::function<void(int64_t)>> kinds = {
      [&](int64_t r) {
        parallel_memcpy(copy_base + (r + pools / 2) % pools * pool_bytes,
                        copy_base + r * pool_bytes, pool_bytes, sw.threads);
      },
      [&](int64_t r) {
        parallel_rewrite(pool_memory.data() + r * pool_floats, pool_floats, sw.threads);
      }};
  constexpr size_t kBaselines = 2;  // memcpy, rewrite

  // Slots [r N, (r + 1) N) of one big pool form pool r.
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(pools));
  for (int64_t r = 0; r < pools; ++r)
    for (int64_t n = 0; n < N; ++n) slots[r].push_back(r * N + n);
  std::vector<DecodeRun> runs;
  runs.reserve(std::size(kMechanisms) * std::size(kTransforms));  // args point into runs
  for (Mechanism m : kMechanisms)
    for (Transforms tr : kTransforms) {
      DecodeRun& d = runs.emplace_back();
      d.mechanism = m;
      d.transforms = tr;
      d.inputs = random_layer_inputs(m, s, kSeed, /*with_initial_state=*/false, tr);
      d.options = layer_options(m, tr);
      d.options.num_threads = sw.threads;
      d.outputs = make_forward_outputs(d.inputs, d.options.state_layout);
      const ForwardArgs f = make_forward_args(d.inputs, d.outputs);
      d.args.q = f.q;
      d.args.k = f.k;
      d.args.v = f.v;
      d.args.g = f.g;
      d.args.beta = f.beta;
      d.args.A_log = f.A_log;
      d.args.dt_bias = f.dt_bias;
      d.args.o = f.o;
      d.args.state_pool = make_view(pool_memory.data(), DType::f32, {pools * N, s.HV, s.K, s.V});
      kinds.push_back([&d, &slots, N](int64_t r) {
        d.args.state_indices = make_view(slots[r].data(), DType::i64, {N});
        decode(d.args, d.options, Schedule::recurrent);
      });
    }

  progress(sw, std::string(c.name) + " memcpy, in-place rewrite and recurrent decode, interleaved");
  const std::vector<TimingStats> t = measure_pool_steps(sw, pools, kinds);
  const double memcpy_gbps = formulas::memcpy_bytes(pool_bytes) / t[0].median_s * 1e-9;
  const double rewrite_gbps = formulas::rewrite_bytes(pool_bytes) / t[1].median_s * 1e-9;
  for (size_t i = 0; i < runs.size(); ++i) {
    const TimingStats& td = t[kBaselines + i];
    const double state_gbps = formulas::decode_state_bytes(N, s.HV, s.K, s.V) / td.median_s * 1e-9;
    sw.decode.push_back({{"case", c.name},
                         {"mechanism", mechanism_name(runs[i].mechanism)},
                         {"transforms", transforms_name(runs[i].transforms)},
                         {"schedule", "recurrent"},
                         {"shape", shape_json(s)},
                         {"state_pools", cache},
                         {"timing", timing_json(td)},
                         {"tokens_per_s", static_cast<double>(N) / td.median_s},
                         {"state_gbps", state_gbps},
                         {"memcpy", {{"timing", timing_json(t[0])}, {"gbps", memcpy_gbps}}},
                         {"fraction_of_memcpy", state_gbps / memcpy_gbps},
                         {"rewrite", {{"timing", timing_json(t[1])}, {"gbps", rewrite_gbps}}},
                         {"fraction_of_rewrite", state_gbps / rewrite_gbps}});
  }
}

std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void print_tables(const Sweep& sw) {
  std::printf("%-16s %-15s %-10s %-9s %10s %10s %12s %9s %7s\n", "prefill", "mechanism",
              "transforms", "schedule", "median ms", "min ms", "tokens/s", "GFLOP/s", "% peak");
  for (const json& r : sw.prefill)
    std::printf("%-16s %-15s %-10s %-9s %10.3f %10.3f %12.0f %9.2f %6.1f%%\n",
                r["case"].get<std::string>().c_str(), r["mechanism"].get<std::string>().c_str(),
                r["transforms"].get<std::string>().c_str(),
                r["schedule"].get<std::string>().c_str(), r["timing"]["median_ms"].get<double>(),
                r["timing"]["min_ms"].get<double>(), r["tokens_per_s"].get<double>(),
                r["gflops"].get<double>(), 100 * r["fraction_of_peak"].get<double>());
  std::printf("\n%-16s %-15s %-10s %10s %10s %12s %9s %11s %9s %12s %10s\n", "decode", "mechanism",
              "transforms", "ms/step", "min ms", "tokens/s", "GB/s", "memcpy GB/s", "% memcpy",
              "rewrite GB/s", "% rewrite");
  for (const json& r : sw.decode)
    std::printf("%-16s %-15s %-10s %10.3f %10.3f %12.0f %9.2f %11.2f %8.1f%% %12.2f %9.1f%%\n",
                r["case"].get<std::string>().c_str(), r["mechanism"].get<std::string>().c_str(),
                r["transforms"].get<std::string>().c_str(), r["timing"]["median_ms"].get<double>(),
                r["timing"]["min_ms"].get<double>(), r["tokens_per_s"].get<double>(),
                r["state_gbps"].get<double>(), r["memcpy"]["gbps"].get<double>(),
                100 * r["fraction_of_memcpy"].get<double>(), r["rewrite"]["gbps"].get<double>(),
                100 * r["fraction_of_rewrite"].get<double>());
}

int resolve_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchFlags& flags) {
  CLI::App* cmd = app.add_subcommand(
      "bench", "Time the schedules on this machine (KDA and Gated DeltaNet, float32)");
  std::vector<std::string> names;
  for (const BenchCase& c : kCases) names.push_back(c.name);
  cmd->add_option("--json", flags.json_path, "Where to write the results as JSON")
      ->capture_default_str();
  CLI::Option* quick =
      cmd->add_flag("--quick", flags.quick, "A tiny sweep in a second (smoke test)");
  cmd->add_option("--cases", flags.cases, "Run only these cases")
      ->check(CLI::IsMember(names))
      ->excludes(quick);
  cmd->add_option("--threads", flags.threads, "Worker threads (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--repeats", flags.repeats, "Timed repetitions after the warm-up")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--peak-gflops", flags.peak_gflops,
                  "The float32 FMA peak of these threads in GFLOP/s (default: measured)")
      ->check(CLI::PositiveNumber);
  return cmd;
}

void run_bench(const BenchFlags& flags) {
  // Fail now rather than after minutes of measuring.
  const std::filesystem::path json_dir = std::filesystem::absolute(flags.json_path).parent_path();
  if (!std::filesystem::is_directory(json_dir))
    throw Error(ErrorCode::invalid_argument, "--json " + flags.json_path + ": directory " +
                                                 json_dir.string() + " does not exist");
  std::vector<const BenchCase*> cases;
  for (const BenchCase& c : kCases) {
    const bool named =
        std::find(flags.cases.begin(), flags.cases.end(), c.name) != flags.cases.end();
    if (flags.cases.empty() ? c.quick == flags.quick : named) cases.push_back(&c);
  }
  const MachineInfo machine = read_machine_info();
  Sweep sw{flags};
  sw.threads = resolve_threads(flags.threads);
  sw.budget_s = flags.quick ? 0.5 : 5.0;
  sw.l3_bytes = machine.l3_bytes();
  for (const BenchCase* c : cases)
    sw.steps += c->kind == CaseKind::prefill
                    ? static_cast<int>(std::size(kMechanisms) * std::size(kTransforms) *
                                       std::size(kPrefillSchedules))
                    : 1;
  if (flags.peak_gflops <= 0) sw.steps += 1;

  std::string peak_method = "given with --peak-gflops";
  sw.peak_gflops = flags.peak_gflops;
  if (sw.peak_gflops <= 0) {
    progress(sw, "float32 FMA peak on " + std::to_string(sw.threads) + " threads");
    sw.peak_gflops = measure_peak_gflops(sw.threads, flags.quick ? 0.1 : 1.0);
    peak_method =
        "measured: independent float32 FMA chains, widest Highway target, per-thread CPU time, "
        "best of 5";
  }
  for (const BenchCase* c : cases) {
    if (c->kind == CaseKind::prefill)
      bench_prefill(sw, *c);
    else
      bench_decode(sw, *c);
  }

  print_tables(sw);
  const json out = {
      {"flashdelta_version", version()},
      {"date", utc_date()},
      {"command_line", flags.command_line},
      {"machine",
       {{"cpu_model", machine.cpu_model},
        {"logical_cpus", machine.logical_cpus},
        {"threads", sw.threads},
        {"simd_target", cpu_simd_target()},
        {"l3_bytes_sysfs", machine.l3_bytes_sysfs},
        {"l3_bytes_sysconf", machine.l3_bytes_sysconf},
        {"peak_gflops_fp32", sw.peak_gflops},
        {"peak_method", peak_method}}},
      {"settings",
       {{"dtype", "float32"},
        {"options",
         "fused: qk_l2norm, beta_sigmoid, gate_in_kernel (A_log, dt_bias); prepared: none, "
         "inputs transformed beforehand; prefill with initial_state"},
        {"warmup_runs", 1},
        {"repeats", flags.repeats},
        {"budget_s_per_measurement", sw.budget_s}}},
      {"formulas",
       {{"recurrent_flops_per_token_head", "(gated ? K V : 0) + (delta ? 2 K V : 0) + 4 K V"},
        {"chunk_flops_per_token_head", "delta: 6 K V + 2 C (3 K + 2 V) + C^2 / 3 + K V / C"},
        {"decode_state_bytes_per_step", "2 N HV K V 4"},
        {"memcpy_bytes", "2 n (read + write)"},
        {"rewrite_bytes", "2 n (read + write)"},
        {"baselines_method",
         "memcpy: std::memcpy of one pool to another, pools separate from the state pools and "
         "as many (>= 4x L3 in all); rewrite: every float of a state pool read and written back "
         "in place; both one contiguous part per OpenMP thread, same threads as decode, timed "
         "in the same passes as the decode steps; median of per-step samples"}}},
      {"prefill", sw.prefill},
      {"decode", sw.decode}};
  std::ofstream f(flags.json_path);
  f << out.dump(2) << "\n";
  f.close();
  if (!f) throw Error(ErrorCode::runtime, flags.json_path + ": cannot write the JSON results");
  std::fprintf(stderr, "flashdelta bench: wrote %s\n", flags.json_path.c_str());
}

}  // namespace flashdelta::cli
