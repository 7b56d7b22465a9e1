// The reference: the scalar recurrence in fp64, token by token, exactly as written in
// flashdelta.h. It is the truth every fast schedule is tested against, and
// Schedule::reference runs it in place of any fast path.
#pragma once

#include "core/problem.h"

namespace flashdelta::detail {

// Where a forward run reads and writes its states and outputs.
struct ForwardIO {
  StateView initial_state;  // absent view = zeros
  StateView final_state;    // absent view = not wanted
  TensorView o;
  StateView chunk_states;   // absent view = not wanted (core/chunk_states.h)
};

// One token of the recurrence on a K x V state S (row-major by key): forget, write, read.
// o receives V values of S^T (scale q).
void reference_step(const Problem& p, double* S, const double* q, const double* k,
                    const double* v, const double* g, double beta, double* o);

void reference_forward(const Problem& p, const ForwardIO& io);
void reference_decode(const DecodeProblem& d, const TensorView& o);
void reference_backward(const Problem& p, const BackwardArgs& args);

}  // namespace flashdelta::detail
