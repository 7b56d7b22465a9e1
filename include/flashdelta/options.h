// FlashDelta options: which mechanism, which fused input transforms, which schedule.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace flashdelta {

// The gate decays the state before each write: none, one scalar per (token, value head),
// or one value per key channel.
enum class GateKind : uint8_t { none, scalar, vector };

// The six mechanisms are one recurrence, parametrised by gate kind x delta rule.
enum class Mechanism : uint8_t { linear_attention, simple_gla, gla, deltanet, gated_deltanet, kda };

struct MechanismTraits {
  GateKind gate;
  bool delta;  // delta-rule write (needs beta) instead of the plain additive write
};

constexpr MechanismTraits traits(Mechanism m) {
  switch (m) {
    case Mechanism::linear_attention: return {GateKind::none, false};
    case Mechanism::simple_gla: return {GateKind::scalar, false};
    case Mechanism::gla: return {GateKind::vector, false};
    case Mechanism::deltanet: return {GateKind::none, true};
    case Mechanism::gated_deltanet: return {GateKind::scalar, true};
    case Mechanism::kda: return {GateKind::vector, true};
  }
  return {GateKind::none, false};
}

// Command-line / Python spelling: linear, simple_gla, gla, deltanet, gated_deltanet, kda.
const char* mechanism_name(Mechanism m);
// Throws Error(invalid_argument) naming the accepted spellings.
Mechanism parse_mechanism(std::string_view name);

// State [N, HV, K, V] (k_first, the default) or [N, HV, V, K] (v_first).
enum class StateLayout : uint8_t { k_first, v_first };

// reference: the scalar fp64 recurrence (the truth; slow).
// recurrent: token by token (decode).  chunk: chunkwise matrix form (prefill, training).
enum class Schedule : uint8_t { reference, recurrent, chunk };
const char* schedule_name(Schedule s);
Schedule parse_schedule(std::string_view name);

struct Options {
  Mechanism mechanism = Mechanism::kda;
  // Query scale (finite); absent means K^-1/2.
  std::optional<double> scale;
  // q, k <- x / sqrt(sum x^2 + 1e-6) per token and head, before use.
  bool qk_l2norm = false;
  // beta <- sigmoid(beta_raw) (or 2 * sigmoid(beta_raw) with allow_neg_eigval).
  bool beta_sigmoid = false;
  // Only meaningful with beta_sigmoid: beta in (0, 2), so the transition may have
  // negative eigenvalues.
  bool allow_neg_eigval = false;
  // g holds raw gate pre-activations; with x = g + dt_bias:
  //   no lower bound:   g = -exp(A_log[hv]) * softplus(x)          (A_log required)
  //   lower bound lb:   g = lb * sigmoid(exp(A_log[hv]) * x), or lb * sigmoid(x) without A_log
  // (lb finite and < 0; lower_bound only with gate_in_kernel)
  bool gate_in_kernel = false;
  std::optional<double> lower_bound;
  StateLayout state_layout = StateLayout::k_first;
  // Tokens per chunk of the CPU chunkwise schedule: 16, 32, 64 or 128. 16 is the fastest
  // on the CPU (bench/NOTES.md): the chunk form does less work in its small blocks. The CUDA
  // chunk schedule always uses 64.
  int chunk_size = 16;
  // CPU worker threads (>= 0); 0 means all available.
  int num_threads = 0;
};

}  // namespace flashdelta
