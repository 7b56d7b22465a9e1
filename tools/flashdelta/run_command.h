// `flashdelta run`: the forward on the tensors of a safetensors file (--in, --out), or,
// without --in, the built-in check of the fast schedules against the reference.
#pragma once

#include <CLI/CLI.hpp>

#include "flashdelta/options.h"
#include <optional>
#include <string>

namespace flashdelta::cli {

struct RunFlags {
  bool from_file = false;  // --in given
  std::string in, out;
  std::string mechanism;
  std::optional<std::string> schedule;  // default: chunk with --in, every one without
  std::string device = "cpu";
  std::optional<double> scale, lower_bound;
  bool qk_l2norm = false, beta_sigmoid = false, allow_neg_eigval = false;
  bool gate_in_kernel = false, state_v_first = false;
  bool chunk_states = false;  // also write the states before every 64th token
  int chunk_size = flashdelta::Options{}.chunk_size;
  int threads = 0;
};

CLI::App* add_run_command(CLI::App& app, RunFlags& flags);
void run_command(const RunFlags& flags);

}  // namespace flashdelta::cli
