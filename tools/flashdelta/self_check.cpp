#include "self_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor_io.h"
#include "flashdelta/flashdelta.h"
#include "device_calls.h"
#include "forward_tensors.h"
#include "synthetic.h"
#include "timing.h"

namespace flashdelta::cli {
namespace {

// A small serving-shaped batch: two sequences, grouped value heads (HV = 2 H).
constexpr ProblemShape kShape{2, 512, 4, 8, 64, 64};
constexpr Mechanism kMechanisms[] = {Mechanism::kda, Mechanism::gated_deltanet};
constexpr Schedule kSchedules[] = {Schedule::recurrent, Schedule::chunk};
constexpr uint64_t kSeed = 7;
// Relative error of float32 schedules against the fp64 reference (as in tests/test_util.h).
constexpr double kTolerance = 2e-4;
// The CUDA chunk schedule multiplies bfloat16 operands (float32 accumulation).
constexpr double kBFloat16Tolerance = 1e-2;

double tolerance_of(Device device, Schedule schedule) {
  return device == Device::cuda && schedule == Schedule::chunk ? kBFloat16Tolerance : kTolerance;
}

std::vector<double> to_doubles(io::OwnedTensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  detail::load_row(t.view(), 0, t.numel(), 1, out.data());
  return out;
}

// ||a - b|| / ||b|| over all elements.
double relative_error(io::OwnedTensor& a, io::OwnedTensor& b) {
  const std::vector<double> x = to_doubles(a), y = to_doubles(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

struct Run {
  ForwardOutputs out;
  TimingStats time;
};

// The fast schedules are timed after a warm-up (median of 3, the call alone: on cuda without
// the copies); the slow reference runs once.
Run run_schedule(io::TensorMap& inputs, const Options& options, Schedule schedule,
                 Device device) {
  Run r;
  r.out = make_forward_outputs(inputs, options.state_layout);
  const ForwardArgs args = make_forward_args(inputs, r.out);
  const int runs = schedule == Schedule::reference ? 1 : 4;
  std::vector<double> seconds;
  for (int i = 0; i < runs; ++i) seconds.push_back(forward_on(device, args, options, schedule));
  if (runs > 1) seconds.erase(seconds.begin());  // warm-up
  r.time = summarize(seconds);
  return r;
}

}  // namespace

void run_self_check(int threads, int chunk_size, Device device, std::optional<Schedule> only) {
  const ProblemShape& s = kShape;
  // The fast schedules (recurrent and chunk on either device), or the one asked for.
  std::vector<Schedule> schedules(std::begin(kSchedules), std::end(kSchedules));
  if (only) schedules = {*only};
  std::printf(
      "flashdelta %s on %s (CPU SIMD %s): B=%ld T=%ld H=%ld HV=%ld K=%ld V=%ld float32, qk L2 "
      "norm, beta sigmoid, gate in kernel; relative error vs the fp64 reference on the CPU "
      "(tolerance %.0e; %.0e for the cuda chunk schedule's bfloat16 products)\n\n",
      version(), device == Device::cuda ? "cuda" : "cpu", cpu_simd_target(),
      static_cast<long>(s.B), static_cast<long>(s.T),
      static_cast<long>(s.H), static_cast<long>(s.HV), static_cast<long>(s.K),
      static_cast<long>(s.V), kTolerance, kBFloat16Tolerance);
  std::printf("%-15s %-9s %10s %12s %11s %11s\n", "mechanism", "schedule", "time ms", "tokens/s",
              "err o", "err state");
  std::string failures;
  const double tokens = static_cast<double>(s.B * s.T);
  for (Mechanism m : kMechanisms) {
    io::TensorMap inputs = random_layer_inputs(m, s, kSeed, /*with_initial_state=*/true);
    Options options = layer_options(m);
    options.num_threads = threads;
    options.chunk_size = chunk_size;
    Run ref = run_schedule(inputs, options, Schedule::reference, Device::cpu);
    std::printf("%-15s %-9s %10.2f %12.0f %11s %11s\n", mechanism_name(m), "reference",
                ref.time.median_s * 1e3, tokens / ref.time.median_s, "-", "-");
    for (Schedule schedule : schedules) {
      Run fast = run_schedule(inputs, options, schedule, device);
      const double err_o = relative_error(*fast.out.o, *ref.out.o);
      const double err_s = relative_error(*fast.out.final_state, *ref.out.final_state);
      const double tol = tolerance_of(device, schedule);
      const bool ok = err_o <= tol && err_s <= tol;
      std::printf("%-15s %-9s %10.2f %12.0f %11.2e %11.2e%s\n", mechanism_name(m),
                  schedule_name(schedule), fast.time.median_s * 1e3, tokens / fast.time.median_s,
                  err_o, err_s, ok ? "" : "  FAIL");
      if (!ok)
        failures += std::string(failures.empty() ? "" : "; ") + mechanism_name(m) + " " +
                    schedule_name(schedule);
    }
  }
  std::fflush(stdout);
  if (!failures.empty())
    throw Error(ErrorCode::runtime,
                "self-check: relative error above the tolerance for " + failures);
}

}  // namespace flashdelta::cli
