// GPU test helpers: a test builds its arguments on the host (test_util.h), mirrors them to
// the GPU (tools/flashdelta/device_mirror.h), runs, and reads the outputs back.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flashdelta/device_mirror.h"
#include "flashdelta/flashdelta.h"

namespace flashdelta::testing {

inline bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define FLASHDELTA_REQUIRE_GPU() \
  if (!::flashdelta::testing::has_gpu()) GTEST_SKIP() << "no CUDA device on this machine"

using cli::check_cuda;
using cli::DeviceMirror;

// Runs a forward on device copies of host arguments and writes o / final_state back.
inline void forward_on_device(const ForwardArgs& host, const Options& options,
                              Schedule schedule = Schedule::recurrent) {
  cli::DeviceForward d(host);
  forward(d.args, options, schedule);
  d.download_outputs(host);
}

// The same for a serving call: the pool is updated in place and read back whole.
inline void decode_on_device(const DecodeArgs& host, const Options& options) {
  cli::DeviceDecode d(host);
  decode(d.args, options, Schedule::recurrent);
  d.download_outputs(host);
}

}  // namespace flashdelta::testing
