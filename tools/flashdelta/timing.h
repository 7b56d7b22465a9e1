// Wall-clock timing for the benchmarks and the built-in check: the median and minimum of
// repeated runs after a warm-up, with a time budget so slow schedules do not stall a sweep.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace flashdelta::cli {

inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct TimingStats {
  double median_s = 0;
  double min_s = 0;
  int samples = 0;
};

inline TimingStats summarize(std::vector<double> samples_s) {
  TimingStats st;
  if (samples_s.empty()) return st;
  std::sort(samples_s.begin(), samples_s.end());
  const size_t n = samples_s.size();
  st.median_s = n % 2 ? samples_s[n / 2] : 0.5 * (samples_s[n / 2 - 1] + samples_s[n / 2]);
  st.min_s = samples_s.front();
  st.samples = static_cast<int>(n);
  return st;
}

// Runs fn once to warm up (page faults, thread start-up), then `repeats` timed runs; stops
// early once `budget_s` seconds have gone by and at least two runs are timed.
template <class F>
TimingStats measure(F&& fn, int repeats, double budget_s) {
  fn();
  std::vector<double> samples;
  const double start = seconds_now();
  for (int r = 0; r < repeats; ++r) {
    const double t0 = seconds_now();
    fn();
    const double t1 = seconds_now();
    samples.push_back(t1 - t0);
    if (samples.size() >= 2 && t1 - start > budget_s) break;
  }
  return summarize(std::move(samples));
}

}  // namespace flashdelta::cli
