// Helpers shared by the C++ CUDA timing tools: exit with a message on a CUDA error, medians.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace flashdelta::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The host's time per call of `call` (which queues work on stream s): 200 calls queued
// without waiting for the GPU, timed by the host clock; median of `loops` loops.
template <class F>
double host_us_per_call(F call, cudaStream_t s, int loops) {
  std::vector<double> us;
  for (int r = 0; r < loops; ++r) {
    check(cudaStreamSynchronize(s), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) call(i);
    const auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 200);
  }
  check(cudaStreamSynchronize(s), "sync");
  return median(us);
}

}  // namespace flashdelta::bench
