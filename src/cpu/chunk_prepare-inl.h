// Steps 1-3 of the chunkwise schedule for one chunk of one (sequence, value head): the
// cumulative gates, A_kk and A_qk, and T = (I + A_kk)^-1 (DESIGN.md section 3). Depends
// only on the chunk's inputs, so chunks can be prepared in parallel. Compiled once per
// Highway target (included from cpu/chunk.cpp).
//
// Numerics: Gamma is the cumulative decay in log2 from the chunk start (non-increasing,
// since gates are <= 0). Exponentials have exponents <= 0, except the factors of a vector
// gate's A around the middle of each row block, which stay within 2^+-kMaxFactorExponent;
// blocks whose gates decay faster than that fall back to exponents <= 0 and an exact
// pairwise diagonal block.
#if defined(FLASHDELTA_CPU_CHUNK_PREPARE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHDELTA_CPU_CHUNK_PREPARE_INL_H_
#undef FLASHDELTA_CPU_CHUNK_PREPARE_INL_H_
#else
#define FLASHDELTA_CPU_CHUNK_PREPARE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/chunk_kernels-inl.h"
#include "cpu/chunk_layout.h"
#include "cpu/chunk_rows.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::chunk::HWY_NAMESPACE {

inline constexpr double kLog2e = 1.442695040888963407359924681002;

// Work buffers of steps 1-3, reused chunk after chunk by one worker.
template <class T>
struct PrepareScratch {
  T* gamma;   // [C, Kp] (vector gate) or [C] (scalar gate): Gamma
  T* k_t;     // [Kp, C] k transposed: columns are tokens (vector gate: k 2^(G_b - Gamma))
  T* k_end;   // [C, Kp] k 2^(G_b - Gamma), G_b the Gamma at the end of the row's block
  T* kbar_t;  // [Kp, C] k_j 2^(r - Gamma_j) for the reference point r of one row block
  T* xq;      // [kBlock, Kp] scale q_i 2^(Gamma_i - r) of one row block
  T* xk;      // [kBlock, Kp] k_i 2^(Gamma_i - r)
  T* a_kk;    // [C, C] beta_i k_i . k_j 2^(Gamma_i - Gamma_j), j < i
  T* factor;  // [Kp]
  T* zeros;   // [Kp]

  static int64_t size(const Dims& d) {
    return 4 * round_up(d.C * d.Kp, kPad) + 2 * round_up(kBlock * d.Kp, kPad) +
           round_up(d.C * d.C, kPad) + 2 * round_up(d.Kp, kPad);
  }
  // base must hold size(d) zeros.
  static PrepareScratch carve(T* base, const Dims& d) {
    Carver<T> c(base);
    PrepareScratch s;
    s.gamma = c.take(d.C * d.Kp);
    s.k_t = c.take(d.C * d.Kp);
    s.k_end = c.take(d.C * d.Kp);
    s.kbar_t = c.take(d.C * d.Kp);
    s.xq = c.take(kBlock * d.Kp);
    s.xk = c.take(kBlock * d.Kp);
    s.a_kk = c.take(d.C * d.C);
    s.factor = c.take(d.Kp);
    s.zeros = c.take(d.Kp);
    return s;
  }
};

// The mechanism as template arguments (the only switch from run-time flags is in chunk.cpp).
template <GateKind kGate, bool kDelta>
struct Mech {
  static constexpr GateKind gate = kGate;
  static constexpr bool delta = kDelta;
};

template <class T, class M>
class ChunkPreparer {
 public:
  using D = hn::ScalableTag<T>;

  ChunkPreparer(double scale, const Dims& dims, const PrepareScratch<T>& s)
      : dm_(dims), s_(s), scale_(static_cast<T>(scale)) {}

  // Steps 1-3 of one chunk of len tokens into cd; rows holds them, followed by zero
  // tokens up to a multiple of kBlock.
  void run(const TokenRows<T>& rows, int64_t len, ChunkData<T>& cd) {
    cd.len = len;
    cd.rows = round_up(len, kBlock);
    in_ = rows;
    copy_values(cd);
    if constexpr (M::gate == GateKind::vector)
      prepare_vector_gate(cd);
    else
      prepare_scalar_gate(cd);
    if constexpr (M::delta) solve(cd);
  }

 private:
  int64_t lanes() const { return static_cast<int64_t>(hn::Lanes(d_)); }
  const T* q_row(int64_t t) const { return in_.q + t * dm_.Kp; }
  const T* k_row(int64_t t) const { return in_.k + t * dm_.Kp; }

  // u = beta v (delta) or v (linear).
  void copy_values(ChunkData<T>& cd) {
    const int64_t Vp = dm_.Vp, L = lanes();
    for (int64_t t = 0; t < cd.rows; ++t) {
      const T* v = in_.v + t * Vp;
      T* dst = cd.u + t * Vp;
      const auto beta = hn::Set(d_, M::delta ? in_.beta[t] : T(1));
      for (int64_t j = 0; j < Vp; j += L)
        hn::Store(hn::Mul(beta, hn::Load(d_, v + j)), d_, dst + j);
    }
  }

  // Token columns: dst[c][t] = src[t][c] for rows [t0, t1), the B operand of k_i . k_j.
  void transpose(const T* src, T* dst, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < dm_.Kp; ++c) dst[c * dm_.C + t] = src[t * dm_.Kp + c];
  }

  // out[i, j] = a_i . (token column j of kbar_t or k_t), for `rows` rows of a and j < cols.
  void gemm_rows(const T* a, int64_t rows, int64_t cols, T* out) const {
    Gemm<T> g;
    g.M = rows;
    g.N = cols;
    g.P = dm_.Kp;
    g.a = a;
    g.a_row = dm_.Kp;
    g.a_col = 1;
    g.b = M::gate == GateKind::vector ? s_.kbar_t : s_.k_t;
    g.ldb = dm_.C;
    g.c = out;
    g.ldc = dm_.C;
    RunGemm<false>(g);
  }

  // Vector gate. Row block I of A factorises around a reference point r:
  // q_i 2^(Gamma_i - r) . k_j 2^(r - Gamma_j). Normally r is Gamma after the middle token of
  // the block: for the blocks left of the diagonal r - Gamma_j <= 0, and on the diagonal
  // block every exponent is at most half the block's decay, within kMaxFactorExponent
  // unless the gates decay by more than ~120 bits over kBlock tokens (16 steps at the usual
  // lower bound of -5 nats make 115). Such a block takes r = Gamma before its first token,
  // so both exponents are <= 0 left of the diagonal, and its diagonal block is recomputed
  // with exact pairwise exponents.
  void prepare_vector_gate(ChunkData<T>& cd) {
    const int64_t Kp = dm_.Kp, C = dm_.C, rows = cd.rows, L = lanes();
    T* G = s_.gamma;
    const auto log2e = hn::Set(d_, static_cast<T>(kLog2e));
    const auto floor = hn::Set(d_, static_cast<T>(kMinGateLog2));
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t c = 0; c < Kp; c += L) {
        const auto prev = t ? hn::Load(d_, G + (t - 1) * Kp + c) : hn::Zero(d_);
        const auto step = hn::Mul(hn::Load(d_, in_.g + t * Kp + c), log2e);
        hn::Store(hn::Add(hn::IfThenElse(hn::Lt(step, floor), floor, step), prev), d_,
                  G + t * Kp + c);
      }
    const T* g_end = G + (rows - 1) * Kp;
    const auto scale = hn::Set(d_, scale_);
    for (int64_t c = 0; c < Kp; c += L)
      hn::Store(Exp2(d_, hn::Load(d_, g_end + c)), d_, cd.decay + c);
    for (int64_t t = 0; t < rows; ++t) {
      const auto beta = hn::Set(d_, in_.beta[t]);
      for (int64_t c = 0; c < Kp; c += L) {
        const auto g = hn::Load(d_, G + t * Kp + c);
        const auto e_in = Exp2(d_, g), e_out = Exp2(d_, hn::Sub(hn::Load(d_, g_end + c), g));
        const auto k = hn::Load(d_, k_row(t) + c);
        hn::Store(hn::Mul(hn::Mul(hn::Load(d_, q_row(t) + c), scale), e_in), d_, cd.q + t * Kp + c);
        hn::Store(hn::Mul(k, e_out), d_, cd.k + t * Kp + c);
        if constexpr (M::delta) hn::Store(hn::Mul(beta, hn::Mul(k, e_in)), d_, cd.w + t * Kp + c);
      }
    }
    // Token columns of k_j 2^(G_b - Gamma_j) <= 1, G_b the Gamma at the end of j's block
    // (for the last block, cd.k).
    for (int64_t j0 = 0; j0 < rows; j0 += kBlock) {
      const bool last = j0 + kBlock == rows;
      const T* g_b = G + (j0 + kBlock - 1) * Kp;
      for (int64_t j = j0; !last && j < j0 + kBlock; ++j)
        for (int64_t c = 0; c < Kp; c += L) {
          const auto e = Exp2(d_, hn::Sub(hn::Load(d_, g_b + c), hn::Load(d_, G + j * Kp + c)));
          hn::Store(hn::Mul(hn::Load(d_, k_row(j) + c), e), d_, s_.k_end + j * Kp + c);
        }
      transpose(last ? cd.k : s_.k_end, s_.k_t, j0, j0 + kBlock);
    }

    const auto limit = hn::Set(d_, static_cast<T>(kMaxFactorExponent));
    for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
      const T* r = G + (i0 + kBlock / 2 - 1) * Kp;
      const bool exact = largest_exponent(i0, r) > static_cast<T>(kMaxFactorExponent);
      if (exact) r = i0 ? G + (i0 - 1) * Kp : s_.zeros;
      for (int64_t i = i0; i < i0 + kBlock; ++i)
        for (int64_t c = 0; c < Kp; c += L) {
          const auto x = hn::Sub(hn::Load(d_, G + i * Kp + c), hn::Load(d_, r + c));
          const auto e = Exp2(d_, x);
          hn::Store(hn::Mul(hn::Mul(hn::Load(d_, q_row(i) + c), scale), e), d_,
                    s_.xq + (i - i0) * Kp + c);
          if constexpr (M::delta)
            hn::Store(hn::Mul(hn::Load(d_, k_row(i) + c), e), d_, s_.xk + (i - i0) * Kp + c);
        }
      // kbar = k 2^(r - Gamma) = (k 2^(G_b - Gamma)) 2^(r - G_b) per column block: the
      // factor is <= 1 left of the diagonal and at most 2^kMaxFactorExponent on it (clamped
      // when exact, whose diagonal block is replaced).
      for (int64_t j0 = 0; j0 <= i0; j0 += kBlock) {
        const T* g_b = G + (j0 + kBlock - 1) * Kp;
        for (int64_t c = 0; c < Kp; c += L) {
          const auto x = hn::Sub(hn::Load(d_, r + c), hn::Load(d_, g_b + c));
          hn::Store(Exp2(d_, hn::Min(x, limit)), d_, s_.factor + c);
        }
        for (int64_t c = 0; c < Kp; ++c) {
          const auto f = hn::Set(d_, s_.factor[c]);
          for (int64_t j = j0; j < j0 + kBlock; j += L)
            hn::Store(hn::Mul(hn::Load(d_, s_.k_t + c * C + j), f), d_, s_.kbar_t + c * C + j);
        }
      }
      const int64_t cols = i0 + kBlock;
      if constexpr (M::delta) gemm_rows(s_.xk, kBlock, cols, s_.a_kk + i0 * C);
      gemm_rows(s_.xq, kBlock, cols, cd.a_qk + i0 * C);
      if (exact) exact_diagonal_block(i0, cd);
    }
    mask(cd, nullptr);
  }

  // Largest exponent of the diagonal block's factors around r, on either side.
  T largest_exponent(int64_t i0, const T* r) const {
    const int64_t Kp = dm_.Kp, L = lanes();
    auto m = hn::Zero(d_);
    for (int64_t i = i0; i < i0 + kBlock; ++i)
      for (int64_t c = 0; c < Kp; c += L)
        m = hn::Max(m, hn::Abs(hn::Sub(hn::Load(d_, s_.gamma + i * Kp + c), hn::Load(d_, r + c))));
    return hn::GetLane(hn::MaxOfLanes(d_, m));
  }

  // A on the diagonal block rows [i0, i0 + kBlock) with one exponential per pair and key.
  void exact_diagonal_block(int64_t i0, ChunkData<T>& cd) {
    const int64_t Kp = dm_.Kp, C = dm_.C, L = lanes();
    const T* G = s_.gamma;
    for (int64_t i = i0; i < i0 + kBlock; ++i)
      for (int64_t j = i0; j <= i; ++j) {
        auto acc_q = hn::Zero(d_), acc_k = hn::Zero(d_);
        for (int64_t c = 0; c < Kp; c += L) {
          const auto e =
              Exp2(d_, hn::Sub(hn::Load(d_, G + i * Kp + c), hn::Load(d_, G + j * Kp + c)));
          const auto kj = hn::Mul(hn::Load(d_, k_row(j) + c), e);
          acc_q = hn::MulAdd(hn::Load(d_, q_row(i) + c), kj, acc_q);
          acc_k = hn::MulAdd(hn::Load(d_, k_row(i) + c), kj, acc_k);
        }
        cd.a_qk[i * C + j] = scale_ * hn::GetLane(hn::SumOfLanes(d_, acc_q));
        if (j < i) s_.a_kk[i * C + j] = hn::GetLane(hn::SumOfLanes(d_, acc_k));
      }
  }

  // Scalar gate (or none): plain dot products, then the exact decay 2^(Gamma_i - Gamma_j)
  // per entry; q, k and the state decay scale by one exponential per row.
  void prepare_scalar_gate(ChunkData<T>& cd) {
    const int64_t Kp = dm_.Kp, rows = cd.rows, L = lanes();
    constexpr bool kGated = M::gate == GateKind::scalar;
    T* G = s_.gamma;
    if constexpr (kGated) {
      for (int64_t t = 0; t < rows; ++t) {
        const T step = in_.g[t] * static_cast<T>(kLog2e);
        G[t] = (t ? G[t - 1] : T(0)) + (step < T(kMinGateLog2) ? T(kMinGateLog2) : step);
      }
      const T g_end = G[rows - 1];
      const auto decay = hn::Set(d_, static_cast<T>(std::exp2(g_end)));
      for (int64_t c = 0; c < Kp; c += L) hn::Store(decay, d_, cd.decay + c);
    }
    for (int64_t t = 0; t < rows; ++t) {
      const T e_in = kGated ? static_cast<T>(std::exp2(G[t])) : T(1);
      const T e_out = kGated ? static_cast<T>(std::exp2(G[rows - 1] - G[t])) : T(1);
      const auto q_factor = hn::Set(d_, scale_ * e_in), k_factor = hn::Set(d_, e_in);
      const auto out_factor = hn::Set(d_, e_out), beta = hn::Set(d_, in_.beta[t]);
      for (int64_t c = 0; c < Kp; c += L) {
        const auto k = hn::Load(d_, k_row(t) + c);
        hn::Store(hn::Mul(hn::Load(d_, q_row(t) + c), q_factor), d_, cd.q + t * Kp + c);
        hn::Store(hn::Mul(k, out_factor), d_, cd.k + t * Kp + c);
        if constexpr (M::delta)
          hn::Store(hn::Mul(beta, hn::Mul(k, k_factor)), d_, cd.w + t * Kp + c);
      }
    }
    transpose(in_.k, s_.k_t, 0, rows);
    if constexpr (M::delta) gemm_rows(in_.k, rows, rows, s_.a_kk);
    gemm_rows(in_.q, rows, rows, cd.a_qk);
    mask(cd, kGated ? G : nullptr);
  }

  // Keeps the causal part of A_qk (j <= i) and A_kk (j < i), applies beta_i to A_kk and,
  // for a scalar gate (gamma non-null), the decay 2^(Gamma_i - Gamma_j) and the scale.
  void mask(ChunkData<T>& cd, const T* gamma) {
    const int64_t C = dm_.C, rows = cd.rows, L = lanes();
    // The vector-gate path put the scale into q already.
    const T qk_scale = M::gate == GateKind::vector ? T(1) : scale_;
    for (int64_t i = 0; i < rows; ++i) {
      T* aq = cd.a_qk + i * C;
      T* ak = s_.a_kk + i * C;
      const auto gi = gamma ? hn::Set(d_, gamma[i]) : hn::Zero(d_);
      const auto iota = hn::Iota(d_, 0);
      for (int64_t j = 0; j < rows; j += L) {
        const auto jv = hn::Add(iota, hn::Set(d_, static_cast<T>(j)));
        const auto ii = hn::Set(d_, static_cast<T>(i));
        auto f = hn::Set(d_, T(1));
        if (gamma) f = Exp2(d_, hn::Sub(gi, hn::Load(d_, gamma + j)));  // j > i: masked below
        const auto q_keep = hn::Le(jv, ii), k_keep = hn::Lt(jv, ii);
        const auto q_val = hn::Mul(hn::Load(d_, aq + j), hn::Mul(f, hn::Set(d_, qk_scale)));
        hn::Store(hn::IfThenElseZero(q_keep, q_val), d_, aq + j);
        if constexpr (M::delta) {
          const auto k_val = hn::Mul(hn::Load(d_, ak + j), hn::Mul(f, hn::Set(d_, in_.beta[i])));
          hn::Store(hn::IfThenElseZero(k_keep, k_val), d_, ak + j);
        }
      }
    }
  }

  // Step 3: T = (I + A_kk)^-1 by forward substitution on its rows (unit lower triangular;
  // entries right of the diagonal block of a row are zero).
  void solve(ChunkData<T>& cd) {
    const int64_t C = dm_.C, rows = cd.rows, L = lanes();
    for (int64_t i = 0; i < rows; ++i) {
      T* ti = cd.t_inv + i * C;
      const int64_t cols = round_up(i + 1, kBlock);
      for (int64_t j = 0; j < cols; j += L) {
        auto acc = hn::IfThenElseZero(
            hn::Eq(hn::Iota(d_, static_cast<T>(j)), hn::Set(d_, static_cast<T>(i))),
            hn::Set(d_, T(1)));
        for (int64_t l = 0; l < i; ++l)
          acc = hn::NegMulAdd(hn::Set(d_, s_.a_kk[i * C + l]), hn::Load(d_, cd.t_inv + l * C + j),
                              acc);
        hn::Store(acc, d_, ti + j);
      }
      std::fill(ti + cols, ti + rows, T(0));
    }
  }

  const Dims& dm_;
  PrepareScratch<T> s_;
  const T scale_;
  TokenRows<T> in_;
  D d_;
};

}  // namespace flashdelta::detail::chunk::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
