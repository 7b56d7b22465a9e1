// The forward of the command line on either device: host tensors in and out; for cuda the
// call runs on device copies (a build without CUDA refuses it with the library's error).
#pragma once

#include "flashdelta/flashdelta.h"

namespace flashdelta::cli {

// Runs the forward; returns the seconds the call took (on cuda: copies excluded, the
// device synchronised).
double forward_on(Device device, const ForwardArgs& host_args, const Options& options,
                  Schedule schedule);

}  // namespace flashdelta::cli
