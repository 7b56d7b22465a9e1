// The fast CPU schedules. Both compute the same function as the reference (reference.h):
// recurrent runs token by token with the state tile held in L1; chunk runs the chunkwise
// matrix form of DESIGN.md section 3. Both vectorise with Highway's runtime dispatch and
// run in parallel over (sequence, head) work items.
#pragma once

#include "core/problem.h"
#include "reference/reference.h"

namespace flashdelta::detail {

void cpu_recurrent_forward(const Problem& p, const ForwardIO& io);
void cpu_recurrent_decode(const DecodeProblem& d, const TensorView& o);
void cpu_chunk_forward(const Problem& p, const ForwardIO& io);

// Name of the SIMD target Highway dispatches to on this machine (e.g. "AVX3_ZEN4").
const char* cpu_simd_target_name();

}  // namespace flashdelta::detail
