// Forward checks shared by the CUDA schedule tests: run a case on the GPU and with the fp64
// reference, and compare outputs and final states.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "cuda/device_mirror.h"
#include "decode_case.h"
#include "test_util.h"

namespace flashdelta::testing {

struct Outputs {
  std::vector<double> o, state;
};

inline Outputs run_reference(const Case& c) {
  HostTensor o = c.make_output(DType::f64), s = c.make_state();
  forward(c.args(o, &s), c.options, Schedule::reference);
  return {o.to_double(), s.to_double()};
}

// Outputs and states start poisoned, so anything left unwritten fails the comparison.
inline Outputs run_cuda(const Case& c, DType o_dtype, Schedule schedule) {
  HostTensor o = c.make_output(o_dtype), s = c.make_state();
  o.fill(kPoison);
  s.fill(kPoison);
  forward_on_device(c.args(o, &s), c.options, schedule);
  return {o.to_double(), s.to_double()};
}

// `call` (labelled `what`) must throw an Error with `code` whose message holds every needle.
template <class Call>
void expect_error(Call&& call, const std::string& what, ErrorCode code,
                  std::initializer_list<const char*> needles) {
  try {
    call();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    const std::string msg = e.what();
    for (const char* needle : needles)
      EXPECT_NE(msg.find(needle), std::string::npos) << what << ": " << msg;
  }
}

// The recurrent kernel computes in float32 (float64 inputs are narrowed); the chunk kernels
// multiply bfloat16 operands with float32 accumulation whatever the input dtype.
inline double cuda_tolerance(DType dtype, Schedule schedule) {
  if (schedule == Schedule::chunk) return 1e-2;
  return tolerance(dtype == DType::f64 ? DType::f32 : dtype);
}

inline void expect_forward_matches_reference(const Case& c, const std::string& what,
                                             Schedule schedule = Schedule::recurrent) {
  const Outputs ref = run_reference(c);
  const Outputs gpu = run_cuda(c, c.cfg.dtype == DType::f64 ? DType::f32 : c.cfg.dtype, schedule);
  const double tol = cuda_tolerance(c.cfg.dtype, schedule);
  EXPECT_LT(rel_error(gpu.o, ref.o), tol) << what << ": output relative error";
  EXPECT_LT(rel_error(gpu.state, ref.state), tol) << what << ": final state relative error";
}

// The gate activation's forms with the fused transforms, bf16 inputs. Form 0: softplus with
// A_log and dt_bias; 1-3: lower bound -5, 2 without A_log, 3 without dt_bias and with
// negative eigenvalues. Odd forms use V-first states.
inline CaseConfig gate_form_case(Mechanism m, int form, int64_t T, uint64_t seed) {
  CaseConfig c{.mechanism = m, .B = 2, .T = T, .H = 2, .HV = 4, .K = 128, .V = 128,
               .dtype = DType::bf16,
               .layout = form % 2 ? StateLayout::v_first : StateLayout::k_first,
               .qk_l2norm = true, .beta_sigmoid = true, .allow_neg_eigval = form == 3,
               .gate_in_kernel = true, .with_A_log = form != 2, .with_dt_bias = form != 3,
               .seed = seed};
  if (form >= 1) c.lower_bound = -5.0;
  return c;
}

// One shape of a test grid; mechanism_grid crosses the shapes with every mechanism, seeds
// counting up from `seed` in that order.
struct GridShape {
  int64_t B, T, K, V, H, HV;
  StateLayout layout;
  DType dtype;
  bool initial_state;
};

inline std::vector<CaseConfig> mechanism_grid(const std::vector<GridShape>& shapes,
                                              uint64_t seed) {
  std::vector<CaseConfig> grid;
  for (const Mechanism m : kAllMechanisms)
    for (const GridShape& s : shapes)
      grid.push_back({.mechanism = m, .B = s.B, .T = s.T, .H = s.H, .HV = s.HV, .K = s.K,
                      .V = s.V, .dtype = s.dtype, .initial_state = s.initial_state,
                      .layout = s.layout, .seed = seed++});
  return grid;
}

inline std::string describe(const CaseConfig& c) {
  std::string s = std::string(mechanism_name(c.mechanism)) + "_T" + std::to_string(c.T) + "_K" +
                  std::to_string(c.K) + "_V" + std::to_string(c.V) + "_H" + std::to_string(c.H) +
                  "_HV" + std::to_string(c.HV) + "_" + dtype_name(c.dtype);
  if (c.layout == StateLayout::v_first) s += "_vfirst";
  if (!c.initial_state) s += "_zero_state";
  return s;
}

}  // namespace flashdelta::testing
