// A validated problem: resolved sizes, the sequence table and the input views, shared by
// every schedule. Built only by the validate_* functions (core/validate.cpp), so a
// schedule never sees an inconsistent argument.
#pragma once

#include <cstdint>
#include <vector>

#include "flashdelta/flashdelta.h"

namespace flashdelta::detail {

// Sequence n covers tokens [t0, t0 + len) of batch row `batch`.
struct Sequence {
  int64_t batch = 0;
  int64_t t0 = 0;
  int64_t len = 0;
};

// The inputs every schedule reads per token (q, k, v, g, beta and the gate parameters).
struct TokenViews {
  TensorView q, k, v, g, beta, A_log, dt_bias;
};

struct Problem {
  Options options;
  GateKind gate = GateKind::none;
  bool delta = false;
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t N = 0;       // number of sequences
  int64_t group = 1;   // HV / H: value heads per key head
  double scale = 1.0;  // resolved query scale
  std::vector<Sequence> seqs;  // empty when the offsets live on the device
  bool indices_on_host = true;  // false: cu_seqlens / state indices are device-resident
  TensorView cu_seqlens;        // as given (absent without varlen)
  TokenViews in;

  int64_t key_head(int64_t hv) const { return hv / group; }
  int64_t max_len() const {
    int64_t m = 0;
    for (const Sequence& s : seqs) m = s.len > m ? s.len : m;
    return m;
  }
};

// A state tensor [N, HV, K, V] or [N, HV, V, K]: element (n, hv, i, j) for key i, value j.
struct StateView {
  TensorView t;
  StateLayout layout = StateLayout::k_first;

  int64_t offset(int64_t n, int64_t hv, int64_t i, int64_t j) const {
    return layout == StateLayout::k_first ? offset_of_4(n, hv, i, j) : offset_of_4(n, hv, j, i);
  }
  // Element distance between consecutive values j of one key row i.
  int64_t value_step() const { return layout == StateLayout::k_first ? t.stride[3] : t.stride[2]; }
  // Element distance between consecutive keys i of one value column j.
  int64_t key_step() const { return layout == StateLayout::k_first ? t.stride[2] : t.stride[3]; }

 private:
  int64_t offset_of_4(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return a * t.stride[0] + b * t.stride[1] + c * t.stride[2] + d * t.stride[3];
  }
};

// Serving problem: the forward problem plus the pool addressing.
struct DecodeProblem {
  Problem p;
  StateView pool;
  TensorView state_indices;        // [N] or [N, S]
  TensorView num_accepted_tokens;  // optional
  bool per_token_slots = false;    // state_indices is [N, S]
};

Problem validate_forward(const ForwardArgs& args, const Options& options);
DecodeProblem validate_decode(const DecodeArgs& args, const Options& options);
Problem validate_backward(const BackwardArgs& args, const Options& options);

// Start slot of decode row n (-1 = padding row) and the slot written after its local token t
// (-1 = none).
int64_t decode_start_slot(const DecodeProblem& d, int64_t n);
int64_t decode_slot_after(const DecodeProblem& d, int64_t n, int64_t t);

}  // namespace flashdelta::detail
