// `flashdelta bench`: times the schedules on this machine over a sweep of model-sized
// problems, prints a table and writes the results with the machine's details as JSON.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace flashdelta::cli {

struct BenchFlags {
  std::string json_path = "flashdelta-bench.json";
  bool quick = false;
  std::vector<std::string> cases;  // empty: the default sweep
  int threads = 0;                 // 0: all the library would use
  int repeats = 5;
  double peak_gflops = 0;    // the FMA peak to report against; 0: measure it
  std::string command_line;  // recorded in the JSON
};

CLI::App* add_bench_command(CLI::App& app, BenchFlags& flags);
void run_bench(const BenchFlags& flags);

}  // namespace flashdelta::cli
