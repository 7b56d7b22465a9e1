// The differentiable inputs of a backward call, shared by the CPU and GPU backward tests:
// each input's tensor in Case and its fields in BackwardArgs (the value and its gradient).
#pragma once

#include "test_util.h"

namespace flashdelta::testing {

struct GradInput {
  const char* name;
  HostTensor Case::*tensor;
  TensorView BackwardArgs::*value;
  TensorView BackwardArgs::*grad;
};

inline constexpr GradInput kGradInputs[] = {
    {"q", &Case::q, &BackwardArgs::q, &BackwardArgs::dq},
    {"k", &Case::k, &BackwardArgs::k, &BackwardArgs::dk},
    {"v", &Case::v, &BackwardArgs::v, &BackwardArgs::dv},
    {"g", &Case::g, &BackwardArgs::g, &BackwardArgs::dg},
    {"beta", &Case::beta, &BackwardArgs::beta, &BackwardArgs::dbeta},
    {"initial_state", &Case::initial_state, &BackwardArgs::initial_state,
     &BackwardArgs::d_initial_state},
    {"A_log", &Case::A_log, &BackwardArgs::A_log, &BackwardArgs::dA_log},
    {"dt_bias", &Case::dt_bias, &BackwardArgs::dt_bias, &BackwardArgs::ddt_bias},
};

}  // namespace flashdelta::testing
