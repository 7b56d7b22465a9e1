// Decode in place: one token on a whole K x V state that stays where it is (a float32 pool
// slot with dense rows), read and written row after row.
//
// Decode is bound by memory bandwidth: each step reads and writes every state once. Copying
// the state into L1 tiles (recurrent_tile.h) would read it column block by column block;
// here the predict pass streams the rows in address order (and prefetches ahead) while the
// update pass finds them in L2. Every token is a rebase token (G = 1: f = exp(g), a = k,
// b = scale q, c = exp(g') k'), so the state in the slot is the true state after each token.
//
// Per-target code (Highway): included once per target from recurrent.cpp.
#if defined(FLASHDELTA_CPU_RECURRENT_STREAM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHDELTA_CPU_RECURRENT_STREAM_INL_H_
#undef FLASHDELTA_CPU_RECURRENT_STREAM_INL_H_
#else
#define FLASHDELTA_CPU_RECURRENT_STREAM_INL_H_
#endif

#include <cstddef>

#include "cpu/recurrent_pass-inl.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows fetched ahead of the predict pass: 8 rows of 512 B keep one 4 KB page in flight.
inline constexpr size_t kStreamRowsAhead = 8;

// pred = S^T c over the K rows (stride ld) of a state in memory; V a multiple of the lanes.
HWY_NOINLINE void StreamPredict(const float* HWY_RESTRICT c, size_t K, size_t V, size_t ld,
                                const float* HWY_RESTRICT S, float* HWY_RESTRICT pred) {
  const FloatTag d;
  const size_t N = hn::Lanes(d);
  for (size_t j = 0; j < V; j += N) hn::Store(hn::Zero(d), d, pred + j);
  size_t i = 0;
  for (; i + 2 <= K; i += 2) {
    const auto c0 = hn::Set(d, c[i]), c1 = hn::Set(d, c[i + 1]);
    const float* HWY_RESTRICT row0 = S + i * ld;
    const float* HWY_RESTRICT row1 = row0 + ld;
    for (size_t j = 0; j < V; j += N) {
      if (i + kStreamRowsAhead + 1 < K) {
        hwy::Prefetch(row0 + kStreamRowsAhead * ld + j);
        hwy::Prefetch(row1 + kStreamRowsAhead * ld + j);
      }
      const auto p = hn::MulAdd(c0, hn::LoadU(d, row0 + j), hn::Load(d, pred + j));
      hn::Store(hn::MulAdd(c1, hn::LoadU(d, row1 + j), p), d, pred + j);
    }
  }
  if (i < K) {
    const auto c0 = hn::Set(d, c[i]);
    for (size_t j = 0; j < V; j += N)
      hn::Store(hn::MulAdd(c0, hn::LoadU(d, S + i * ld + j), hn::Load(d, pred + j)), d, pred + j);
  }
}

// One token in place: S[i] = f[i] S[i] + a[i] r (f only with kGated), o = S^T b, and with
// kPredict pred = S^T c for the next token. r (V floats) is scratch; on entry pred holds
// this token's prediction (delta rule). `next` (may be null) is the state this thread streams
// next, fetched row by row meanwhile, so memory stays busy while this pass works from L2.
template <bool kDelta, bool kGated, bool kPredict>
HWY_NOINLINE void StreamTokenPass(const PassCoefficients& co, size_t K, size_t V, size_t ld,
                                  const float* HWY_RESTRICT v, float beta, float* HWY_RESTRICT pred,
                                  float* HWY_RESTRICT r, float* HWY_RESTRICT S,
                                  float* HWY_RESTRICT o, const float* next) {
  const FloatTag d;
  const size_t N = hn::Lanes(d);
  const float* HWY_RESTRICT ka = co.a;
  const float* HWY_RESTRICT qb = co.b;
  const float* HWY_RESTRICT kc = co.c;
  const float* HWY_RESTRICT fr = co.f;
  for (size_t j = 0; j < V; j += N) {
    auto rj = hn::Load(d, v + j);
    if constexpr (kDelta) rj = hn::Mul(hn::Set(d, beta), hn::Sub(rj, hn::Load(d, pred + j)));
    hn::Store(rj, d, r + j);
    hn::Store(hn::Zero(d), d, o + j);
    if constexpr (kPredict) hn::Store(hn::Zero(d), d, pred + j);
  }
  // Updates row i and returns it.
  auto update = [&](size_t i, size_t j) HWY_ATTR {
    if (next != nullptr) __builtin_prefetch(next + i * ld + j, 0, 2);
    float* HWY_RESTRICT p = S + i * ld + j;
    auto s = hn::LoadU(d, p);
    if constexpr (kGated) s = hn::Mul(s, hn::Set(d, fr[i]));
    s = hn::MulAdd(hn::Set(d, ka[i]), hn::Load(d, r + j), s);
    hn::StoreU(s, d, p);
    return s;
  };
  size_t i = 0;
  for (; i + 2 <= K; i += 2) {
    const auto b0 = hn::Set(d, qb[i]), b1 = hn::Set(d, qb[i + 1]);
    for (size_t j = 0; j < V; j += N) {
      const auto s0 = update(i, j), s1 = update(i + 1, j);
      hn::Store(hn::MulAdd(b1, s1, hn::MulAdd(b0, s0, hn::Load(d, o + j))), d, o + j);
      if constexpr (kPredict) {
        const auto c0 = hn::Set(d, kc[i]), c1 = hn::Set(d, kc[i + 1]);
        hn::Store(hn::MulAdd(c1, s1, hn::MulAdd(c0, s0, hn::Load(d, pred + j))), d, pred + j);
      }
    }
  }
  if (i < K) {
    const auto b0 = hn::Set(d, qb[i]);
    for (size_t j = 0; j < V; j += N) {
      const auto s0 = update(i, j);
      hn::Store(hn::MulAdd(b0, s0, hn::Load(d, o + j)), d, o + j);
      if constexpr (kPredict)
        hn::Store(hn::MulAdd(hn::Set(d, kc[i]), s0, hn::Load(d, pred + j)), d, pred + j);
    }
  }
}

// Run-time flags to template arguments.
template <bool kDelta>
void StreamTokenPassFor(bool gated, bool predict, const PassCoefficients& co, size_t K, size_t V,
                        size_t ld, const float* v, float beta, float* pred, float* r, float* S,
                        float* o, const float* next) {
  if (gated) {
    if (predict)
      return StreamTokenPass<kDelta, true, kDelta>(co, K, V, ld, v, beta, pred, r, S, o, next);
    return StreamTokenPass<kDelta, true, false>(co, K, V, ld, v, beta, pred, r, S, o, next);
  }
  if (predict)
    return StreamTokenPass<kDelta, false, kDelta>(co, K, V, ld, v, beta, pred, r, S, o, next);
  return StreamTokenPass<kDelta, false, false>(co, K, V, ld, v, beta, pred, r, S, o, next);
}

}  // namespace flashdelta::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // FLASHDELTA_CPU_RECURRENT_STREAM_INL_H_
