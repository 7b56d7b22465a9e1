#include "device_forward.h"

#include "timing.h"
#ifdef FLASHDELTA_WITH_CUDA
#include "flashdelta/device_mirror.h"
#endif

namespace flashdelta::cli {

double forward_on(Device device, const ForwardArgs& host_args, const Options& options,
                  Schedule schedule) {
#ifdef FLASHDELTA_WITH_CUDA
  if (device == Device::cuda) {
    DeviceForward d(host_args);
    check_cuda(cudaDeviceSynchronize(), "upload");
    const double t0 = seconds_now();
    forward(d.args, options, schedule);
    check_cuda(cudaDeviceSynchronize(), "forward");
    const double elapsed = seconds_now() - t0;
    d.download_outputs(host_args);
    return elapsed;
  }
#endif
  ForwardArgs args = host_args;
  if (device == Device::cuda)  // no CUDA in this build: the library names the problem
    for (TensorView* t : {&args.q, &args.k, &args.v, &args.o})
      t->device = Device::cuda;
  const double t0 = seconds_now();
  forward(args, options, schedule);
  return seconds_now() - t0;
}

}  // namespace flashdelta::cli
