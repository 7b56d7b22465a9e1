// Reference backward: the exact fp64 gradient of the recurrence's outputs (o and the final
// state) with respect to every input, through the fused input transforms.
//
// Per token the forward (reference_step) is
//   S1 = D S0 (D = Diag(exp g)),  p = S1^T k,  r = beta (v - p) (delta) or r = v (linear),
//   S2 = S1 + k r^T,  o = scale S2^T q.
// Given dS2 (the gradient of the state after the token) and d_o, the reverse step is
//   1. read:   dS2 += scale q d_o^T,             dq = scale S2 d_o
//   2. write:  dr = dS2^T k,                     dk = dS2 r
//      delta:  dv = beta dr,  dbeta = dr . (v - p),  dp = -beta dr,
//              dS1 = dS2 + k dp^T,               dk += S1 dp
//      linear: dv = dr,  dS1 = dS2
//   3. forget: dg_i = sum_j dS1[i, j] S1[i, j] (summed over i for a scalar gate),  dS0 = D dS1.
// The reverse pass needs every state, last first. Storing all T of them would take T K V
// doubles (50 GB at T = 100k, K = V = 256), so a forward pass keeps one checkpoint every C
// tokens and each segment's states are recomputed from its checkpoint: O(sqrt(T) K V) memory
// for about one extra forward pass. With BackwardArgs::chunk_states the segments are the
// 64-token chunks and their checkpoints the given states, read when the segment is reversed.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/chunk_states.h"
#include "core/parallel.h"
#include "core/state_io.h"
#include "core/token_inputs.h"
#include "reference/reference.h"

namespace flashdelta::detail {
namespace {

// ---- Derivatives of the fused input transforms (core/token_inputs.h) ----

// y = x / n with n = sqrt(sum x^2 + eps): dx = (dy - y (y . dy)) / n. Overwrites dy with dx.
void l2_normalize_backward(const double* x, int64_t size, double* dy) {
  double sum_sq = 0;
  for (int64_t i = 0; i < size; ++i) sum_sq += x[i] * x[i];
  const double inv_norm = 1.0 / std::sqrt(sum_sq + kL2NormEps);
  double y_dot_dy = 0;
  for (int64_t i = 0; i < size; ++i) y_dot_dy += x[i] * inv_norm * dy[i];
  for (int64_t i = 0; i < size; ++i) dy[i] = (dy[i] - x[i] * inv_norm * y_dot_dy) * inv_norm;
}

// sigmoid'(z) = sigmoid(z) sigmoid(-z): no cancellation in 1 - sigmoid(z) for large z.
double sigmoid_derivative(double z) { return sigmoid(z) * sigmoid(-z); }

// d beta / d beta_raw for beta = c sigmoid(beta_raw), c = 2 with allow_neg_eigval.
double beta_sigmoid_derivative(const Options& o, double beta_raw) {
  return (o.allow_neg_eigval ? 2.0 : 1.0) * sigmoid_derivative(beta_raw);
}

// Partial derivatives of the activated gate (gate_activation) with respect to its raw
// pre-activation (the same as to dt_bias) and to A_log.
struct GateDerivative {
  double d_raw = 1;
  double d_A_log = 0;
};

GateDerivative gate_derivative(const Options& o, const GateParams<double>& gp, int64_t i,
                               double raw) {
  const double x = raw + gp.bias[i];
  if (o.lower_bound) {
    // g = lb sigmoid(z), z = a x (or x without A_log); dz/dA_log = a x = z.
    const double lb = *o.lower_bound;
    const double z = gp.has_a ? gp.a * x : x;
    const double dg_dz = lb * sigmoid_derivative(z);
    return gp.has_a ? GateDerivative{dg_dz * gp.a, dg_dz * z} : GateDerivative{dg_dz, 0.0};
  }
  // g = -a softplus(x), a = exp(A_log): dg/dx = -a sigmoid(x), dg/dA_log = g.
  return {-gp.a * sigmoid(x), -gp.a * softplus(x)};
}

// ---- The reverse step ----

// One token of one value head: its inputs after the transforms, and the gradient of its output.
struct Token {
  std::vector<double> q, k, v, g, d_o;
  double beta = 0;
  explicit Token(const Problem& p) : q(p.K), k(p.K), v(p.V), g(p.K), d_o(p.V) {}
};

struct TokenGrad {
  std::vector<double> dq, dk, dv, dg;
  double dbeta = 0;
  explicit TokenGrad(const Problem& p) : dq(p.K), dk(p.K), dv(p.V), dg(p.K) {}
};

// Recomputed forward quantities and intermediate gradients of one reverse step.
struct StepScratch {
  std::vector<double> S1, pred, r, dr, dp;
  explicit StepScratch(const Problem& p) : S1(p.K * p.V), pred(p.V), r(p.V), dr(p.V), dp(p.V) {}
};

// Reverses one token (header comment, steps 1-3). S0 is the state before the token (row-major
// by key); dS enters as the gradient of the state after the token and leaves as that of S0.
void reverse_step(const Problem& p, const double* S0, const Token& x, double* dS, StepScratch& w,
                  TokenGrad& grad) {
  const int64_t K = p.K, V = p.V;
  double* S1 = w.S1.data();
  for (int64_t i = 0; i < K; ++i) {
    const double decay =
        p.gate == GateKind::none ? 1.0 : std::exp(x.g[p.gate == GateKind::vector ? i : 0]);
    for (int64_t j = 0; j < V; ++j) S1[i * V + j] = decay * S0[i * V + j];
  }
  std::copy(x.v.begin(), x.v.end(), w.r.begin());
  if (p.delta) {
    std::fill(w.pred.begin(), w.pred.end(), 0.0);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) w.pred[j] += S1[i * V + j] * x.k[i];
    for (int64_t j = 0; j < V; ++j) w.r[j] = x.beta * (x.v[j] - w.pred[j]);
  }

  // 1. read: o = scale (S1 + k r^T)^T q.
  double r_dot_do = 0;
  for (int64_t j = 0; j < V; ++j) r_dot_do += w.r[j] * x.d_o[j];
  for (int64_t i = 0; i < K; ++i) {
    double acc = 0;
    for (int64_t j = 0; j < V; ++j) acc += S1[i * V + j] * x.d_o[j];
    grad.dq[i] = p.scale * (acc + x.k[i] * r_dot_do);
    for (int64_t j = 0; j < V; ++j) dS[i * V + j] += p.scale * x.q[i] * x.d_o[j];
  }

  // 2. write: S2 = S1 + k r^T.
  std::fill(w.dr.begin(), w.dr.end(), 0.0);
  for (int64_t i = 0; i < K; ++i) {
    double acc = 0;
    for (int64_t j = 0; j < V; ++j) {
      w.dr[j] += dS[i * V + j] * x.k[i];
      acc += dS[i * V + j] * w.r[j];
    }
    grad.dk[i] = acc;
  }
  grad.dbeta = 0;
  if (p.delta) {
    for (int64_t j = 0; j < V; ++j) {
      grad.dv[j] = x.beta * w.dr[j];
      grad.dbeta += w.dr[j] * (x.v[j] - w.pred[j]);
      w.dp[j] = -x.beta * w.dr[j];
    }
    for (int64_t i = 0; i < K; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < V; ++j) {
        acc += S1[i * V + j] * w.dp[j];
        dS[i * V + j] += x.k[i] * w.dp[j];
      }
      grad.dk[i] += acc;
    }
  } else {
    std::copy(w.dr.begin(), w.dr.end(), grad.dv.begin());
  }

  // 3. forget: S1 = D S0.
  if (p.gate == GateKind::none) return;
  if (p.gate == GateKind::scalar) grad.dg[0] = 0;
  for (int64_t i = 0; i < K; ++i) {
    double acc = 0;
    for (int64_t j = 0; j < V; ++j) acc += dS[i * V + j] * S1[i * V + j];
    if (p.gate == GateKind::vector)
      grad.dg[i] = acc;
    else
      grad.dg[0] += acc;
    const double decay = std::exp(x.g[p.gate == GateKind::vector ? i : 0]);
    for (int64_t j = 0; j < V; ++j) dS[i * V + j] *= decay;
  }
}

// ---- One sequence, one key head ----

// Number of dt_bias entries per value head: one per key channel (vector gate) or one.
int64_t bias_width(const Problem& p) { return p.gate == GateKind::vector ? p.K : 1; }

// Offset and element step of value head hv's row of dt_bias (or of ddt_bias, same shape).
int64_t bias_row_offset(const TensorView& t, int64_t hv, int64_t width) {
  return t.rank == 2 ? offset_of(t, hv, 0) : offset_of(t, hv * width);
}
int64_t bias_row_step(const TensorView& t) { return t.rank == 2 ? t.stride[1] : t.stride[0]; }

// Offset and element step of token t's gate row in g or dg: [B, T, HV, K] or [B, T, HV].
int64_t gate_row_offset(const TensorView& t, int64_t b, int64_t token, int64_t hv) {
  return t.rank == 4 ? offset_of(t, b, token, hv, 0) : offset_of(t, b, token, hv);
}
int64_t gate_row_step(const TensorView& t) { return t.rank == 4 ? t.stride[3] : 1; }

// Tokens between state checkpoints. A key-head group of G value heads keeps G * len / C
// checkpoints plus the C states of the segment being reversed; C = sqrt(G * len) minimises
// their sum.
int64_t segment_length(int64_t len, int64_t group) {
  const auto c = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(len * group))));
  return std::clamp<int64_t>(c, 1, std::max<int64_t>(len, 1));
}

// What one value head carries through the reverse pass.
struct ValueHead {
  int64_t hv = 0;
  GateParams<double> gp;
  std::vector<double> checkpoints;  // the state before token s * C, per segment s
  std::vector<double> dS;           // gradient of the state at the current reverse position
};

// Sums over the tokens of each (sequence, value head) of the gate-parameter gradients,
// reduced over sequences afterwards in a fixed order.
struct GateParamSums {
  std::vector<double> dA_log;    // [N, HV]
  std::vector<double> ddt_bias;  // [N, HV, bias_width]
};

// Backward of sequence n for key head h and the value heads that share it. dq and dk sum
// over those value heads, so the heads are reversed one after another per segment and the
// segment's dq, dk are written once, complete.
class GroupBackward {
 public:
  // `entries` numbers BackwardArgs::chunk_states (unused when that is absent).
  GroupBackward(const Problem& p, const BackwardArgs& a, const ChunkStateEntries& entries,
                int64_t n, int64_t h, GateParamSums& sums)
      : p_(p),
        a_(a),
        given_{a.chunk_states, p.options.state_layout},
        entries_(entries),
        n_(n),
        h_(h),
        seq_(p.seqs[n]),
        seg_len_(given_.t.present() ? kChunkStateTokens : segment_length(seq_.len, p.group)),
        num_segments_((seq_.len + seg_len_ - 1) / seg_len_),
        heads_(p.group),
        sums_(sums),
        x_(p),
        grad_(p),
        scratch_(p),
        o_(p.V) {}

  void run() {
    const int64_t KV = p_.K * p_.V;
    for (int64_t gi = 0; gi < p_.group; ++gi) checkpoint_forward(heads_[gi], h_ * p_.group + gi);
    std::vector<double> states(seg_len_ * KV);
    std::vector<double> dq(seg_len_ * p_.K), dk(seg_len_ * p_.K);
    for (int64_t s = num_segments_ - 1; s >= 0; --s) {
      const int64_t t_begin = seq_.t0 + s * seg_len_;
      const int64_t len = std::min(seg_len_, seq_.t0 + seq_.len - t_begin);
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dk.begin(), dk.end(), 0.0);
      for (ValueHead& head : heads_) {
        // Recompute the states before each token of the segment, then reverse them.
        if (given_.t.present())
          load_state(given_, entries_.before(n_, s * seg_len_), head.hv, p_.K, p_.V,
                     states.data());
        else
          std::copy_n(head.checkpoints.begin() + s * KV, KV, states.begin());
        for (int64_t i = 0; i + 1 < len; ++i) {
          std::copy_n(states.begin() + i * KV, KV, states.begin() + (i + 1) * KV);
          advance(head, t_begin + i, states.data() + (i + 1) * KV);
        }
        for (int64_t i = len - 1; i >= 0; --i) {
          const int64_t t = t_begin + i;
          load_token(p_, head.gp, seq_.batch, t, head.hv, x_.q.data(), x_.k.data(), x_.v.data(),
                     x_.g.data(), &x_.beta);
          load_row(a_.d_o, offset_of(a_.d_o, seq_.batch, t, head.hv, 0), p_.V, a_.d_o.stride[3],
                   x_.d_o.data());
          reverse_step(p_, states.data() + i * KV, x_, head.dS.data(), scratch_, grad_);
          for (int64_t c = 0; c < p_.K; ++c) {
            dq[i * p_.K + c] += grad_.dq[c];
            dk[i * p_.K + c] += grad_.dk[c];
          }
          store_value_head_grads(head, t);
        }
      }
      store_key_grads(a_.q, a_.dq, t_begin, len, dq);
      store_key_grads(a_.k, a_.dk, t_begin, len, dk);
    }
    const StateView d_initial{a_.d_initial_state, p_.options.state_layout};
    if (d_initial.t.present())
      for (const ValueHead& head : heads_)
        store_state(d_initial, n_, head.hv, p_.K, p_.V, head.dS.data());
  }

 private:
  // Runs value head hv forward over the sequence, keeping the state at each segment start
  // (unless the states are given), and seeds its state gradient with d_final_state.
  void checkpoint_forward(ValueHead& head, int64_t hv) {
    const int64_t KV = p_.K * p_.V;
    const StateLayout layout = p_.options.state_layout;
    head.hv = hv;
    head.gp = load_gate_params<double>(p_, hv);
    head.dS.assign(KV, 0.0);
    const StateView d_final{a_.d_final_state, layout};
    if (d_final.t.present()) load_state(d_final, n_, hv, p_.K, p_.V, head.dS.data());
    if (given_.t.present()) return;
    head.checkpoints.resize(num_segments_ * KV);
    std::vector<double> S(KV, 0.0);
    const StateView initial{a_.initial_state, layout};
    if (initial.t.present()) load_state(initial, n_, hv, p_.K, p_.V, S.data());
    for (int64_t s = 0; s < num_segments_; ++s) {
      std::copy(S.begin(), S.end(), head.checkpoints.begin() + s * KV);
      if (s + 1 == num_segments_) break;  // the last segment is recomputed in reverse
      for (int64_t t = seq_.t0 + s * seg_len_; t < seq_.t0 + (s + 1) * seg_len_; ++t)
        advance(head, t, S.data());
    }
  }

  // Applies token t of the head's forward to S.
  void advance(const ValueHead& head, int64_t t, double* S) {
    load_token(p_, head.gp, seq_.batch, t, head.hv, x_.q.data(), x_.k.data(), x_.v.data(),
               x_.g.data(), &x_.beta);
    reference_step(p_, S, x_.q.data(), x_.k.data(), x_.v.data(), x_.g.data(), x_.beta, o_.data());
  }

  // Writes dv, dbeta and dg of token t (in grad_) through the transforms, and adds the
  // token's share of the gate-parameter gradients.
  void store_value_head_grads(const ValueHead& head, int64_t t) {
    const Options& o = p_.options;
    const int64_t b = seq_.batch, hv = head.hv;
    if (a_.dv.present())
      store_row(a_.dv, offset_of(a_.dv, b, t, hv, 0), p_.V, a_.dv.stride[3], grad_.dv.data());
    if (a_.dbeta.present()) {
      double dbeta = grad_.dbeta;
      if (o.beta_sigmoid)
        dbeta *= beta_sigmoid_derivative(
            o, load_scalar<double>(p_.in.beta, offset_of(p_.in.beta, b, t, hv)));
      store_row(a_.dbeta, offset_of(a_.dbeta, b, t, hv), 1, 1, &dbeta);
    }
    if (p_.gate == GateKind::none) return;
    const int64_t width = bias_width(p_);
    if (o.gate_in_kernel) {
      double raw[256];
      const TensorView& g = p_.in.g;
      load_row(g, gate_row_offset(g, b, t, hv), width, gate_row_step(g), raw);
      double* dA_log = &sums_.dA_log[n_ * p_.HV + hv];
      double* ddt_bias = &sums_.ddt_bias[(n_ * p_.HV + hv) * width];
      for (int64_t i = 0; i < width; ++i) {
        const GateDerivative d = gate_derivative(o, head.gp, i, raw[i]);
        *dA_log += grad_.dg[i] * d.d_A_log;
        grad_.dg[i] *= d.d_raw;
        ddt_bias[i] += grad_.dg[i];
      }
    }
    if (a_.dg.present())
      store_row(a_.dg, gate_row_offset(a_.dg, b, t, hv), width, gate_row_step(a_.dg),
                grad_.dg.data());
  }

  // Writes the gradients of the raw key-head rows q or k of tokens [t_begin, t_begin + len),
  // given those of their (normalised) values in `grad` ([len, K]).
  void store_key_grads(const TensorView& input, const TensorView& out, int64_t t_begin, int64_t len,
                       std::vector<double>& grad) {
    if (!out.present()) return;
    const int64_t K = p_.K, b = seq_.batch;
    std::vector<double> raw(K);
    for (int64_t i = 0; i < len; ++i) {
      double* row = grad.data() + i * K;
      if (p_.options.qk_l2norm) {
        load_row(input, offset_of(input, b, t_begin + i, h_, 0), K, input.stride[3], raw.data());
        l2_normalize_backward(raw.data(), K, row);
      }
      store_row(out, offset_of(out, b, t_begin + i, h_, 0), K, out.stride[3], row);
    }
  }

  const Problem& p_;
  const BackwardArgs& a_;
  const StateView given_;  // BackwardArgs::chunk_states (absent view: recompute)
  const ChunkStateEntries& entries_;
  const int64_t n_, h_;
  const Sequence& seq_;
  const int64_t seg_len_, num_segments_;
  std::vector<ValueHead> heads_;
  GateParamSums& sums_;
  Token x_;
  TokenGrad grad_;
  StepScratch scratch_;
  std::vector<double> o_;  // the output of a recomputed step, unused
};

}  // namespace

void reference_backward(const Problem& p, const BackwardArgs& a) {
  const int64_t width = bias_width(p);
  GateParamSums sums{std::vector<double>(p.N * p.HV, 0.0),
                     std::vector<double>(p.N * p.HV * width, 0.0)};
  const ChunkStateEntries entries(p);
  parallel_for(p.N * p.H, p.options.num_threads, [&](int64_t item) {
    GroupBackward(p, a, entries, item / p.H, item % p.H, sums).run();
  });

  // A_log and dt_bias are shared by every token of every sequence: sum in sequence order.
  for (int64_t hv = 0; hv < p.HV; ++hv) {
    double dA_log = 0;
    std::vector<double> ddt_bias(width, 0.0);
    for (int64_t n = 0; n < p.N; ++n) {
      dA_log += sums.dA_log[n * p.HV + hv];
      for (int64_t i = 0; i < width; ++i) ddt_bias[i] += sums.ddt_bias[(n * p.HV + hv) * width + i];
    }
    if (a.dA_log.present()) store_row(a.dA_log, offset_of(a.dA_log, hv), 1, 1, &dA_log);
    if (a.ddt_bias.present())
      store_row(a.ddt_bias, bias_row_offset(a.ddt_bias, hv, width), width,
                bias_row_step(a.ddt_bias), ddt_bias.data());
  }
}

}  // namespace flashdelta::detail
