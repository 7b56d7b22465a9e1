// `flashdelta run`: the forward on the tensors of a safetensors file (--in, --out), or,
// without --in, the built-in check of the fast schedules against the reference.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "problem_flags.h"

namespace flashdelta::cli {

struct RunFlags {
  bool from_file = false;  // --in given
  std::string in, out;
  ProblemFlags problem;
  std::optional<std::string> schedule;  // default: chunk with --in, every one without
  std::string device = "cpu";
  bool chunk_states = false;  // also write the states before every 64th token
};

CLI::App* add_run_command(CLI::App& app, RunFlags& flags);
void run_command(const RunFlags& flags);

}  // namespace flashdelta::cli
