// The pairwise decay terms of a chunk, sum over channels c of x_i[c] y_j[c] e^(G_i[c] - G_j[c])
// for j <= i (A_qk, A_kk and their gradients' A side), split by 16-row blocks. Gamma falls
// along the chunk (gates <= 0), so with block I's reference point rho = Gamma[16 I] (its
// largest Gamma) every pair j < 16 I <= i factors into two numbers no larger than 1:
//     e^(Gamma_i - Gamma_j) = e^(Gamma_i - rho) e^(rho - Gamma_j)
// nothing overflows, and a factor that underflows belongs to a term that does too. Those
// off-diagonal blocks are tensor-core products of per-slice tables; pairs inside one block
// (a quarter of them) are summed exactly, one exp each, as before.
#pragma once

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kBlock = 16;
constexpr int kBlocks = kC / kBlock;
constexpr int kBlockPairs = kBlock * (kBlock + 1) / 2;  // j <= i inside one block
constexpr int kDiagonalPairs = kBlocks * kBlockPairs;
constexpr int kTableRows = kC - kBlock;                        // rows of blocks 1 .. 3
constexpr int kColumnRows = kBlock * kBlocks * (kBlocks - 1) / 2;  // j < 16 I for I = 1 .. 3

// Rows (i, j) of diagonal pair p: j <= i inside block p / kBlockPairs.
__device__ __forceinline__ void diagonal_pair(int p, int& i, int& j) {
  const int blk = p / kBlockPairs, q = p % kBlockPairs;
  int a = static_cast<int>((sqrtf(8.f * static_cast<float>(q) + 1.f) - 1.f) * 0.5f);
  if ((a + 1) * (a + 2) / 2 <= q) ++a;
  if (a * (a + 1) / 2 > q) --a;
  i = blk * kBlock + a;
  j = blk * kBlock + q - a * (a + 1) / 2;
}

// First row of block I's column table (rows j < 16 I, blocks 1, 2, 3 one after another).
__device__ __forceinline__ int column_base(int I) { return kBlock * I * (I - 1) / 2; }

// Per key slice of kW channels (q, k, Gamma staged [row][channel], zeros at rows >= len):
//   rows[x][r - 16][cc] = x[r][cc] e^(Gamma[r][cc] - rho_I)   x = q, k; r in block I >= 1
//   cols[column_base(I) + j][cc] = k[j][cc] e^(rho_I - Gamma[j][cc])   j < 16 I
// zero at rows >= len and for blocks past len. kLd: row length (bank pattern of the user).
template <int kW, int kLd>
struct BlockTables {
  float rows[2][kTableRows][kLd];
  float cols[kColumnRows][kLd];
};

template <int kW, int kLd, class Slice>
__device__ void fill_block_tables(const Slice& s, int len, BlockTables<kW, kLd>& t) {
  for (int idx = threadIdx.x; idx < kTableRows * kW; idx += blockDim.x) {
    const int r = kBlock + idx / kW, cc = idx % kW;
    const float f = r < len ? __expf(s.g[r][cc] - s.g[r / kBlock * kBlock][cc]) : 0.f;
    t.rows[0][r - kBlock][cc] = s.q[r][cc] * f;
    t.rows[1][r - kBlock][cc] = s.k[r][cc] * f;
  }
  for (int idx = threadIdx.x; idx < kColumnRows * kW; idx += blockDim.x) {
    const int row = idx / kW, cc = idx % kW;
    const int I = row < column_base(2) ? 1 : row < column_base(3) ? 2 : 3;
    const int j = row - column_base(I);
    t.cols[row][cc] =
        kBlock * I < len ? s.k[j][cc] * __expf(s.g[kBlock * I][cc] - s.g[j][cc]) : 0.f;
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

}  // namespace
}  // namespace flashdelta::detail::cuda
