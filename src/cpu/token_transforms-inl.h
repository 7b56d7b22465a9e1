// The per-channel fused transforms of core/token_inputs.h (q/k L2 norm, gate activation)
// over whole vectors, for the CPU schedules: a scalar expf and log1p per key channel and
// token cost KDA more than its recurrence. Same formulas as ScalarTransforms; only the
// rounding differs (Highway's Exp and Log1p are within 1 and 2 ulp, sums run by lane).
//
// Rows must hold whole vectors (the schedules pad them); lanes past n are written zero.
//
// Per-target code (Highway): included once per target from cpu/recurrent.cpp and
// cpu/chunk.cpp.
#if defined(FLASHDELTA_CPU_TOKEN_TRANSFORMS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHDELTA_CPU_TOKEN_TRANSFORMS_INL_H_
#undef FLASHDELTA_CPU_TOKEN_TRANSFORMS_INL_H_
#else
#define FLASHDELTA_CPU_TOKEN_TRANSFORMS_INL_H_
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/token_inputs.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

struct VectorTransforms {
  template <class T>
  static void l2_normalize(T* HWY_RESTRICT x, int64_t n) {
    const hn::ScalableTag<T> d;
    const size_t N = hn::Lanes(d), size = static_cast<size_t>(n);
    auto sum = hn::Zero(d);
    for (size_t i = 0; i < size; i += N) {
      const auto v = Row(d, x, i, size);
      sum = hn::MulAdd(v, v, sum);
    }
    const T s = hn::GetLane(hn::SumOfLanes(d, sum));
    const auto inv = hn::Set(d, T(1) / std::sqrt(s + T(kL2NormEps)));
    for (size_t i = 0; i < size; i += N) hn::Store(hn::Mul(Row(d, x, i, size), inv), d, x + i);
  }

  // gate_activation for channels [0, n).
  template <class T>
  static void activate_gate(const Options& o, const GateParams<T>& gp, T* HWY_RESTRICT g,
                            int64_t n) {
    const hn::ScalableTag<T> d;
    const size_t N = hn::Lanes(d), size = static_cast<size_t>(n);
    const auto a = hn::Set(d, gp.a);
    const auto bound = hn::Set(d, static_cast<T>(o.lower_bound.value_or(0)));
    for (size_t i = 0; i < size; i += N) {
      auto x = hn::Add(hn::Load(d, g + i), hn::LoadU(d, gp.bias + i));
      hn::Vec<decltype(d)> y;
      if (o.lower_bound) {
        if (gp.has_a) x = hn::Mul(a, x);
        y = hn::Mul(bound, Sigmoid(d, x));
      } else {
        y = hn::Neg(hn::Mul(a, Softplus(d, x)));
      }
      // Exp maps NaN to 0: keep a NaN input visible, as the scalar form does.
      y = hn::IfThenElse(hn::IsNaN(x), x, y);
      if (i + N > size) y = hn::IfThenElseZero(hn::FirstN(d, size - i), y);
      hn::Store(y, d, g + i);
    }
  }

 private:
  // Vector i of a row, lanes past n zero.
  template <class D, class T>
  static HWY_INLINE hn::Vec<D> Row(D d, const T* x, size_t i, size_t n) {
    const auto v = hn::Load(d, x + i);
    return i + hn::Lanes(d) > n ? hn::IfThenElseZero(hn::FirstN(d, n - i), v) : v;
  }

  // Both from e = exp(-|x|) in (0, 1]: no overflow for any x.
  template <class D, class V>
  static HWY_INLINE V Sigmoid(D d, V x) {
    const auto one = hn::Set(d, hn::TFromD<D>(1));
    const auto e = hn::Exp(d, hn::Neg(hn::Abs(x)));
    const auto positive = hn::Div(one, hn::Add(one, e));  // x >= 0
    return hn::IfThenElse(hn::Ge(x, hn::Zero(d)), positive, hn::Mul(e, positive));
  }
  template <class D, class V>
  static HWY_INLINE V Softplus(D d, V x) {
    const auto e = hn::Exp(d, hn::Neg(hn::Abs(x)));
    return hn::Add(hn::Max(x, hn::Zero(d)), hn::Log1p(d, e));
  }
};

}  // namespace flashdelta::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // FLASHDELTA_CPU_TOKEN_TRANSFORMS_INL_H_
