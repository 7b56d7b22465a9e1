// TEMPORARY scaffold, replaced by the Highway recurrent schedule before landing.
#include "cpu/cpu.h"
namespace flashdelta::detail {
void cpu_recurrent_forward(const Problem& p, const ForwardIO& io) { reference_forward(p, io); }
void cpu_recurrent_decode(const DecodeProblem& d, const TensorView& o) { reference_decode(d, o); }
const char* cpu_simd_target_name() { return "scalar"; }
}  // namespace flashdelta::detail
