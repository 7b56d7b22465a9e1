#include "run_command.h"

#include <cstdio>
#include <string>

#include "flashdelta/flashdelta.h"
#include "flashdelta/safetensors.h"
#include "device_calls.h"
#include "forward_tensors.h"
#include "self_check.h"
#include "timing.h"

namespace flashdelta::cli {
namespace {

void run_file(const RunFlags& f) {
  const Options options = options_from(f.problem);
  const Schedule schedule = parse_schedule(f.schedule.value_or("chunk"));
  const Device device = f.device == "cuda" ? Device::cuda : Device::cpu;

  io::TensorMap inputs = io::read_safetensors(f.in);
  check_input_names(inputs, f.in);
  ForwardOutputs outputs = make_forward_outputs(inputs, options.state_layout, f.chunk_states);
  const double elapsed =
      forward_on(device, make_forward_args(inputs, outputs), options, schedule);

  // The library accepted the inputs, so the outputs were sized from them.
  if (!outputs.o || !outputs.final_state || (f.chunk_states && !outputs.chunk_states))
    throw Error(ErrorCode::runtime, "internal: forward succeeded without sized outputs");
  io::TensorMap result;
  result.emplace("o", std::move(*outputs.o));
  result.emplace("final_state", std::move(*outputs.final_state));
  if (outputs.chunk_states) result.emplace("chunk_states", std::move(*outputs.chunk_states));
  // Only now, and atomically: a failed run leaves an existing --out untouched.
  io::write_safetensors(f.out, result);
  std::string wrote;
  for (const auto& [name, tensor] : result)
    wrote += (wrote.empty() ? "" : ", ") + name + " " + describe(tensor);
  std::printf("%s %s on %s: %.3f ms; wrote %s to %s\n", mechanism_name(options.mechanism),
              schedule_name(schedule), f.device.c_str(), elapsed * 1e3, wrote.c_str(),
              f.out.c_str());
}

}  // namespace

CLI::App* add_run_command(CLI::App& app, RunFlags& f) {
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Run the forward on the tensors of a safetensors file; without --in, check KDA and "
      "Gated DeltaNet on both fast schedules against the reference");
  CLI::Option* in = cmd->add_option_function<std::string>(
      "--in",
      [&f](const std::string& path) {
        f.in = path;
        f.from_file = true;
      },
      "Input tensors: q k v, and as needed g beta initial_state cu_seqlens A_log dt_bias");
  CLI::Option* out = cmd->add_option(
      "--out", f.out, "Output: o (dtype of v), final_state (F32), chunk_states (F32, if asked)");
  // What describes the file's problem needs --in; --in needs the mechanism.
  std::vector<CLI::Option*> with_in = add_problem_options(cmd, f.problem);
  in->needs(out);
  in->needs(with_in.front());
  out->needs(in);
  // Where and how to run: with --in, for the file; without, the built-in check runs that
  // schedule (default: every fast schedule of the device) on that device.
  cmd->add_option_function<std::string>(
         "--schedule", [&f](const std::string& s) { f.schedule = s; },
         "reference, recurrent or chunk (default: chunk with --in)")
      ->check(schedule_spelling());
  cmd->add_option("--device", f.device, "Where to run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  with_in.push_back(cmd->add_flag("--chunk-states", f.chunk_states,
                                  "Also write chunk_states: the state before every 64th token "
                                  "of each sequence, [C, HV, K, V] (fla's "
                                  "return_intermediate_states)"));
  for (CLI::Option* o : with_in) o->needs(in);
  cmd->add_option("--chunk-size", f.problem.chunk_size, "Tokens per chunk: 16, 32, 64 or 128")
      ->capture_default_str();
  cmd->add_option("--threads", f.problem.threads, "Worker threads (0: all)")
      ->capture_default_str();
  return cmd;
}

void run_command(const RunFlags& f) {
  if (f.from_file)
    run_file(f);
  else
    run_self_check(f.problem.threads, f.problem.chunk_size,
                   f.device == "cuda" ? Device::cuda : Device::cpu,
                   f.schedule ? std::optional<Schedule>(parse_schedule(*f.schedule))
                              : std::nullopt);
}

}  // namespace flashdelta::cli
