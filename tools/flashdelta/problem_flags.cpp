#include "problem_flags.h"

#include "flashdelta/flashdelta.h"

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

}  // namespace

CLI::Validator schedule_spelling() {
  return library_spelling(parse_schedule, "reference|recurrent|chunk");
}

std::vector<CLI::Option*> add_problem_options(CLI::App* cmd, ProblemFlags& f) {
  return {
      cmd->add_option("--mechanism", f.mechanism, "The recurrence to run")
          ->check(library_spelling(parse_mechanism, mechanism_choices())),
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
  };
}

Options options_from(const ProblemFlags& f) {
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

}  // namespace flashdelta::cli
