// Synthetic problems for the built-in check (`run` without --in) and the benchmarks: random
// float32 tensors shaped like one attention layer, named as `run --in` reads them: raw beta
// and gate pre-activations for the fused transforms, or the same layer with the transforms
// applied beforehand.
#pragma once

#include <cstdint>

#include "flashdelta/options.h"
#include "flashdelta/safetensors.h"

namespace flashdelta::cli {

struct ProblemShape {
  int64_t B = 1, T = 1, H = 1, HV = 1, K = 64, V = 64;
};

// Where a layer's q/k L2 norm, beta sigmoid and gate activation run: in the kernel (fused),
// or in the caller before it (prepared: q and k unit rows, g the log decay, beta in (0, 1)),
// as callers of kernels without the transforms hand them over (e.g. ggml's op).
enum class Transforms { fused, prepared };

// The options of a model layer. Fused: q/k L2 norm, and for the mechanisms that have them
// the beta sigmoid and the gate activation in the kernel (softplus form with A_log and
// dt_bias). Prepared: none of them.
Options layer_options(Mechanism mechanism, Transforms transforms = Transforms::fused);

// q, k, v and, as the mechanism needs them, g, beta and (fused) A_log, dt_bias;
// initial_state [B, HV, K, V] when asked for. Reproducible from `seed`; the prepared inputs
// are the fused ones after the transforms, computed here in fp64 with the reference's
// formulas, so both forms describe the same layer.
io::TensorMap random_layer_inputs(Mechanism mechanism, const ProblemShape& shape, uint64_t seed,
                                  bool with_initial_state,
                                  Transforms transforms = Transforms::fused);

const char* transforms_name(Transforms transforms);

// Fills n floats with values uniform in [lo, hi): a cheap generator for large buffers such
// as benchmark state pools.
void fill_uniform(float* data, int64_t n, float lo, float hi, uint64_t seed);

}  // namespace flashdelta::cli
