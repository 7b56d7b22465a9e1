// Reference forward and decode: the fp64 scalar recurrence.
#include <vector>

#include "core/chunk_states.h"
#include "core/parallel.h"
#include "core/state_io.h"
#include "core/token_inputs.h"
#include "reference/reference.h"

namespace flashdelta::detail {

void reference_step(const Problem& p, double* S, const double* q, const double* k,
                    const double* v, const double* g, double beta, double* o) {
  const int64_t K = p.K, V = p.V;
  // 1. forget
  if (p.gate != GateKind::none)
    for (int64_t i = 0; i < K; ++i) {
      const double d = std::exp(p.gate == GateKind::vector ? g[i] : g[0]);
      for (int64_t j = 0; j < V; ++j) S[i * V + j] *= d;
    }
  // 2. write: delta rule r = beta (v - S^T k), or plain r = v
  double r[256];  // V <= 256 (validated)
  std::copy(v, v + V, r);
  if (p.delta) {
    for (int64_t j = 0; j < V; ++j) {
      double pred = 0;
      for (int64_t i = 0; i < K; ++i) pred += S[i * V + j] * k[i];
      r[j] = beta * (v[j] - pred);
    }
  }
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) S[i * V + j] += k[i] * r[j];
  // 3. read after write
  for (int64_t j = 0; j < V; ++j) {
    double acc = 0;
    for (int64_t i = 0; i < K; ++i) acc += S[i * V + j] * q[i];
    o[j] = p.scale * acc;
  }
}

namespace {

// Per-token buffers of one (sequence, head) worker.
struct TokenBuffers {
  std::vector<double> q, k, v, g, o;
  double beta = 0;
  explicit TokenBuffers(const Problem& p) : q(p.K), k(p.K), v(p.V), g(p.K), o(p.V) {}
};

}  // namespace

void reference_forward(const Problem& p, const ForwardIO& io) {
  const ChunkStateEntries entries(p);
  parallel_for(p.N * p.HV, p.options.num_threads, [&](int64_t item) {
    const int64_t n = item / p.HV, hv = item % p.HV;
    const Sequence& seq = p.seqs[n];
    const GateParams<double> gp = load_gate_params<double>(p, hv);
    std::vector<double> S(p.K * p.V, 0.0);
    if (io.initial_state.t.present()) load_state(io.initial_state, n, hv, p.K, p.V, S.data());
    TokenBuffers b(p);
    for (int64_t t = seq.t0; t < seq.t0 + seq.len; ++t) {
      const int64_t entry = entries.before(n, t - seq.t0);
      if (io.chunk_states.t.present() && entry >= 0)
        store_state(io.chunk_states, entry, hv, p.K, p.V, S.data());
      load_token(p, gp, seq.batch, t, hv, b.q.data(), b.k.data(), b.v.data(), b.g.data(), &b.beta);
      reference_step(p, S.data(), b.q.data(), b.k.data(), b.v.data(), b.g.data(), b.beta, b.o.data());
      store_row(io.o, offset_of(io.o, seq.batch, t, hv, 0), p.V, io.o.stride[3], b.o.data());
    }
    if (io.final_state.t.present()) store_state(io.final_state, n, hv, p.K, p.V, S.data());
  });
}

void reference_decode(const DecodeProblem& d, const TensorView& o) {
  const Problem& p = d.p;
  parallel_for(p.N * p.HV, p.options.num_threads, [&](int64_t item) {
    const int64_t n = item / p.HV, hv = item % p.HV;
    const Sequence& seq = p.seqs[n];
    TokenBuffers b(p);
    const int64_t start = decode_start_slot(d, n);
    if (start < 0) {  // padding row: zeros out, state untouched
      std::fill(b.o.begin(), b.o.end(), 0.0);
      for (int64_t t = seq.t0; t < seq.t0 + seq.len; ++t)
        store_row(o, offset_of(o, seq.batch, t, hv, 0), p.V, o.stride[3], b.o.data());
      return;
    }
    const GateParams<double> gp = load_gate_params<double>(p, hv);
    std::vector<double> S(p.K * p.V);
    load_state(d.pool, start, hv, p.K, p.V, S.data());
    for (int64_t t = 0; t < seq.len; ++t) {
      const int64_t tt = seq.t0 + t;
      load_token(p, gp, seq.batch, tt, hv, b.q.data(), b.k.data(), b.v.data(), b.g.data(), &b.beta);
      reference_step(p, S.data(), b.q.data(), b.k.data(), b.v.data(), b.g.data(), b.beta, b.o.data());
      store_row(o, offset_of(o, seq.batch, tt, hv, 0), p.V, o.stride[3], b.o.data());
      const int64_t slot = decode_slot_after(d, n, t);
      if (slot >= 0) store_state(d.pool, slot, hv, p.K, p.V, S.data());
    }
  });
}

}  // namespace flashdelta::detail
