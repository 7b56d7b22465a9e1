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
  DeviceMirror m;
  DecodeArgs d = host;
  for (auto [h, dv] : {std::pair{&host.q, &d.q}, {&host.k, &d.k}, {&host.v, &d.v},
                       {&host.g, &d.g}, {&host.beta, &d.beta}, {&host.cu_seqlens, &d.cu_seqlens},
                       {&host.A_log, &d.A_log}, {&host.dt_bias, &d.dt_bias}, {&host.o, &d.o},
                       {&host.state_pool, &d.state_pool}, {&host.state_indices, &d.state_indices},
                       {&host.num_accepted_tokens, &d.num_accepted_tokens}})
    *dv = m.upload(*h);
  decode(d, options, Schedule::recurrent);
  check_cuda(cudaDeviceSynchronize(), "decode");
  m.download(d.o, host.o);
  m.download(d.state_pool, host.state_pool);
}

}  // namespace flashdelta::testing
