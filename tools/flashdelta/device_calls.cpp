#include "device_calls.h"

#include <initializer_list>

#include "timing.h"
#ifdef FLASHDELTA_WITH_CUDA
#include "flashdelta/device_mirror.h"
#endif

namespace flashdelta::cli {
#ifndef FLASHDELTA_WITH_CUDA
struct DeviceForward;  // flashdelta/device_mirror.h, in builds with CUDA only
struct DeviceBackward;
#endif
namespace {

// Runs `call` on the device copies of `host` (Mirror: DeviceForward or DeviceBackward) and
// copies the outputs back; on cpu, or without CUDA in this build, on `host` itself with
// every present view labelled with the device, so that the library names the problem.
template <class Mirror, class Args, class Call>
double timed_on(Device device, const Args& host, Call call,
                std::initializer_list<TensorView Args::*> views) {
#ifdef FLASHDELTA_WITH_CUDA
  if (device == Device::cuda) {
    Mirror d(host);
    check_cuda(cudaDeviceSynchronize(), "upload");
    const double t0 = seconds_now();
    call(d.args);
    check_cuda(cudaDeviceSynchronize(), "the call");
    const double elapsed = seconds_now() - t0;
    d.download_outputs(host);
    return elapsed;
  }
#endif
  Args args = host;
  for (TensorView Args::*v : views)
    if ((args.*v).present()) (args.*v).device = device;
  const double t0 = seconds_now();
  call(args);
  return seconds_now() - t0;
}

}  // namespace

double forward_on(Device device, const ForwardArgs& host_args, const Options& options,
                  Schedule schedule) {
  using A = ForwardArgs;
  return timed_on<DeviceForward>(
      device, host_args, [&](const A& a) { forward(a, options, schedule); },
      {&A::q, &A::k, &A::v, &A::g, &A::beta, &A::initial_state, &A::cu_seqlens, &A::A_log,
       &A::dt_bias, &A::o, &A::final_state, &A::chunk_states});
}

double backward_on(Device device, const BackwardArgs& host_args, const Options& options,
                   Schedule schedule) {
  using A = BackwardArgs;
  return timed_on<DeviceBackward>(
      device, host_args, [&](const A& a) { backward(a, options, schedule); },
      {&A::q, &A::k, &A::v, &A::g, &A::beta, &A::initial_state, &A::cu_seqlens, &A::A_log,
       &A::dt_bias, &A::d_o, &A::d_final_state, &A::chunk_states, &A::dq, &A::dk, &A::dv,
       &A::dg, &A::dbeta, &A::d_initial_state, &A::dA_log, &A::ddt_bias});
}

}  // namespace flashdelta::cli
