// Sizes and buffers of the chunkwise CPU schedule (cpu/chunk.cpp). Every matrix row is
// padded with zeros to a multiple of kPad elements, so the SIMD kernels run whole vectors on
// every target (up to 16 floats, AVX-512) and never need a tail; zero keys, values and gates
// in the padding leave the recurrence unchanged.
#pragma once

#include <cstdint>

#include "core/problem.h"

namespace flashdelta::detail::chunk {

// Row padding in elements: one 64-byte cache line of float.
inline constexpr int64_t kPad = 16;
// Sub-chunk size: A_kk and A_qk are built in kBlock x kBlock blocks (each off-diagonal
// block with its own decay reference point), and the last chunk of a sequence is padded
// with zero tokens to a multiple of kBlock rows.
inline constexpr int64_t kBlock = 16;
// Columns of the state processed together in steps 4-5: K x kStripCols of the state stays
// in L1 while it is read by W S and q S and rewritten by the update.
inline constexpr int64_t kStripCols = 32;
// Largest exponent (log2) of the factors q 2^(Gamma - r), k 2^(r - Gamma) on the diagonal
// blocks of a vector gate (cpu/chunk_prepare-inl.h): far from float overflow, products that
// underflow are below 2^-60 of the block's largest terms, and k 2^(G_b - Gamma) over a
// block stays above 2^-120, a normal float. Blocks whose gates decay more than about twice
// this over kBlock tokens run the exact pairwise form instead.
inline constexpr int kMaxFactorExponent = 60;
// Floor of a per-step gate in log2: a decay of 2^-64 is 0 to float beside the rest of any
// sum, and the floor keeps Gamma finite for gates of -inf (a hard reset), whose differences
// would otherwise be inf - inf. NaN gates stay NaN.
inline constexpr double kMinGateLog2 = -64;

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Dims {
  int64_t K = 0, V = 0;    // head sizes
  int64_t Kp = 0, Vp = 0;  // padded to kPad
  int64_t C = 0;           // chunk size (multiple of kBlock)

  explicit Dims(const Problem& p)
      : K(p.K), V(p.V), Kp(round_up(p.K, kPad)), Vp(round_up(p.V, kPad)), C(p.options.chunk_size) {}
  int64_t state_size() const { return Kp * Vp; }
};

// Carves aligned sub-buffers (multiples of kPad elements) out of one allocation.
template <class T>
class Carver {
 public:
  explicit Carver(T* base) : next_(base) {}
  T* take(int64_t n) {
    T* p = next_;
    next_ += round_up(n, kPad);
    return p;
  }

 private:
  T* next_;
};

// What steps 1-3 produce for one chunk and steps 4-5 consume (DESIGN.md section 3), with
// Gamma the cumulative log2 decay from the chunk start and G_end its value after the chunk.
// The delta rule keeps T = (I + A_kk)^-1 rather than W = T (beta k 2^Gamma) and
// U = T (beta v): v_new = T (beta v - (beta k 2^Gamma) S) costs C^2 V / 2 per chunk in
// step 4 instead of C^2 (K + V) / 2 in step 3.
template <class T>
struct ChunkData {
  int64_t len = 0;     // tokens in the chunk
  int64_t rows = 0;    // len rounded up to kBlock; rows past len are zero tokens
  T* q = nullptr;      // [C, Kp] scale * q * 2^Gamma: reads the chunk-start state
  T* k = nullptr;      // [C, Kp] k * 2^(G_end - Gamma): writes into the chunk-end state
  T* w = nullptr;      // [C, Kp] beta k 2^Gamma (delta)
  T* u = nullptr;      // [C, Vp] beta v (delta) or v (linear, where v_new = v)
  T* t_inv = nullptr;  // [C, C] (I + A_kk)^-1, A_kk[i, j] = beta_i k_i . k_j 2^(Gamma_i - Gamma_j)
  T* a_qk = nullptr;   // [C, C] scale * q_i . k_j 2^(Gamma_i - Gamma_j), j <= i
  T* decay = nullptr;  // [Kp] 2^G_end per key (gated mechanisms)

  static int64_t size(const Dims& d) {
    return 3 * round_up(d.C * d.Kp, kPad) + round_up(d.C * d.Vp, kPad) +
           2 * round_up(d.C * d.C, kPad) + round_up(d.Kp, kPad);
  }
  static ChunkData carve(Carver<T>& c, const Dims& d) {
    ChunkData cd;
    cd.q = c.take(d.C * d.Kp);
    cd.k = c.take(d.C * d.Kp);
    cd.w = c.take(d.C * d.Kp);
    cd.u = c.take(d.C * d.Vp);
    cd.t_inv = c.take(d.C * d.C);
    cd.a_qk = c.take(d.C * d.C);
    cd.decay = c.take(d.Kp);
    return cd;
  }
};

}  // namespace flashdelta::detail::chunk
