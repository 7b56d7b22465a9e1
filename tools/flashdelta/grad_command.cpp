#include "grad_command.h"

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "flashdelta/flashdelta.h"
#include "flashdelta/safetensors.h"
#include "device_calls.h"
#include "forward_tensors.h"

namespace flashdelta::cli {
namespace {

// The tensors the backward reads besides the forward's inputs.
const std::vector<std::string> kBackwardInputNames = {"d_o", "d_final_state", "chunk_states"};

// Every tensor the file may hold, and its field of BackwardArgs.
constexpr std::pair<const char*, TensorView BackwardArgs::*> kInputs[] = {
    {"q", &BackwardArgs::q},
    {"k", &BackwardArgs::k},
    {"v", &BackwardArgs::v},
    {"g", &BackwardArgs::g},
    {"beta", &BackwardArgs::beta},
    {"initial_state", &BackwardArgs::initial_state},
    {"cu_seqlens", &BackwardArgs::cu_seqlens},
    {"A_log", &BackwardArgs::A_log},
    {"dt_bias", &BackwardArgs::dt_bias},
    {"d_o", &BackwardArgs::d_o},
    {"d_final_state", &BackwardArgs::d_final_state},
    {"chunk_states", &BackwardArgs::chunk_states},
};

// Each differentiable input and the name of its gradient in the output file (the field of
// BackwardArgs).
struct Differentiable {
  const char* input;
  const char* grad;
  TensorView BackwardArgs::*grad_field;
};
constexpr Differentiable kDifferentiable[] = {
    {"q", "dq", &BackwardArgs::dq},
    {"k", "dk", &BackwardArgs::dk},
    {"v", "dv", &BackwardArgs::dv},
    {"g", "dg", &BackwardArgs::dg},
    {"beta", "dbeta", &BackwardArgs::dbeta},
    {"initial_state", "d_initial_state", &BackwardArgs::d_initial_state},
    {"A_log", "dA_log", &BackwardArgs::dA_log},
    {"dt_bias", "ddt_bias", &BackwardArgs::ddt_bias},
};

}  // namespace

CLI::App* add_grad_command(CLI::App& app, GradFlags& f) {
  CLI::App* cmd = app.add_subcommand(
      "grad",
      "Run the backward on the tensors of a safetensors file: the forward's inputs, d_o, and "
      "optionally d_final_state and chunk_states");
  cmd->add_option("--in", f.in,
                  "Input tensors: q k v d_o, and as needed g beta initial_state cu_seqlens "
                  "A_log dt_bias d_final_state chunk_states")
      ->required();
  cmd->add_option("--out", f.out,
                  "Output: the gradient of every differentiable input present (dq dk dv dg "
                  "dbeta d_initial_state dA_log ddt_bias), F32 (F64 for F64 inputs)")
      ->required();
  add_problem_options(cmd, f.problem).front()->required();
  cmd->add_option_function<std::string>(
         "--schedule", [&f](const std::string& s) { f.schedule = s; },
         "reference (the CPU's) or chunk (CUDA's); default: the device's")
      ->check(schedule_spelling());
  cmd->add_option("--device", f.device, "Where to run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--threads", f.problem.threads, "Worker threads (0: all)")
      ->capture_default_str();
  return cmd;
}

void grad_command(const GradFlags& f) {
  const Options options = options_from(f.problem);
  const Device device = f.device == "cuda" ? Device::cuda : Device::cpu;
  const Schedule schedule = parse_schedule(
      f.schedule.value_or(device == Device::cuda ? "chunk" : "reference"));

  io::TensorMap inputs = io::read_safetensors(f.in);
  check_input_names(inputs, f.in, kBackwardInputNames);
  BackwardArgs a;
  for (const auto& [name, field] : kInputs) {
    const auto it = inputs.find(name);
    if (it != inputs.end()) a.*field = it->second.view();
  }
  // A gradient per differentiable input present, with its shape: float32, float64 for
  // float64 inputs (the reference's precision kept).
  io::TensorMap result;
  for (const Differentiable& d : kDifferentiable) {
    const auto it = inputs.find(d.input);
    if (it == inputs.end()) continue;
    const DType dtype = it->second.dtype == DType::f64 ? DType::f64 : DType::f32;
    io::OwnedTensor& grad =
        result.emplace(d.grad, io::OwnedTensor(dtype, it->second.shape)).first->second;
    a.*d.grad_field = grad.view();
  }
  const double elapsed = backward_on(device, a, options, schedule);

  // Only now, and atomically: a failed run leaves an existing --out untouched.
  io::write_safetensors(f.out, result);
  std::string wrote;
  for (const auto& [name, tensor] : result)
    wrote += (wrote.empty() ? "" : ", ") + name + " " + describe(tensor);
  std::printf("%s backward, %s on %s: %.3f ms; wrote %s to %s\n",
              mechanism_name(options.mechanism), schedule_name(schedule), f.device.c_str(),
              elapsed * 1e3, wrote.c_str(), f.out.c_str());
}

}  // namespace flashdelta::cli
