// The command-line flags that describe a file's problem (the mechanism and its Options),
// shared by `flashdelta run` and `flashdelta grad`.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

#include "flashdelta/options.h"

namespace flashdelta::cli {

struct ProblemFlags {
  std::string mechanism;
  std::optional<double> scale, lower_bound;
  bool qk_l2norm = false, beta_sigmoid = false, allow_neg_eigval = false;
  bool gate_in_kernel = false, state_v_first = false;
  int chunk_size = Options{}.chunk_size;
  int threads = 0;
};

// Adds --mechanism, --scale, --qk-l2norm, --beta-sigmoid, --allow-neg-eigval,
// --gate-in-kernel, --lower-bound and --state-v-first to `cmd`; returns them, --mechanism
// first, for the caller's `needs`.
std::vector<CLI::Option*> add_problem_options(CLI::App* cmd, ProblemFlags& f);

// A CLI11 check of --schedule with the library's own parser and message.
CLI::Validator schedule_spelling();

Options options_from(const ProblemFlags& f);

}  // namespace flashdelta::cli
