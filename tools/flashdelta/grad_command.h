// `flashdelta grad`: the backward on the tensors of a safetensors file. The file holds the
// forward's inputs (as `run --in` reads them), d_o, and optionally d_final_state and
// chunk_states (the forward's kept states, BackwardArgs::chunk_states); the output file holds
// the gradient of every differentiable input present: dq, dk, dv, dg, dbeta,
// d_initial_state, dA_log, ddt_bias.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "problem_flags.h"

namespace flashdelta::cli {

struct GradFlags {
  std::string in, out;
  ProblemFlags problem;
  std::optional<std::string> schedule;  // default: reference on cpu, chunk on cuda
  std::string device = "cpu";
};

CLI::App* add_grad_command(CLI::App& app, GradFlags& flags);
void grad_command(const GradFlags& flags);

}  // namespace flashdelta::cli
