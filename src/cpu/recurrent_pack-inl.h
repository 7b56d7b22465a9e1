// Token packing of the recurrent schedule: turns one token's inputs (after the fused
// transforms of load_token, vectorised) into the contiguous per-token coefficients the pass
// reads.
//
// The state is carried as S = Diag(G) S_hat, G the cumulative decay since the last rebase
// token. The forget step then costs nothing: with d = exp(g_t) and G' = G * d,
//   predict  S'^T k = S_hat^T (G' k)           -> c of the previous token's pass
//   write    S_hat += (k / G') r^T             -> a
//   read     S^T (scale q) = S_hat^T (scale G' q)  -> b
// A token rebases (folds G' into S_hat and restarts G at 1) when G' would leave the
// safe range, and whenever its state must be materialised (the last token of a forward,
// a decode token whose state is written to a slot). The rounding of S_hat scales with
// 1 / G exactly as the terms it holds, so this is as accurate as decaying S every token.
//
// Per-target code (Highway): included once per target from recurrent.cpp.
#if defined(FLASHDELTA_CPU_RECURRENT_PACK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHDELTA_CPU_RECURRENT_PACK_INL_H_
#undef FLASHDELTA_CPU_RECURRENT_PACK_INL_H_
#else
#define FLASHDELTA_CPU_RECURRENT_PACK_INL_H_
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/token_inputs.h"
#include "cpu/token_transforms-inl.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rebase when the cumulative decay of any key channel leaves [2^-40, 2^40]: S_hat then
// differs from the state it represents by at most 2^40, far from float overflow. (Gates are
// log decays <= 0 in every model; positive ones are handled, not assumed away.)
inline constexpr float kRebaseBelow = 0x1p-40f;
inline constexpr float kRebaseAbove = 0x1p40f;

// One token's packed coefficients (arrays of kp floats, v of the item's padded width).
struct PackedToken {
  float* a;  // k / G                        (update)
  float* b;  // scale G q                    (read)
  float* c;  // G' k' of the next token      (predict; written when the next token is packed)
  float* f;  // G' folded into S_hat         (rebase tokens only)
  float* v;  // the item's value columns, zero-padded
  float beta = 0;
  bool rebase = false;
};

// A block of packed tokens: slot j = token t0 + j; one extra slot holds the look-ahead token
// whose predict coefficients complete the block's last pass.
class TokenBlock {
 public:
  static constexpr size_t kMaxSlots = 64;
  static size_t floats(size_t slots, size_t kp, size_t vpad) { return slots * (4 * kp + vpad); }

  TokenBlock(float* memory, size_t slots, size_t kp, size_t vpad) : kp_(kp), vpad_(vpad) {
    for (size_t j = 0; j < slots; ++j) {
      float* base = memory + j * (4 * kp + vpad);
      slots_[j] = {base, base + kp, base + 2 * kp, base + 3 * kp, base + 4 * kp};
    }
  }
  PackedToken& slot(size_t j) { return slots_[j]; }

  // Moves the token of slot `from` to slot 0 (all but c, which its successor fills).
  void move_to_front(size_t from) {
    const PackedToken& src = slots_[from];
    PackedToken& dst = slots_[0];
    std::memcpy(dst.a, src.a, 2 * kp_ * sizeof(float));        // a, b
    std::memcpy(dst.f, src.f, (kp_ + vpad_) * sizeof(float));  // f, v
    dst.beta = src.beta;
    dst.rebase = src.rebase;
  }

 private:
  size_t kp_, vpad_;
  PackedToken slots_[kMaxSlots];
};

// Packs the tokens of one (sequence, value head) in order, carrying G between tokens.
class TokenPacker {
 public:
  // Scratch: scratch_floats(kp, V) floats, vector-aligned. Values [col0, col0 + cols) of v
  // go to the packed tokens, zero-padded to vpad.
  static size_t scratch_floats(size_t kp, int64_t V) { return 4 * kp + static_cast<size_t>(V); }

  TokenPacker(const Problem& p, int64_t hv, const Sequence& seq, int64_t col0, int64_t cols,
              int64_t vpad, size_t kp, float* scratch)
      : p_(p),
        hv_(hv),
        seq_(seq),
        col0_(col0),
        cols_(cols),
        vpad_(vpad),
        kp_(kp),
        gp_(load_gate_params<float>(p, hv)),
        scale_(static_cast<float>(p.scale)),
        gamma_(scratch),
        q_(scratch + kp),
        k_(scratch + 2 * kp),
        g_(scratch + 3 * kp),
        v_(scratch + 4 * kp) {
    // Padding lanes beyond K stay finite (g = 0, k = q = 0) and are never read by a pass.
    std::memset(scratch, 0, 4 * kp * sizeof(float));
    for (size_t i = 0; i < kp; ++i) gamma_[i] = 1.0f;
  }

  // Packs token t of the sequence into `out`, and its predict coefficients into c_prev
  // (the previous token's c, or the first token's prologue buffer).
  void pack(int64_t t, bool materialize, PackedToken& out, float* HWY_RESTRICT c_prev) {
    if (t + kPrefetchTokens < seq_.len) prefetch(t + kPrefetchTokens);
    // v goes straight into the packed token when the item covers all of V.
    const bool whole_v = col0_ == 0 && cols_ == p_.V;
    float beta = 0;
    load_token<float, VectorTransforms>(p_, gp_, seq_.batch, seq_.t0 + t, hv_, q_, k_,
                                        whole_v ? out.v : v_, g_, &beta);
    out.beta = beta;
    if (!whole_v) std::memcpy(out.v, v_ + col0_, static_cast<size_t>(cols_) * sizeof(float));
    std::memset(out.v + cols_, 0, static_cast<size_t>(vpad_ - cols_) * sizeof(float));
    switch (p_.gate) {
      case GateKind::vector:
        return pack_vector_gate(materialize, out, c_prev);
      case GateKind::scalar:
        return pack_scalar_gate(materialize, out, c_prev);
      case GateKind::none:
        return pack_no_gate(out, c_prev);
    }
  }

 private:
  using D = hn::ScalableTag<float>;

  // Token rows of one head lie H (or HV) rows apart, in different pages for big heads, so
  // the hardware prefetchers do not follow them: pack() fetches the rows a few tokens ahead.
  // Forced inline: GCC classifies a function that only prefetches as pure and deletes calls.
  static constexpr int64_t kPrefetchTokens = 8;

  HWY_INLINE void prefetch(int64_t t) const {
    const TokenViews& in = p_.in;
    const int64_t b = seq_.batch, h = p_.key_head(hv_), tt = seq_.t0 + t;
    prefetch_row(in.q, offset_of(in.q, b, tt, h, 0), p_.K, in.q.stride[3]);
    prefetch_row(in.k, offset_of(in.k, b, tt, h, 0), p_.K, in.k.stride[3]);
    prefetch_row(in.v, offset_of(in.v, b, tt, hv_, 0), p_.V, in.v.stride[3]);
    if (p_.gate == GateKind::vector)
      prefetch_row(in.g, offset_of(in.g, b, tt, hv_, 0), p_.K, in.g.stride[3]);
  }

  static HWY_INLINE void prefetch_row(const TensorView& t, int64_t offset, int64_t n,
                                      int64_t step) {
    const char* first = element_address(t, offset);
    const int64_t bytes = ((n - 1) * step + 1) * dtype_size(t.dtype);
    if (step < 0 || bytes > 4096) return;  // only dense-ish rows are worth it
    for (int64_t b = 0; b < bytes; b += 64) hwy::Prefetch(first + b);
  }

  // Whether G may stay unfolded (false for NaN too).
  static bool in_range(float lowest, float highest) {
    return lowest >= kRebaseBelow && highest <= kRebaseAbove;
  }

  void pack_vector_gate(bool materialize, PackedToken& out, float* HWY_RESTRICT c_prev) {
    const D d;
    const size_t N = hn::Lanes(d);
    const size_t K = static_cast<size_t>(p_.K);
    auto lowest = hn::Set(d, 1.0f), highest = lowest;
    for (size_t i = 0; i < kp_; i += N) {
      const auto decayed = hn::Mul(hn::Load(d, gamma_ + i), hn::Exp(d, hn::Load(d, g_ + i)));
      hn::Store(decayed, d, gamma_ + i);
      if (p_.delta) hn::Store(hn::Mul(decayed, hn::Load(d, k_ + i)), d, c_prev + i);
      const auto vote = hn::IfThenElse(hn::FirstN(d, K - i), decayed, hn::Set(d, 1.0f));
      lowest = hn::Min(lowest, vote);  // padding lanes do not vote
      highest = hn::Max(highest, vote);
    }
    out.rebase = materialize || !in_range(hn::GetLane(hn::MinOfLanes(d, lowest)),
                                          hn::GetLane(hn::MaxOfLanes(d, highest)));
    const auto scale = hn::Set(d, scale_);
    for (size_t i = 0; i < kp_; i += N) {
      auto gamma = hn::Load(d, gamma_ + i);
      if (out.rebase) {
        hn::Store(gamma, d, out.f + i);
        gamma = hn::Set(d, 1.0f);
        hn::Store(gamma, d, gamma_ + i);
      }
      hn::Store(hn::Div(hn::Load(d, k_ + i), gamma), d, out.a + i);
      hn::Store(hn::Mul(hn::Mul(scale, gamma), hn::Load(d, q_ + i)), d, out.b + i);
    }
  }

  void pack_scalar_gate(bool materialize, PackedToken& out, float* HWY_RESTRICT c_prev) {
    const float decayed = scalar_gamma_ * std::exp(g_[0]);
    out.rebase = materialize || !in_range(decayed, decayed);
    const float gamma = out.rebase ? 1.0f : decayed;
    scalar_gamma_ = gamma;
    const D d;
    const size_t N = hn::Lanes(d);
    const auto vd = hn::Set(d, decayed), inv = hn::Set(d, 1.0f / gamma);
    const auto read_scale = hn::Set(d, scale_ * gamma);
    for (size_t i = 0; i < kp_; i += N) {
      const auto k = hn::Load(d, k_ + i);
      if (p_.delta) hn::Store(hn::Mul(vd, k), d, c_prev + i);
      if (out.rebase) hn::Store(vd, d, out.f + i);
      hn::Store(hn::Mul(k, inv), d, out.a + i);
      hn::Store(hn::Mul(read_scale, hn::Load(d, q_ + i)), d, out.b + i);
    }
  }

  void pack_no_gate(PackedToken& out, float* HWY_RESTRICT c_prev) {
    out.rebase = false;
    const size_t bytes = kp_ * sizeof(float);
    if (p_.delta) std::memcpy(c_prev, k_, bytes);
    std::memcpy(out.a, k_, bytes);
    const D d;
    const size_t N = hn::Lanes(d);
    const auto scale = hn::Set(d, scale_);
    for (size_t i = 0; i < kp_; i += N)
      hn::Store(hn::Mul(scale, hn::Load(d, q_ + i)), d, out.b + i);
  }

  const Problem& p_;
  int64_t hv_;
  Sequence seq_;
  int64_t col0_, cols_, vpad_;
  size_t kp_;
  GateParams<float> gp_;
  float scale_;
  float scalar_gamma_ = 1.0f;
  float *gamma_, *q_, *k_, *g_, *v_;
};

}  // namespace flashdelta::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // FLASHDELTA_CPU_RECURRENT_PACK_INL_H_
