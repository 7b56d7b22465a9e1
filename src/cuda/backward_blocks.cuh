// The pairwise decay terms of a chunk, sum over channels c of x_i[c] y_j[c] e^(G_i[c] - G_j[c])
// for j <= i (A_qk, A_kk and their gradients' A side), split by 16-row blocks and taken on the
// tensor cores as products of per-slice tables. Gamma falls along the chunk (gates <= 0), so
// with block I's reference point rho = Gamma[16 I] (its largest Gamma) every pair
//     e^(Gamma_i - Gamma_j) = e^(Gamma_i - rho) e^(rho - Gamma_j)
// with j < 16 I <= i factors into two numbers no larger than 1: nothing overflows, and a
// factor that underflows belongs to a term that does too. Inside block I (j >= 16 I) the
// column factor is >= 1 and stays finite while Gamma stays near rho over the block
// (kDiagonalNats); a channel that leaves that range fails the block, and its pairs inside
// the block are summed one by one, exactly, by the caller instead.
#pragma once

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kBlock = 16;
constexpr int kBlocks = kC / kBlock;
constexpr int kBlockPairs = kBlock * (kBlock + 1) / 2;  // j <= i inside one block
constexpr int kDiagonalPairs = kBlocks * kBlockPairs;

// Rows (i, j) of diagonal pair p: j <= i inside block p / kBlockPairs.
__device__ __forceinline__ void diagonal_pair(int p, int& i, int& j) {
  const int blk = p / kBlockPairs, q = p % kBlockPairs;
  int a = static_cast<int>((sqrtf(8.f * static_cast<float>(q) + 1.f) - 1.f) * 0.5f);
  if ((a + 1) * (a + 2) / 2 <= q) ++a;
  if (a * (a + 1) / 2 > q) --a;
  i = blk * kBlock + a;
  j = blk * kBlock + q - a * (a + 1) / 2;
}

// A channel fails block I when its Gamma leaves [rho_I - kDiagonalNats, rho_I + kDiagonalNats]
// at some row of the block (or is NaN); its diagonal column entries are then 0 (bit cc of
// fails[I]). kDiagonalNats bounds every factor by e^40 (about 2^58): a sum of 16 products of
// such a column with dA overflows only for |dA k| beyond 1e21.
constexpr float kDiagonalNats = 40.f;
constexpr int kDiagonalColumnRows = kBlock * kBlocks * (kBlocks + 1) / 2;  // j < 16 (I + 1)

// Whether Gamma at a row of block I keeps both of its factors within e^kDiagonalNats.
__device__ __forceinline__ bool diagonal_factor_ok(float gamma, float rho) {
  return fabsf(gamma - rho) <= kDiagonalNats;  // false for NaN
}

// First row of block I's column table: rows j < 16 (I + 1) for I = 0 .. 3, one after another.
__device__ __forceinline__ int diagonal_column_base(int I) { return kBlock * I * (I + 1) / 2; }

// Per key slice of kW channels (q, k, Gamma staged [row][channel], zeros at rows >= len):
//   rows[x][r][cc] = x[r][cc] e^(Gamma[r][cc] - rho_I)     x = q, k; r in block I
//   cols[diagonal_column_base(I) + j][cc] = k[j][cc] e^(rho_I - Gamma[j][cc])   j < 16 (I + 1)
// zero at rows >= len and (cols, j in block I) for channels that fail block I; entries of
// blocks past len are not read. kLd: row length (bank pattern of the user).
template <int kW, int kLd>
struct DiagonalTables {
  static_assert(kW <= 32, "a block's failing channels are the bits of one word");
  float rows[2][kC][kLd];
  float cols[kDiagonalColumnRows][kLd];
  // steps[I][cc] = e^(rho_I - rho_(I-1)) <= 1 for the blocks I >= 2 that start before len
  // (0 past it; steps[0] and steps[1] are not used): a column entry of block I >= J + 2 (J the
  // row's block) is block I - 1's times this, one multiplication instead of an exponential
  // (block_step).
  float steps[kBlocks][kW];
};

// The step of channel cc into block I >= 2 of the staged Gamma (DiagonalTables::steps).
template <class Slice>
__device__ __forceinline__ float block_step(const Slice& s, int len, int I, int cc) {
  return kBlock * I < len ? __expf(s.g[kBlock * I][cc] - s.g[kBlock * (I - 1)][cc]) : 0.f;
}

// fails[I] |= bit cc for every block and channel of the slice that fails (rows < len); fails
// must be zero before (and a barrier passed after). Also the tables' steps.
template <int kW, int kLd, class Slice>
__device__ void mark_failing_blocks(const Slice& s, int len, unsigned (&fails)[kBlocks],
                                    DiagonalTables<kW, kLd>& t) {
  for (int idx = threadIdx.x; idx < kBlocks * kW; idx += blockDim.x) {
    const int I = idx / kW, cc = idx % kW, r0 = kBlock * I, end = min(r0 + kBlock, len);
    bool ok = true;
    for (int r = r0; r < end; ++r) ok &= diagonal_factor_ok(s.g[r][cc], s.g[r0][cc]);
    // The step before the atomic (reads before stores: cuda/device_io.cuh).
    if (I > 1) t.steps[I][cc] = block_step(s, len, I, cc);
    if (!ok) atomicOr(&fails[I], 1u << cc);
  }
}

// Fills the tables; fails and steps must be written (and a barrier passed) before. One (row
// r, channel) per thread writes all of the row's entries: its row-table pair and its column
// entries in block r / 16 (the diagonal one) and every later block, with q, k and Gamma read
// once. The later blocks' entries are one exponential for the next block and then its
// product with the steps: each step is at most 1, so an entry that underflows to 0 belongs to
// a term that does too (a few float32 roundings more, far below tf32's).
template <int kW, int kLd, class Slice>
__device__ void fill_diagonal_tables(const Slice& s, int len, const unsigned (&fails)[kBlocks],
                                     DiagonalTables<kW, kLd>& t) {
  // A pass's reads all go before its stores (reads before stores: cuda/device_io.cuh), which
  // made one chain of every entry.
  constexpr int kItems = 2;  // (row, channel) pairs per thread and pass
  for (int idx0 = threadIdx.x; idx0 < kC * kW; idx0 += kItems * blockDim.x) {
    bool diagonal[kItems];
    // later[e][d - 1] for block J + d (past the row's block J): Gamma at its first row for
    // d = 1, else its step (0 past the last block)
    float q[kItems], k[kItems], g[kItems], rho[kItems], later[kItems][kBlocks - 1];
#pragma unroll
    for (int e = 0; e < kItems; ++e) {
      const int idx = min(idx0 + e * static_cast<int>(blockDim.x), kC * kW - 1);
      const int r = idx / kW, cc = idx % kW, J = r / kBlock;
      q[e] = s.q[r][cc], k[e] = s.k[r][cc], g[e] = s.g[r][cc], rho[e] = s.g[kBlock * J][cc];
      diagonal[e] = r < len && !(fails[J] >> cc & 1u);
#pragma unroll
      for (int d = 1; d < kBlocks; ++d) {
        const int I = J + d;
        later[e][d - 1] = I >= kBlocks ? 0.f : d == 1 ? s.g[kBlock * I][cc] : t.steps[I][cc];
      }
    }
#pragma unroll
    for (int e = 0; e < kItems; ++e) {
      const int idx = idx0 + e * static_cast<int>(blockDim.x);
      if (idx >= kC * kW) continue;
      const int r = idx / kW, cc = idx % kW, J = r / kBlock;
      const bool row = r < len;
      const float f = row ? __expf(g[e] - rho[e]) : 0.f;
      t.rows[0][r][cc] = q[e] * f;
      t.rows[1][r][cc] = k[e] * f;
      t.cols[diagonal_column_base(J) + r][cc] = diagonal[e] ? k[e] * __expf(rho[e] - g[e]) : 0.f;
      float col = 0.f;
#pragma unroll
      for (int d = 1; d < kBlocks; ++d) {
        const int I = J + d;
        if (I >= kBlocks) break;
        col = d == 1 ? (row ? k[e] * __expf(later[e][0] - g[e]) : 0.f) : col * later[e][d - 1];
        t.cols[diagonal_column_base(I) + r][cc] = col;
      }
    }
  }
}

// acc += A B for one 16 x 8 tile over k in [0, 8 * steps): a(m, k) and b(k, n) read float32
// from shared memory, rounded to tf32.
template <class FA, class FB>
__device__ __forceinline__ void tile_product(Acc& acc, int steps, const FA& a, const FB& b) {
  const int g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
  for (int s = 0; s < steps; ++s) {
    const int k = 8 * s;
    const uint32_t af[4] = {to_tf32(a(g, k + c)), to_tf32(a(g + 8, k + c)),
                            to_tf32(a(g, k + c + 4)), to_tf32(a(g + 8, k + c + 4))};
    mma_tf32(acc, af, to_tf32(b(k + c, g)), to_tf32(b(k + c + 4, g)));
  }
}

// tile_product to about float32's precision: each operand split into its tf32 rounding and the
// tf32 rounding of what that leaves, three products (hi hi, hi lo, lo hi). For the pairs inside
// a diagonal block: their terms of the gate gradient cancel in exact arithmetic (a pair adds
// to dg_i and takes the same from dg_j), so a tf32 product's 2^-11 would be left over.
template <class FA, class FB>
__device__ __forceinline__ void tile_product_split(Acc& acc, int steps, const FA& a,
                                                   const FB& b) {
  const int g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
  for (int s = 0; s < steps; ++s) {
    const int k = 8 * s;
    const float av[4] = {a(g, k + c), a(g + 8, k + c), a(g, k + c + 4), a(g + 8, k + c + 4)};
    const float bv[2] = {b(k + c, g), b(k + c + 4, g)};
    uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) split_tf32(av[e], ah[e], al[e]);
#pragma unroll
    for (int e = 0; e < 2; ++e) split_tf32(bv[e], bh[e], bl[e]);
    mma_tf32(acc, al, bh[0], bh[1]);
    mma_tf32(acc, ah, bl[0], bl[1]);
    mma_tf32(acc, ah, bh[0], bh[1]);
  }
}

}  // namespace
}  // namespace flashdelta::detail::cuda
