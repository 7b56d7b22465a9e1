// The CUDA schedules, compiled when the build finds a CUDA compiler (FLASHDELTA_WITH_CUDA).
// Each takes a validated problem whose tensors all live on the GPU, launches on the caller's
// stream and returns without synchronising.
#pragma once

#include "core/problem.h"
#include "reference/reference.h"

namespace flashdelta::detail {

void cuda_recurrent_forward(const Problem& p, const ForwardIO& io, void* stream);
void cuda_recurrent_decode(const DecodeProblem& d, const TensorView& o, void* stream);
// The chunkwise forward (prefill); needs sm_80 or later.
void cuda_chunk_forward(const Problem& p, const ForwardIO& io, void* stream);

}  // namespace flashdelta::detail
