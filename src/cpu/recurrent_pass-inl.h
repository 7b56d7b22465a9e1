// The hot loop of the recurrent schedule: one pass over a K x W state tile per token.
//
// The tile holds the state in a rescaled form S = Diag(G) S_hat, where G is the cumulative
// decay since the last rebase token (see recurrent_pack-inl.h). One pass for token t does,
// for every key row i and with r = beta (v - pred) (delta rule) or r = v (linear):
//
//   rebase token:  S_hat[i] = f[i] * S_hat[i] + a[i] * r      (f = decay folded into S_hat)
//   otherwise:     S_hat[i] =                  S_hat[i] + a[i] * r
//   o    += b[i] * S_hat[i]                                    (read of token t)
//   pred += c[i] * S_hat[i]                                    (predict of token t + 1)
//
// so each state row is loaded and stored once per token, and the predict of the next token
// rides along with the read of this one. a = k / G, b = scale G q, c = G' k' (next token).
//
// Per-target code (Highway): included once per target from recurrent.cpp.
#if defined(FLASHDELTA_CPU_RECURRENT_PASS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHDELTA_CPU_RECURRENT_PASS_INL_H_
#undef FLASHDELTA_CPU_RECURRENT_PASS_INL_H_
#else
#define FLASHDELTA_CPU_RECURRENT_PASS_INL_H_
#endif

#include <cstddef>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using FloatTag = hn::ScalableTag<float>;

// Tile rows are one or two vectors wide. Measured on Zen 4 (AVX-512): two vectors per row
// reach 95% of the FMA peak, while wider rows (3 or 4 vectors, 16 or 32 KB tiles) stall on
// the loads and stores at 75%.
inline constexpr size_t kMaxTileVectors = 2;

// Independent accumulator sets for the o / pred chains (one FMA per row each, 4 cycles of
// latency). AVX-512 retires one 16-lane FMA per cycle, so a row of two vectors (6 FMAs)
// already covers the latency; narrower targets retire two FMAs per cycle and need two sets.
template <size_t NV>
constexpr size_t AccumulatorSets() {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return NV >= 2 ? 1 : 2;
#else
  return 2;
#endif
}

// Per-token coefficients of one pass, each K floats (see the file comment).
struct PassCoefficients {
  const float* a;  // update: k / G
  const float* b;  // read: scale G q
  const float* c;  // predict of the next token: G' k'
  const float* f;  // rebase factors (rebase tokens only)
};

// One token on a K x (NV lanes) tile with row stride NV lanes. `pred` holds the prediction
// S^T k of this token on entry (delta rule) and that of the next token on exit (kPredict).
// `o` receives this token's read.
template <size_t NV, bool kDelta, bool kRebase, bool kPredict>
HWY_NOINLINE void TokenPass(const PassCoefficients& co, size_t K, const float* HWY_RESTRICT v,
                            float beta, float* HWY_RESTRICT pred, float* HWY_RESTRICT S,
                            float* HWY_RESTRICT o) {
  constexpr size_t kSets = AccumulatorSets<NV>();
  const FloatTag d;
  const size_t N = hn::Lanes(d);
  const size_t W = NV * N;
  using V = hn::Vec<FloatTag>;
  // Local restrict copies: the pointers must not be re-read after every store to S.
  const float* HWY_RESTRICT ka = co.a;
  const float* HWY_RESTRICT qb = co.b;
  const float* HWY_RESTRICT kc = co.c;
  const float* HWY_RESTRICT fr = co.f;
  V r[NV], os[kSets][NV], ps[kSets][NV];
  for (size_t c = 0; c < NV; ++c) {
    r[c] = hn::Load(d, v + c * N);
    if constexpr (kDelta)
      r[c] = hn::Mul(hn::Set(d, beta), hn::Sub(r[c], hn::Load(d, pred + c * N)));
    for (size_t u = 0; u < kSets; ++u) os[u][c] = ps[u][c] = hn::Zero(d);
  }
  // Updates row i in place and accumulates its read and predict into set u.
  auto row = [&](size_t i, size_t u) HWY_ATTR {
    const V a = hn::Set(d, ka[i]);
    const V b = hn::Set(d, qb[i]);
    float* HWY_RESTRICT s_row = S + i * W;
    for (size_t c = 0; c < NV; ++c) {
      V s = hn::Load(d, s_row + c * N);
      if constexpr (kRebase) s = hn::Mul(s, hn::Set(d, fr[i]));
      s = hn::MulAdd(a, r[c], s);
      hn::Store(s, d, s_row + c * N);
      os[u][c] = hn::MulAdd(b, s, os[u][c]);
      if constexpr (kPredict) ps[u][c] = hn::MulAdd(hn::Set(d, kc[i]), s, ps[u][c]);
    }
  };
  size_t i = 0;
  for (; i + kSets <= K; i += kSets)
    for (size_t u = 0; u < kSets; ++u) row(i + u, u);
  for (; i < K; ++i) row(i, 0);
  for (size_t c = 0; c < NV; ++c) {
    V o_sum = os[0][c], p_sum = ps[0][c];
    for (size_t u = 1; u < kSets; ++u) {
      o_sum = hn::Add(o_sum, os[u][c]);
      p_sum = hn::Add(p_sum, ps[u][c]);
    }
    hn::Store(o_sum, d, o + c * N);
    if constexpr (kPredict) hn::Store(p_sum, d, pred + c * N);
  }
}

// pred = S^T c: the prediction of a sequence's first token from its initial state.
template <size_t NV>
HWY_NOINLINE void PredictPass(const float* HWY_RESTRICT c_coef, size_t K,
                              const float* HWY_RESTRICT S, float* HWY_RESTRICT pred) {
  const FloatTag d;
  const size_t N = hn::Lanes(d);
  const size_t W = NV * N;
  using V = hn::Vec<FloatTag>;
  V p0[NV], p1[NV];
  for (size_t c = 0; c < NV; ++c) p0[c] = p1[c] = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 <= K; i += 2) {
    const V c0 = hn::Set(d, c_coef[i]), c1 = hn::Set(d, c_coef[i + 1]);
    for (size_t c = 0; c < NV; ++c) {
      p0[c] = hn::MulAdd(c0, hn::Load(d, S + i * W + c * N), p0[c]);
      p1[c] = hn::MulAdd(c1, hn::Load(d, S + (i + 1) * W + c * N), p1[c]);
    }
  }
  if (i < K) {
    const V c0 = hn::Set(d, c_coef[i]);
    for (size_t c = 0; c < NV; ++c) p0[c] = hn::MulAdd(c0, hn::Load(d, S + i * W + c * N), p0[c]);
  }
  for (size_t c = 0; c < NV; ++c) hn::Store(hn::Add(p0[c], p1[c]), d, pred + c * N);
}

// Run-time flags to template arguments: one token on a tile of nv vectors per row.
template <size_t NV, bool kDelta>
void TokenPassFor(bool rebase, bool predict, const PassCoefficients& co, size_t K, const float* v,
                  float beta, float* pred, float* S, float* o) {
  if (rebase) {
    if (predict) return TokenPass<NV, kDelta, true, kDelta>(co, K, v, beta, pred, S, o);
    return TokenPass<NV, kDelta, true, false>(co, K, v, beta, pred, S, o);
  }
  if (predict) return TokenPass<NV, kDelta, false, kDelta>(co, K, v, beta, pred, S, o);
  return TokenPass<NV, kDelta, false, false>(co, K, v, beta, pred, S, o);
}

}  // namespace flashdelta::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // FLASHDELTA_CPU_RECURRENT_PASS_INL_H_
