// Compiled once per SIMD target by Highway's foreach_target; the best target is chosen at
// run time, as the library's CPU schedules do.
#include "peak_flops.h"

#include <time.h>

#include <algorithm>
#include <cstdint>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "flashdelta/peak_flops.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace flashdelta::cli::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Twelve independent accumulators: more than FMA latency x FMA ports (4 x 2) on current
// cores, so the loop is throughput-bound, and few enough to stay in 16 registers.
// Returns a value depending on every chain, so none can be optimised away; sets *flops.
float FmaChains(int64_t iterations, double* flops) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f);
  const auto c = hn::Set(d, 1e-6f);
  auto a0 = hn::Set(d, 1.0f), a1 = hn::Set(d, 1.1f), a2 = hn::Set(d, 1.2f);
  auto a3 = hn::Set(d, 1.3f), a4 = hn::Set(d, 1.4f), a5 = hn::Set(d, 1.5f);
  auto a6 = hn::Set(d, 1.6f), a7 = hn::Set(d, 1.7f), a8 = hn::Set(d, 1.8f);
  auto a9 = hn::Set(d, 1.9f), a10 = hn::Set(d, 2.0f), a11 = hn::Set(d, 2.1f);
  for (int64_t i = 0; i < iterations; ++i) {
    a0 = hn::MulAdd(a0, m, c);
    a1 = hn::MulAdd(a1, m, c);
    a2 = hn::MulAdd(a2, m, c);
    a3 = hn::MulAdd(a3, m, c);
    a4 = hn::MulAdd(a4, m, c);
    a5 = hn::MulAdd(a5, m, c);
    a6 = hn::MulAdd(a6, m, c);
    a7 = hn::MulAdd(a7, m, c);
    a8 = hn::MulAdd(a8, m, c);
    a9 = hn::MulAdd(a9, m, c);
    a10 = hn::MulAdd(a10, m, c);
    a11 = hn::MulAdd(a11, m, c);
  }
  *flops = 2.0 * 12.0 * static_cast<double>(hn::Lanes(d)) * static_cast<double>(iterations);
  const auto sum = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)),
                           hn::Add(hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)),
                                   hn::Add(hn::Add(a8, a9), hn::Add(a10, a11))));
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

}  // namespace flashdelta::cli::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

namespace flashdelta::cli {

HWY_EXPORT(FmaChains);

namespace {

// CPU time of the calling thread: unlike wall time it does not count the time other
// processes hold the core, so a busy shared machine still measures the hardware's rate.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

double measure_peak_gflops(int threads, double seconds) {
  constexpr int kRounds = 5;  // best of several: a round may still be disturbed
  const double round_s = seconds / kRounds;
  // Calibrate the iteration count of one round on one thread.
  double flops = 0;
  volatile float sink = 0;
  int64_t iterations = 1 << 12;
  for (;;) {
    const double t0 = thread_cpu_seconds();
    sink = sink + HWY_DYNAMIC_DISPATCH(FmaChains)(iterations, &flops);
    const double elapsed = thread_cpu_seconds() - t0;
    if (elapsed > round_s / 4 || iterations > (int64_t{1} << 40)) {
      iterations = static_cast<int64_t>(static_cast<double>(iterations) * round_s / elapsed) + 1;
      break;
    }
    iterations *= 4;
  }
  // Every thread runs the chains at once (cores may share power and frequency budgets);
  // the peak is the sum of the per-thread rates.
  double best = 0;
  for (int round = 0; round < kRounds; ++round) {
    double rate = 0;
    float checksum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : rate, checksum)
    {
      double thread_flops = 0;
      const double t0 = thread_cpu_seconds();
      checksum += HWY_DYNAMIC_DISPATCH(FmaChains)(iterations, &thread_flops);
      rate += thread_flops / (thread_cpu_seconds() - t0);
    }
    sink = sink + checksum;
    best = std::max(best, rate);
  }
  return best * 1e-9;
}

}  // namespace flashdelta::cli
#endif  // HWY_ONCE
