// The command line's library calls on either device: host tensors in and out; for cuda the
// call runs on device copies (a build without CUDA refuses it with the library's error).
// Each returns the seconds the call took (on cuda: copies excluded, the device synchronised).
#pragma once

#include "flashdelta/flashdelta.h"

namespace flashdelta::cli {

double forward_on(Device device, const ForwardArgs& host_args, const Options& options,
                  Schedule schedule);
double backward_on(Device device, const BackwardArgs& host_args, const Options& options,
                   Schedule schedule);

}  // namespace flashdelta::cli
