// Token rows of the chunkwise CPU schedule: the inputs of several value heads over a run of
// tokens, read token by token (all heads of a token are adjacent in memory, so each page is
// visited once rather than once per head) through the fused transforms of load_token, and
// kept per head for the chunk pipeline. Rows are padded to kPad elements, so vectorised
// transforms (cpu/token_transforms-inl.h) can run whole vectors on them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/token_inputs.h"
#include "cpu/chunk_layout.h"

namespace flashdelta::detail::chunk {

// The rows of one head from some token on: row t of q, k and g (vector gate) at
// q + t * Kp, ..., v + t * Vp, g[t] (scalar gate), beta[t].
template <class T>
struct TokenRows {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  const T* g = nullptr;
  const T* beta = nullptr;
};

// Rows of `heads` value heads over up to `tokens` tokens.
template <class T>
class RowStaging {
 public:
  static int64_t size(const Dims& d, int64_t heads, int64_t tokens) {
    return heads * per_head(d, tokens);
  }
  // base holds size(d, heads, tokens) elements, zeroed (padding columns stay zero).
  RowStaging(T* base, const Dims& d, GateKind gate, int64_t heads, int64_t tokens)
      : base_(base),
        dm_(d),
        vector_gate_(gate == GateKind::vector),
        heads_(heads),
        tokens_(tokens) {}

  TokenRows<T> rows(int64_t head, int64_t t) const {
    const Parts s = parts(head);
    return {s.q + t * dm_.Kp, s.k + t * dm_.Kp, s.v + t * dm_.Vp, g_row(s, t), s.beta + t};
  }

  // Loads tokens [t0, t0 + len) of sequence seq for value heads [hv0, hv0 + heads), then
  // zero tokens up to padded_len (a multiple of kBlock, at most the capacity). Transforms:
  // see load_token.
  template <class Transforms>
  void load(const Problem& p, const std::vector<GateParams<T>>& gate_params, const Sequence& seq,
            int64_t hv0, int64_t t0, int64_t len, int64_t padded_len) {
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < heads_; ++h) {
        const Parts s = parts(h);
        load_token<T, Transforms>(p, gate_params[static_cast<size_t>(h)], seq.batch,
                                  seq.t0 + t0 + t, hv0 + h, s.q + t * dm_.Kp, s.k + t * dm_.Kp,
                                  s.v + t * dm_.Vp, g_row(s, t), s.beta + t);
      }
    for (int64_t h = 0; h < heads_; ++h) {
      const Parts s = parts(h);
      std::fill(s.q + len * dm_.Kp, s.q + padded_len * dm_.Kp, T(0));
      std::fill(s.k + len * dm_.Kp, s.k + padded_len * dm_.Kp, T(0));
      std::fill(s.v + len * dm_.Vp, s.v + padded_len * dm_.Vp, T(0));
      std::fill(g_row(s, len), g_row(s, padded_len), T(0));
      std::fill(s.beta + len, s.beta + padded_len, T(0));
    }
  }

 private:
  struct Parts {
    T *q, *k, *v, *g, *beta;
  };
  static int64_t per_head(const Dims& d, int64_t tokens) {
    return 3 * round_up(tokens * d.Kp, kPad) + round_up(tokens * d.Vp, kPad) +
           round_up(tokens, kPad);
  }
  Parts parts(int64_t head) const {
    Carver<T> c(base_ + head * per_head(dm_, tokens_));
    Parts s;
    s.q = c.take(tokens_ * dm_.Kp);
    s.k = c.take(tokens_ * dm_.Kp);
    s.g = c.take(tokens_ * dm_.Kp);
    s.v = c.take(tokens_ * dm_.Vp);
    s.beta = c.take(tokens_);
    return s;
  }
  // g rows are Kp wide for a vector gate, one value for a scalar gate.
  T* g_row(const Parts& s, int64_t t) const { return s.g + t * (vector_gate_ ? dm_.Kp : 1); }

  T* base_;
  Dims dm_;
  bool vector_gate_;
  int64_t heads_, tokens_;
};

}  // namespace flashdelta::detail::chunk
