// Synthetic problems for the built-in check (`run` without --in) and the benchmarks: random
// float32 tensors shaped like one attention layer, with raw beta and gate pre-activations
// for the fused transforms, named as `run --in` reads them.
#pragma once

#include <cstdint>

#include "flashdelta/options.h"
#include "flashdelta/safetensors.h"

namespace flashdelta::cli {

struct ProblemShape {
  int64_t B = 1, T = 1, H = 1, HV = 1, K = 64, V = 64;
};

// The options of a model layer: q/k L2 norm, and for the mechanisms that have them the beta
// sigmoid and the gate activation in the kernel (softplus form with A_log and dt_bias).
Options layer_options(Mechanism mechanism);

// q, k, v and, as the mechanism needs them, g, beta, A_log, dt_bias; initial_state
// [B, HV, K, V] when asked for. Reproducible from `seed`.
io::TensorMap random_layer_inputs(Mechanism mechanism, const ProblemShape& shape, uint64_t seed,
                                  bool with_initial_state);

// Fills n floats with values uniform in [lo, hi): a cheap generator for large buffers such
// as benchmark state pools.
void fill_uniform(float* data, int64_t n, float lo, float hi, uint64_t seed);

}  // namespace flashdelta::cli
