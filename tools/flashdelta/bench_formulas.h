// FLOP and byte counts behind every rate `flashdelta bench` reports, written down once.
// A multiply-add counts 2 FLOPs. Elementwise work on vectors of K or V values per token
// (gate activation, exponentials, L2 norms, sigmoid) is O(K + V) beside the O(K V) terms
// and left out, so the rates are slight underestimates of the work done.
#pragma once

#include <cstdint>

namespace flashdelta::cli::formulas {

// Recurrent schedule, per token and value head, on a K x V state (flashdelta.h steps 1-3):
//   forget  Diag(exp g) S            K V      (gated mechanisms)
//   predict S^T k                    2 K V    (delta rule)
//   write   S += k r^T               2 K V
//   read    o = S^T (scale q)        2 K V
constexpr double recurrent_flops_per_token(int64_t K, int64_t V, bool gated, bool delta) {
  const double kv = static_cast<double>(K) * static_cast<double>(V);
  return (gated ? kv : 0.0) + (delta ? 2 * kv : 0.0) + 4 * kv;
}

// Chunkwise schedule (DESIGN.md section 3), per token and value head, chunk size C. Per
// chunk of C tokens, counting the C x C tiles as dense products (the causal half is not
// subtracted):
//   A_kk, A_qk       2 C^2 K each            W = T (beta k)   2 C^2 K      (delta rule)
//   T = (I + A_kk)^-1    C^3 / 3             U = T (beta v)   2 C^2 V      (delta rule)
//   v_new = U - W S  2 C K V (delta rule)    S += k^T v_new   2 C K V,  decay K V
//   o = q S + A_qk v_new                     2 C K V + 2 C^2 V
// Divided by C: delta  6 K V + 2 C (3 K + 2 V) + C^2 / 3 + K V / C
//               linear 4 K V + 2 C (K + V) + K V / C
// At K = V = 128, C = 64 with the delta rule: 181,845 FLOPs (DESIGN.md: "about 180 kFLOP").
constexpr double chunk_flops_per_token(int64_t K, int64_t V, int64_t C, bool delta) {
  const double k = static_cast<double>(K), v = static_cast<double>(V);
  const double c = static_cast<double>(C);
  if (delta) return 6 * k * v + 2 * c * (3 * k + 2 * v) + c * c / 3 + k * v / c;
  return 4 * k * v + 2 * c * (k + v) + k * v / c;
}

// Bytes of float32 state one decode step moves: every state of N sequences x HV heads is
// read and written once (in place).
constexpr double decode_state_bytes(int64_t N, int64_t HV, int64_t K, int64_t V) {
  return 2.0 * static_cast<double>(N) * static_cast<double>(HV) * static_cast<double>(K) *
         static_cast<double>(V) * 4.0;
}

// Bytes one memcpy of n bytes moves: n read plus n written (as decode_state_bytes counts;
// the reads for ownership of the destination lines are not counted).
constexpr double memcpy_bytes(int64_t n) { return 2.0 * static_cast<double>(n); }

// Bytes an in-place rewrite of n bytes moves: n read plus n written.
constexpr double rewrite_bytes(int64_t n) { return 2.0 * static_cast<double>(n); }

static_assert(static_cast<int64_t>(chunk_flops_per_token(128, 128, 64, true)) == 181845);

}  // namespace flashdelta::cli::formulas
