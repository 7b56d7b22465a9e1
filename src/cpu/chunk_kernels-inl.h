// SIMD building blocks of the chunkwise CPU schedule, compiled once per Highway target
// (included from cpu/chunk.cpp through hwy/foreach_target.h): a base-2 exponential and the
// small matrix product every step of the chunk pipeline is made of.
//
// Per-target include guard (the Highway -inl.h convention).
#if defined(FLASHDELTA_CPU_CHUNK_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHDELTA_CPU_CHUNK_KERNELS_INL_H_
#undef FLASHDELTA_CPU_CHUNK_KERNELS_INL_H_
#else
#define FLASHDELTA_CPU_CHUNK_KERNELS_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::chunk::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register tiles of the matrix product: kTileRows x kTileVecs vectors of accumulators.
// AVX-512 has 32 vector registers (16 accumulators + 2 row loads + a broadcast); the
// other targets have 16.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
inline constexpr int kTileRows = 8;
#else
inline constexpr int kTileRows = 4;
#endif
inline constexpr int kTileVecs = 2;

// Taylor coefficients of 2^f = e^(f ln 2): c_i = ln2^i / i!.
template <int kDegree>
struct Exp2Series {
  double c[kDegree + 1] = {};
  constexpr Exp2Series() {
    c[0] = 1.0;
    for (int i = 1; i <= kDegree; ++i) c[i] = c[i - 1] * 0.693147180559945309417232121458 / i;
  }
};

// 2^x, accurate to about one unit in the last place of T, for x <= 127 (float) / 1023
// (double); below -127 / -1023 it returns 0 (the true value is below the smallest normal).
// x = n + f with n = round(x): 2^f from its Taylor series, 2^n through the exponent bits.
template <class D>
HWY_INLINE hn::Vec<D> Exp2(D d, hn::Vec<D> x) {
  using T = hn::TFromD<D>;
  constexpr bool kFloat = sizeof(T) == 4;
  constexpr int kBias = kFloat ? 127 : 1023;
  constexpr int kMantissaBits = kFloat ? 23 : 52;
  constexpr int kDegree = kFloat ? 7 : 12;  // next term < 2^-27 (float), 2^-52 (double)
  x = hn::Min(hn::Max(x, hn::Set(d, T(-kBias))), hn::Set(d, T(kBias)));
  const hn::Vec<D> n = hn::Round(x);
  const hn::Vec<D> f = hn::Sub(x, n);  // [-1/2, 1/2]
  constexpr Exp2Series<kDegree> kSeries;
  hn::Vec<D> poly = hn::Set(d, static_cast<T>(kSeries.c[kDegree]));
  for (int i = kDegree - 1; i >= 0; --i)
    poly = hn::MulAdd(poly, f, hn::Set(d, static_cast<T>(kSeries.c[i])));
  const hn::RebindToSigned<D> di;
  const auto biased = hn::Add(hn::ConvertTo(di, n), hn::Set(di, kBias));  // 0 gives +0.0
  return hn::Mul(poly, hn::BitCast(d, hn::ShiftLeft<kMantissaBits>(biased)));
}

// C = init +- A B for an M x N block, N a multiple of the vector length.
//   A(m, p) = a[m * a_row + p * a_col] (read one element at a time and broadcast)
//   B row p = b + p * ldb (read as vectors); C row m = c + m * ldc
//   init: null (zeros) or an M x N matrix (may be C itself), rows optionally scaled by
//   row_scale[m]. causal: A(m, p) = 0 for p > m, so a row tile stops at its last row.
// Every element is init followed by its P products in order of p, whatever the tiling,
// so results do not depend on which rows or columns are computed together.
template <class T>
struct Gemm {
  int64_t M = 0, N = 0, P = 0;
  bool causal = false;
  const T* a = nullptr;
  int64_t a_row = 0, a_col = 0;
  const T* b = nullptr;
  int64_t ldb = 0;
  T* c = nullptr;
  int64_t ldc = 0;
  const T* init = nullptr;
  int64_t ld_init = 0;
  const T* row_scale = nullptr;
};

template <int kRows, int kVecs, bool kSubtract, class D, class T = hn::TFromD<D>>
HWY_INLINE void GemmTile(D d, const Gemm<T>& g, int64_t m0, int64_t n0) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<D> acc[kRows][kVecs];
  HWY_UNROLL(16)
  for (int m = 0; m < kRows; ++m) {
    HWY_UNROLL(16)
    for (int v = 0; v < kVecs; ++v) {
      if (g.init == nullptr) {
        acc[m][v] = hn::Zero(d);
      } else {
        acc[m][v] = hn::Load(d, g.init + (m0 + m) * g.ld_init + n0 + v * lanes);
        if (g.row_scale) acc[m][v] = hn::Mul(acc[m][v], hn::Set(d, g.row_scale[m0 + m]));
      }
    }
  }
  const int64_t P = g.causal ? std::min<int64_t>(g.P, m0 + kRows) : g.P;
  const T* a = g.a + m0 * g.a_row;
  const T* b = g.b + n0;
  for (int64_t p = 0; p < P; ++p) {
    hn::Vec<D> bv[kVecs];
    HWY_UNROLL(16)
    for (int v = 0; v < kVecs; ++v) bv[v] = hn::Load(d, b + p * g.ldb + v * lanes);
    HWY_UNROLL(16)
    for (int m = 0; m < kRows; ++m) {
      const hn::Vec<D> am = hn::Set(d, a[m * g.a_row + p * g.a_col]);
      HWY_UNROLL(16)
      for (int v = 0; v < kVecs; ++v)
        acc[m][v] =
            kSubtract ? hn::NegMulAdd(am, bv[v], acc[m][v]) : hn::MulAdd(am, bv[v], acc[m][v]);
    }
  }
  HWY_UNROLL(16)
  for (int m = 0; m < kRows; ++m) {
    HWY_UNROLL(16)
    for (int v = 0; v < kVecs; ++v)
      hn::Store(acc[m][v], d, g.c + (m0 + m) * g.ldc + n0 + v * lanes);
  }
}

// Runs the product; M must be a multiple of kTileRows (all callers pass multiples of 16).
template <bool kSubtract, class T>
void RunGemm(const Gemm<T>& g) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t wide = kTileVecs * lanes;
  for (int64_t m0 = 0; m0 < g.M; m0 += kTileRows) {
    int64_t n0 = 0;
    for (; n0 + wide <= g.N; n0 += wide) GemmTile<kTileRows, kTileVecs, kSubtract>(d, g, m0, n0);
    for (; n0 < g.N; n0 += lanes) GemmTile<kTileRows, 1, kSubtract>(d, g, m0, n0);
  }
}

}  // namespace flashdelta::detail::chunk::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
