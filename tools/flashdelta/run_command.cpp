#include "run_command.h"

#include <cstdio>
#include <string>

#include "flashdelta/flashdelta.h"
#include "flashdelta/safetensors.h"
#include "device_forward.h"
#include "forward_tensors.h"
#include "self_check.h"
#include "timing.h"

namespace flashdelta::cli {
namespace {

// A CLI11 check accepting exactly what the library's parser accepts, with its message, so
// the spellings live in one place (core/names.cpp).
template <class Parse>
CLI::Validator library_spelling(Parse parse, const std::string& choices) {
  return CLI::Validator(
      [parse](std::string& value) -> std::string {
        try {
          parse(value);
          return {};
        } catch (const Error& e) {
          return e.what();
        }
      },
      choices);
}

std::string mechanism_choices() {
  std::string s;
  for (Mechanism m : {Mechanism::linear_attention, Mechanism::simple_gla, Mechanism::gla,
                      Mechanism::deltanet, Mechanism::gated_deltanet, Mechanism::kda}) {
    if (!s.empty()) s += '|';
    s += mechanism_name(m);
  }
  return s;
}

Options options_from(const RunFlags& f) {
  Options o;
  o.mechanism = parse_mechanism(f.mechanism);
  o.scale = f.scale;
  o.qk_l2norm = f.qk_l2norm;
  o.beta_sigmoid = f.beta_sigmoid;
  o.allow_neg_eigval = f.allow_neg_eigval;
  o.gate_in_kernel = f.gate_in_kernel;
  o.lower_bound = f.lower_bound;
  o.state_layout = f.state_v_first ? StateLayout::v_first : StateLayout::k_first;
  o.chunk_size = f.chunk_size;
  o.num_threads = f.threads;
  return o;
}

void run_file(const RunFlags& f) {
  const Options options = options_from(f);
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
  CLI::Option* mechanism = cmd->add_option("--mechanism", f.mechanism, "The recurrence to run")
                               ->check(library_spelling(parse_mechanism, mechanism_choices()));
  in->needs(out);
  in->needs(mechanism);
  out->needs(in);
  // Where and how to run: with --in, for the file; without, the built-in check runs that
  // schedule (default: every fast schedule of the device) on that device.
  cmd->add_option_function<std::string>(
         "--schedule", [&f](const std::string& s) { f.schedule = s; },
         "reference, recurrent or chunk (default: chunk with --in)")
      ->check(library_spelling(parse_schedule, "reference|recurrent|chunk"));
  cmd->add_option("--device", f.device, "Where to run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  // Everything else describes the file's problem.
  const std::vector<CLI::Option*> with_in = {
      mechanism,
      cmd->add_option_function<double>(
          "--scale", [&f](double x) { f.scale = x; }, "Query scale (default K^-1/2)"),
      cmd->add_flag("--qk-l2norm", f.qk_l2norm, "L2-normalise q and k in the kernel"),
      cmd->add_flag("--beta-sigmoid", f.beta_sigmoid, "beta <- sigmoid(beta) in the kernel"),
      cmd->add_flag("--allow-neg-eigval", f.allow_neg_eigval,
                    "With --beta-sigmoid: beta <- 2 sigmoid(beta)"),
      cmd->add_flag("--gate-in-kernel", f.gate_in_kernel,
                    "g holds raw gates, activated with A_log and dt_bias"),
      cmd->add_option_function<double>(
          "--lower-bound", [&f](double x) { f.lower_bound = x; },
          "With --gate-in-kernel: g = lb sigmoid(...), lb in [-5, 0)"),
      cmd->add_flag("--state-v-first", f.state_v_first, "States are [N, HV, V, K]"),
      cmd->add_flag("--chunk-states", f.chunk_states,
                    "Also write chunk_states: the state before every 64th token of each "
                    "sequence, [C, HV, K, V] (fla's return_intermediate_states)"),
  };
  for (CLI::Option* o : with_in) o->needs(in);
  cmd->add_option("--chunk-size", f.chunk_size, "Tokens per chunk: 16, 32, 64 or 128")
      ->capture_default_str();
  cmd->add_option("--threads", f.threads, "Worker threads (0: all)")->capture_default_str();
  return cmd;
}

void run_command(const RunFlags& f) {
  if (f.from_file)
    run_file(f);
  else
    run_self_check(f.threads, f.chunk_size, f.device == "cuda" ? Device::cuda : Device::cpu,
                   f.schedule ? std::optional<Schedule>(parse_schedule(*f.schedule))
                              : std::nullopt);
}

}  // namespace flashdelta::cli
