// The per-chunk stages of the CUDA backward (cuda/backward_params.h), one block per
// (chunk, value head), all chunks in parallel: `records` recomputes the forward's chunk
// matrices; `grads` takes the scans' v_new and dv_new and what `keys` wrote (the key
// gradients' products over V and d Gamma_end, cuda/backward_keys.cu) to the gradients of the
// transformed inputs. The math is bench/model/chunk_backward.py term by term; Gamma is
// natural-log here and every e^(Gamma_i - Gamma_j) is formed pairwise (an exponent <= 0 for
// j <= i: no factorisation, nothing to overflow). Per-element exponentials are __expf
// (ex2.approx of x log2 e: a few ulp, against tf32's 2^-11; without -ftz it keeps subnormal
// results, three instructions more): expf's range reduction is ~20 instructions an element.
// Global operands pass through shared memory in coalesced slices (staged_product, the key
// slices of the pairwise sums): a thread never waits on a chain of its own global loads.
// A scalar gate (BackwardParams::scalar_pairs) takes a short form of both kernels
// (kScalar): its decay is one number per token pair, so A's entries are plain products
// times that number, and the pairs' share of d Gamma is one C x C matrix's row sums minus
// its column sums (scalar_gate_pairs; bench/model/chunk_backward.py, scalar_gate_pair_dG).
#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/backward_blocks.cuh"
#include "cuda/backward_common.cuh"
#include "cuda/backward_gate.cuh"
#include "cuda/backward_rows.cuh"
#include "cuda/chunk_inverse.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kLd = kC + 1;  // C x C tiles in shared memory, padded against bank conflicts
// grads' d A_qk and d A_kk, the A operands of its pairwise products: rows of 4 mod 32 floats
// put a tf32 fragment's 32 elements (row g, column c of an 8 x 4 quarter) in 32 banks, where
// kLd's g + c met four to a bank; the column jobs' transposed reads meet two to a bank.
constexpr int kDaLd = kC + 4;
constexpr int kWarps = kBackwardThreads / 32;
// Key channels staged per pass of the pairwise sums: records keeps its cumulative sums
// long; grads needs room for its tables.
constexpr int kRecordSlice = 32, kGradSlice = 16;

// Channels [c0, c0 + kW) of the chunk's rows (zeros past len / K), rows kLd floats long.
template <int kW, int kLd>
struct KeySlice {
  float q[kC][kLd], k[kC][kLd], g[kC][kLd];
};

// Issues asynchronous copies of a C x kW slice of float32 rows into shared memory, elements
// (i, c0 + cc) for i < len and c0 + cc < K (0 elsewhere); `row(i)` is the start of row i.
// A run of 4 channels takes one 16-byte copy where it is in range and aligned, else four
// 4-byte copies. Commits nothing: the caller's commit_async / wait_async land it with its
// other copies.
template <int kW, int kLd, class Row>
__device__ void copy_slice_async(const ChunkRows& x, int c0, const Row& row, const float* a,
                                 float (&dst)[kC][kLd]) {
  static_assert(kW % 4 == 0 && kLd % 4 == 0, "16-byte runs and rows");
  const int64_t K = x.b.p.K;
  constexpr int kRuns = kW / 4;
  for (int idx = threadIdx.x; idx < kC * kRuns; idx += blockDim.x) {
    const int i = idx / kRuns, cc = idx % kRuns * 4, c = c0 + cc;
    const bool row_ok = i < x.len;
    // 0 bytes: zero-filled, nothing read (the array start stands in for the address)
    const float* src = row_ok ? row(i) + c : a;
    if (c + 3 < K && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      copy_async<16>(&dst[i][cc], src, row_ok ? 16 : 0);
      continue;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = row_ok && c + e < K;
      copy_async<4>(&dst[i][cc + e], ok ? src + e : a, ok ? 4 : 0);
    }
  }
}

// The chunk's beta (0 past len) into shared memory: epilogues read it per element, and a
// global load there is a long-scoreboard wait per element (ncu: ~10% of records' samples).
__device__ void stage_beta(const ChunkRows& x, float* beta) {
  for (int i = threadIdx.x; i < kC; i += blockDim.x) beta[i] = i < x.len ? x.beta(i) : 0.f;
}

// Records' tables: the slice's channel is the products' summed index (row length 4 mod 32);
// every block's diagonal included (cuda/backward_blocks.cuh).
using RecordTables = DiagonalTables<kRecordSlice, kRecordSlice + 4>;
// Records' key slices: rows of 4 mod 32 floats take 16-byte copies.
using RecordSlice = KeySlice<kRecordSlice, kRecordSlice + 4>;

constexpr int kTmLd = kC + 4;  // T's rows: 16-byte aligned (cuda/chunk_inverse.cuh)

struct RecordsShared {
  RecordSlice slice;
  unsigned fails[kBlocks];  // the slice's channels whose diagonal pairs go one by one
  unsigned any_fail;        // whether any slice had one
  float block_sums[kBlocks][kRecordSlice];  // the slice's gate summed over each 16-row block
  float beta[kC];
  float akk[kC][kLd];
  alignas(16) float tm[kC][kTmLd];
  union {
    RecordTables tables;     // the pairwise sums
    InverseScratch inverse;  // T
    ProductStage<16> stage;  // w and u
  };
};

// Gamma (the cumulative log gate) of one key slice, the gate factors of q and k, beta k e^Gamma
// and the chunk's decay, written to the buffers; leaves q, k and Gamma of the slice staged,
// the channels that fail each block's diagonal bound in fails (any_fail accumulates them) and
// the tables' steps between blocks (cuda/backward_blocks.cuh).
__device__ void slice_factors(const BackwardParams& b, const ChunkRows& x, int64_t rec, int c0,
                              const float* beta, RecordSlice& s, unsigned (&fails)[kBlocks],
                              unsigned& any_fail, float (&sums)[kBlocks][kRecordSlice],
                              float (&steps)[kBlocks][kRecordSlice]) {
  constexpr int kSlice = kRecordSlice;
  const int64_t K = b.p.K;
  const int len = x.len;
  // The gate, q and k slices as asynchronous copies that all go out before any lands: a
  // load-then-store loop waits on every load (the compiler cannot move a global load above a
  // shared store through a generic pointer; ncu: 11% of records' samples), and holding the
  // loads in registers instead spilled. Landed for this thread, then for the block.
  copy_slice_async<kSlice>(x, c0, [&](int i) { return x.k_row(b.ws.gate, i); }, b.ws.gate, s.g);
  copy_slice_async<kSlice>(x, c0, [&](int i) { return x.key_head(b.ws.qn, i); }, b.ws.qn, s.q);
  copy_slice_async<kSlice>(x, c0, [&](int i) { return x.key_head(b.ws.kn, i); }, b.ws.kn, s.k);
  commit_async();
  wait_async<0>();
  __syncthreads();
  // The cumulative sum down each channel by blocks: warp I sums its block's 16 rows of every
  // channel (a lane each; the staged rows past len are zeros) in registers, the blocks'
  // totals pass through `sums`, and each warp adds those before its block. Every block's
  // diagonal bound is checked on the way (its failing channels are the warp's ballot), and
  // warp I forms the step into its block from the first row of the one before, read before
  // that warp rewrites it: the same sums in the same order as that warp's rho.
  constexpr int kRun = kBlock;
  static_assert(kSlice == 32 && kBackwardThreads >= 32 * kBlocks,
                "a warp per block, a lane per channel");
  const int I = threadIdx.x / 32, lane = threadIdx.x % 32, i0 = kRun * I;
  const bool scans = threadIdx.x < 32 * kBlocks;
  float run[kRun], prev_first = 0.f;
  if (scans) {
    float total = 0.f;
#pragma unroll
    for (int u = 0; u < kRun; ++u) run[u] = total += s.g[i0 + u][lane];
    if (I > 0) prev_first = s.g[i0 - kRun][lane];  // reads before stores (device_io.cuh)
    sums[I][lane] = total;
  }
  __syncthreads();
  if (scans) {
    float before = 0.f, before_prev = 0.f;  // the blocks before I, and before I - 1
    for (int J = 0; J < I; ++J) {
      before_prev = before;
      before += sums[J][lane];
    }
    const float rho = before + run[0];
    bool ok = true;
#pragma unroll
    for (int u = 0; u < kRun; ++u)
      if (i0 + u < len) {
        const float G = before + run[u];
        s.g[i0 + u][lane] = G;
        ok &= diagonal_factor_ok(G, rho);
      }
    const unsigned fail = __ballot_sync(0xffffffffu, !ok);  // 0 for a block past len
    if (lane == 0) {
      fails[I] = fail;
      if (fail) atomicOr(&any_fail, fail);
    }
    // Gamma at the chunk's last row (all the blocks): sums read before the steps' store.
    if (I == kBlocks - 1 && c0 + lane < K)
      b.ws.decay[rec * K + c0 + lane] = expf(before + sums[I][lane]);
    // block_step's value, from registers: block_step reads s.g, whose rows the warps are
    // rewriting here.
    if (I >= 2) steps[I][lane] = i0 < len ? __expf(rho - (before_prev + prev_first)) : 0.f;
  }
  __syncthreads();
  // Four channels per thread, stored as one 16-byte word per buffer where in range and aligned
  // (the buffers are carved at aligned bases: one check holds for all four).
  constexpr int kQuads = kSlice / 4;
  for (int idx = threadIdx.x; idx < len * kQuads; idx += blockDim.x) {
    const int i = idx / kQuads, cc = idx % kQuads * 4, c = c0 + cc;
    if (c >= K) continue;
    float out[4][4];  // gamma, qg, kg, kb
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float g = s.g[i][cc + e], ex = __expf(g), kv = s.k[i][cc + e];
      out[0][e] = g;
      out[1][e] = s.q[i][cc + e] * ex;
      out[2][e] = kv * __expf(s.g[len - 1][cc + e] - g);
      out[3][e] = beta[i] * kv * ex;
    }
    float* const dst[4] = {x.k_rec(b.ws.gamma, i) + c, x.k_rec(b.ws.qg, i) + c,
                           x.k_rec(b.ws.kg, i) + c, x.k_rec(b.ws.kb, i) + c};
    const bool vec = c + 3 < K && (reinterpret_cast<uintptr_t>(dst[0]) & 15) == 0;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      if (vec) {
        *reinterpret_cast<float4*>(dst[a]) = make_float4(out[a][0], out[a][1], out[a][2], out[a][3]);
        continue;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (c + e < K) dst[a][e] = out[a][e];
    }
  }
}

// kScalar: a scalar gate (GateForm::scalar): A's entries are plain products of the staged
// q and k, times e^(Gamma_i - Gamma_j) per entry (at most 1 for j <= i), with no tables.
template <bool kScalar>
__global__ void __launch_bounds__(kBackwardThreads, 2) records_kernel(const BackwardParams b) {
  const int64_t rec = blockIdx.x, hv = rec % b.p.HV;
  ChunkRef ref;
  int64_t r0 = 0;
  if (!chunk_at(b, rec / b.p.HV, ref, r0)) return;
  const ChunkRows x{b, r0, rec, hv, hv / b.p.group, ref.len};
  const int K = static_cast<int>(b.p.K), V = static_cast<int>(b.p.V), len = ref.len;
  extern __shared__ __align__(16) unsigned char smem[];
  RecordsShared& sh = *reinterpret_cast<RecordsShared*>(smem);
  stage_beta(x, sh.beta);
  __syncthreads();

  // beta v: a lane per run of 8 values (one 16-byte load for bfloat16), two rows per warp
  // when V <= 128; all of a lane's rows are loaded before any is stored.
  {
    const int lane = threadIdx.x % 32, per_row = V <= 128 ? 16 : 32, c0 = 8 * (lane % per_row);
    const int step = kWarps * (32 / per_row), valid = clamp_run(V - c0);
    constexpr int kBatch = kC / (2 * kWarps);  // a lane's rows at two rows per warp
    const TokenTensor& v = b.p.v;
    const int64_t v0 = x.token_base(v);
    for (int i0 = threadIdx.x / per_row; i0 < len; i0 += kBatch * step) {
      Run8 runs[kBatch];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int i = i0 + r * step;
        runs[r] = load_run8(v, v0 + i * v.stride[1] + c0 * v.stride[3], i < len ? valid : 0);
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int i = i0 + r * step;
        if (i >= len || valid == 0) continue;
        float val[8];
        run8_to_float(runs[r], v.dtype, val);
        const float beta = sh.beta[i];
#pragma unroll
        for (int e = 0; e < 8; ++e) val[e] *= beta;
        store_floats8(x.v_rec(b.ws.vb, i) + c0, valid, val);
      }
    }
  }

  // Per key slice: the factors, then A_qk (diagonal included) and the unscaled A_kk products
  // on the tensor cores (cuda/backward_blocks.cuh): row block I of q or k rows times its
  // column table (j < 16 (I + 1), the diagonal block included)^T, 40 tiles of 16 x 8, five
  // per warp, summed over the slices in registers. A channel that fails a block's diagonal
  // bound adds that block's pairs one by one (aq, kd by pair slot; zero while none fails).
  constexpr int kDiagonalSlots = (kDiagonalPairs + kBackwardThreads - 1) / kBackwardThreads;
  constexpr int kTiles = kDiagonalColumnRows / 8, kJobsPerWarp = 2 * kTiles / kWarps;
  static_assert(2 * kTiles % kWarps == 0, "every warp the same number of tiles");
  const int warp = threadIdx.x / 32;
  // Job e of this warp: rows of q (which 0: A_qk) or k (1: the A_kk products) in block I,
  // columns n0 .. n0 + 7.
  auto job = [&](int e, int& which, int& I, int& n0) {
    const int idx = warp + kWarps * e, t = idx % kTiles;
    which = idx / kTiles;
    I = t < 2 ? 0 : t < 6 ? 1 : t < 12 ? 2 : 3;
    n0 = 8 * t - diagonal_column_base(I);
  };
  float aq[kDiagonalSlots] = {}, kd[kDiagonalSlots] = {};
  Acc tiles[kJobsPerWarp];
  if (threadIdx.x == 0) sh.any_fail = 0u;
  for (int c0 = 0; c0 < K; c0 += kRecordSlice) {
    __syncthreads();
    slice_factors(b, x, rec, c0, sh.beta, sh.slice, sh.fails, sh.any_fail, sh.block_sums,
                  sh.tables.steps);
    __syncthreads();
    const RecordSlice& s = sh.slice;
    if constexpr (kScalar) {
#pragma unroll
      for (int e = 0; e < kJobsPerWarp; ++e) {
        int which, I, n0;
        job(e, which, I, n0);
        if (kBlock * I >= len) continue;
        const int m0 = kBlock * I;
        const float(*rows)[kRecordSlice + 4] = which ? s.k : s.q;
        tile_product(
            tiles[e], kRecordSlice / 8, [&](int m, int k) { return rows[m0 + m][k]; },
            [&](int k, int n) { return s.k[n0 + n][k]; });
      }
      continue;
    }
    fill_diagonal_tables(s, len, sh.fails, sh.tables);
#pragma unroll
    for (int e = 0; e < kDiagonalSlots; ++e) {
      const int p = threadIdx.x + e * kBackwardThreads;
      int i = 0, j = 0;
      if (p < kDiagonalPairs) diagonal_pair(p, i, j);
      if (p >= kDiagonalPairs || i >= len) continue;
      for (unsigned m = sh.fails[i / kBlock]; m != 0u; m &= m - 1u) {
        const int cc = __ffs(m) - 1;
        const float f = __expf(s.g[i][cc] - s.g[j][cc]) * s.k[j][cc];
        aq[e] = fmaf(s.q[i][cc], f, aq[e]);
        kd[e] = fmaf(s.k[i][cc], f, kd[e]);
      }
    }
    __syncthreads();
    const RecordTables& t = sh.tables;
#pragma unroll
    for (int e = 0; e < kJobsPerWarp; ++e) {
      int which, I, n0;
      job(e, which, I, n0);
      if (kBlock * I >= len) continue;
      const int m0 = kBlock * I, c1 = diagonal_column_base(I) + n0;
      tile_product(
          tiles[e], kRecordSlice / 8, [&](int m, int k) { return t.rows[which][m0 + m][k]; },
          [&](int k, int n) { return t.cols[c1 + n][k]; });
    }
  }
  float* aqk = b.ws.aqk + rec * kC * kC;
  float* kdot = b.ws.kdot + rec * kC * kC;
  // Every entry once: the tiles (j < 16 (I + 1)), zeros above them; then, where a channel
  // failed, the diagonal pairs' exact sums added to what the tiles wrote. The tiles' shared
  // reads (beta; a scalar gate's Gamma, its decay applied in place) all go before the first
  // store (reads before stores: cuda/device_io.cuh), which chained the 20 entries.
  float beta_rows[kJobsPerWarp][2];  // beta at a job's two rows (elements 0, 1 and 2, 3)
#pragma unroll
  for (int e = 0; e < kJobsPerWarp; ++e) {
    int which, I, n0;
    job(e, which, I, n0);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = kBlock * I + acc_row(r), j = n0 + acc_col(r);
      if (r % 2 == 0) beta_rows[e][r / 2] = sh.beta[i];
      if (kScalar) {  // every entry's factor (no branch around the reads), kept for j <= i < len
        const float decay = __expf(sh.slice.g[i][0] - sh.slice.g[j][0]);
        if (i < len && j <= i) tiles[e].d[r] *= decay;
      }
    }
  }
  auto put = [&](int which, int i, int j, float v, float beta) {
    const bool row = i < len;
    if (which == 0) {
      aqk[i * kC + j] = row && j <= i ? v : 0.f;
    } else {
      const bool strict = j < i && row;
      kdot[i * kC + j] = strict ? v : 0.f;
      sh.akk[i][j] = strict ? beta * v : 0.f;
    }
  };
#pragma unroll
  for (int e = 0; e < kJobsPerWarp; ++e) {
    int which, I, n0;
    job(e, which, I, n0);
#pragma unroll
    for (int r = 0; r < 4; ++r)
      put(which, kBlock * I + acc_row(r), n0 + acc_col(r), tiles[e].d[r], beta_rows[e][r / 2]);
  }
  for (int idx = threadIdx.x; idx < kC * kC; idx += blockDim.x) {
    const int i = idx / kC, j = idx % kC;
    if (j < (i / kBlock + 1) * kBlock) continue;
    aqk[idx] = 0.f;
    kdot[idx] = 0.f;
    sh.akk[i][j] = 0.f;
  }
  if (!kScalar && sh.any_fail != 0u) {  // the same in every thread: written before the last barrier
    __syncthreads();         // the tiles' entries written (the block reads its own writes)
#pragma unroll
    for (int e = 0; e < kDiagonalSlots; ++e) {
      const int p = threadIdx.x + e * kBackwardThreads;
      if (p >= kDiagonalPairs) continue;
      int i, j;
      diagonal_pair(p, i, j);
      if (i >= len) continue;
      aqk[i * kC + j] += aq[e];
      if (j < i) {
        const float v = kdot[i * kC + j] + kd[e];
        kdot[i * kC + j] = v;
        sh.akk[i][j] = sh.beta[i] * v;
      }
    }
  }
  __syncthreads();

  // T = (I + A_kk)^-1.
  invert_unit_lower_by_columns<kBackwardThreads>(&sh.akk[0][0], kLd, &sh.tm[0][0], kTmLd,
                                                 sh.inverse);
  float* tm = b.ws.tm + rec * kC * kC;
  // 16 bytes a store: T's shared rows are 16-byte aligned (kTmLd), the record's C x C block too.
  for (int idx = threadIdx.x; idx < kC * kC / 4; idx += blockDim.x) {
    const int i = idx / (kC / 4), j = 4 * (idx % (kC / 4));
    *reinterpret_cast<float4*>(tm + i * kC + j) = *reinterpret_cast<const float4*>(&sh.tm[i][j]);
  }

  // w = T (beta k e^Gamma) and u = T (beta v); the linear rule writes u = v (beta is 1).
  const Rows T{&sh.tm[0][0], kTmLd};
  if (b.p.delta) {
    staged_product(len, K, len, T, x.k_recs(b.ws.kb), sh.stage,
                   store_rows([&](int m) { return x.k_rec(b.ws.w, m); }));
    staged_product(len, V, len, T, x.v_recs(b.ws.vb), sh.stage,
                   store_rows([&](int m) { return x.v_rec(b.ws.u, m); }));
  } else {
    __syncthreads();
    for (int idx = threadIdx.x; idx < len * V; idx += blockDim.x)
      x.v_rec(b.ws.u, idx / V)[idx % V] = x.v_rec(b.ws.vb, idx / V)[idx % V];
  }
}

// Grads' tables: the slice's channel is the products' column index (row length 8 mod 32);
// every block's diagonal included (cuda/backward_blocks.cuh).
using GradTables = DiagonalTables<kGradSlice, kGradSlice + 8>;

// Row lengths of 8 mod 32 floats: a tf32 fragment's 32 elements in distinct banks.
constexpr int kTLd = kC + 8, kDwLd = kGradSlice + 8;
// Grads' key slices: rows of 8 mod 32 floats take 16-byte copies and put the scalar gate's
// B fragments (rows k + c, columns g: banks 24 c + g) in distinct banks, where 4 mod 32 met
// two to a bank on a quarter of the lanes. Where the two half-warps read neighbouring rows
// (the column sums), lanes still meet two to a bank at either length.
constexpr int kGradSliceLd = kGradSlice + 8;
using GradSlice = KeySlice<kGradSlice, kGradSliceLd>;

// The pairwise sums of a key slice: sums of d A_qk k e^.. (p1) and d A_kk k e^.. (p2) over
// j <= i, and of both column terms over r >= i (q12), per row and channel; with the delta
// rule, p2 also takes d(beta k e^Gamma) = T^T dw's share (its factors, beta e^Gamma for dk
// and k beta e^Gamma for dg, are p2's own: 1 and k), from T and the slice's dw. The slice's
// dw is dead once that share is taken, before the tables are filled: they share memory.
struct PairScratch {
  GradSlice slice;
  float p1[kC][kGradSlice + 1], p2[kC][kGradSlice + 1], q12[kC][kGradSlice + 1];
  alignas(16) float tm[kC][kTLd];  // T (row-major), for T^T
  unsigned fails[kBlocks];  // per block, the channels whose diagonal pairs go one by one
  union {
    float dw[kC][kDwLd];
    GradTables tables;
    float pkk[kC][kGradSlice + 1];  // scalar gate: the d A_kk row sums, apart from dw's share
  };
};
// mark_failing_blocks writes the tables' steps while the slice's dw is still read.
static_assert(offsetof(GradTables, steps) >= sizeof(float[kC][kDwLd]),
              "the tables' steps lie past dw");

// grads' first C x C products in one staged pass over V: out_p = a_p b^T for p = 0, 1 (with
// the delta rule, d A_qk = dO v_new^T and T^T dv_new v_new^T, whose operands share the right
// one), for rows and columns < M, handed to epi(p, m, n, value); every operand row-major
// (contiguous in l, the summed index, l < L). One slice loop stages all three operands'
// slices (cp.async, double-buffered) and each warp keeps its tiles of both outputs. Warp w
// owns rows 16 (w % 4) .. + 15 and the 8-column tiles w / 4, + 2, + 4, + 6: the lane of an
// output is staged_product's, so an epilogue may key row sums by epilogue_slot(n) here too
// (d A_kk's adds d beta's). tf32 operands (kBf16: bfloat16, below), float32 sums in a fixed
// order. Starts and ends with a block barrier.
//
// kBf16 (BackwardParams::joint_bf16): one m16n8k16 per slice, tile and output on operands
// rounded to bfloat16 where the fragments are read (where tf32 took two m16n8k8 and a
// conversion per element read). The sum over a slice's 16 values takes them in any order
// both operands agree on, so lane (g, c) gives the mma its own values 4c .. 4c + 3 of a row:
// k slots 2c, 2c + 1 hold values 4c, 4c + 1 and slots 2c + 8, 2c + 9 values 4c + 2, 4c + 3
// (as the keys stage's bfloat16 forms, cuda/backward_keys.cu): one 16-byte read per operand
// row, in rows of 16 floats, whose 8-lane phases then meet 32 distinct banks.
constexpr int kJointOuts = 2, kJointL = 16, kJointLd = kJointL + 4;  // 4 mod 32: no conflicts
template <bool kBf16>
constexpr int kJointRowLd = kBf16 ? kJointL : kJointLd;
struct alignas(16) JointStage {
  float a[2][kJointOuts][kC * kJointLd];  // [buffer][output]: a_p(m, l0 + l) at [m * ld + l]
  float b[2][kC * kJointLd];
};

template <bool kBf16, class Epi>
__device__ void joint_products(int M, int L, const Rows (&a)[kJointOuts], const Rows& bm,
                               JointStage& st, const Epi& epi) {
  constexpr int kLd = kJointRowLd<kBf16>;
  constexpr int kRowTiles = kC / 16, kColGroups = kWarps / kRowTiles;
  constexpr int kTiles = kC / 8 / kColGroups;  // column tiles per warp and output
  static_assert(kColGroups * 4 == kEpilogueSlots, "epilogue_slot's column groups");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = warp % kRowTiles * 16, first = warp / kRowTiles;
  const bool rows = m0 < M;
  const int slices = (L + kJointL - 1) / kJointL;
  auto stage = [&](int s) {
#pragma unroll
    for (int p = 0; p < kJointOuts; ++p)
      stage_operand<kJointL, true>([&](int m, int l) { return a[p].at(m, l); }, M, kC, L,
                                   s * kJointL, false, st.a[s & 1][p], kLd);
    stage_operand<kJointL, true>([&](int n, int l) { return bm.at(n, l); }, M, kC, L,
                                 s * kJointL, false, st.b[s & 1], kLd);
  };
  Acc acc[kJointOuts][kTiles];
  __syncthreads();
  over_buffered_slices<2>(slices, stage, [&](int s) {
    if (!rows) return;
    const float* sb = st.b[s & 1];
#pragma unroll
    for (int p = 0; p < kJointOuts; ++p) {
      const float* sa = st.a[s & 1][p];
      if constexpr (kBf16) {
        const float4 lo = *reinterpret_cast<const float4*>(sa + (m0 + g) * kLd + 4 * c);
        const float4 hi = *reinterpret_cast<const float4*>(sa + (m0 + g + 8) * kLd + 4 * c);
        const uint32_t af[4] = {pack_bf16(lo.x, lo.y), pack_bf16(hi.x, hi.y),
                                pack_bf16(lo.z, lo.w), pack_bf16(hi.z, hi.w)};
#pragma unroll
        for (int e = 0; e < kTiles; ++e) {
          const int n0 = (first + kColGroups * e) * 8;
          const float4 col = *reinterpret_cast<const float4*>(sb + (n0 + g) * kLd + 4 * c);
          if (n0 < M) mma_bf16(acc[p][e], af, pack_bf16(col.x, col.y), pack_bf16(col.z, col.w));
        }
      } else {
#pragma unroll
        for (int k0 = 0; k0 < kJointL; k0 += 8) {
          const float* r0 = sa + (m0 + g) * kLd + k0 + c;
          const float* r8 = r0 + 8 * kLd;
          const uint32_t af[4] = {to_tf32(r0[0]), to_tf32(r8[0]), to_tf32(r0[4]),
                                  to_tf32(r8[4])};
#pragma unroll
          for (int e = 0; e < kTiles; ++e) {
            const int n0 = (first + kColGroups * e) * 8;
            const float* col = sb + (n0 + g) * kLd + k0 + c;
            if (n0 < M) mma_tf32(acc[p][e], af, to_tf32(col[0]), to_tf32(col[4]));
          }
        }
      }
    }
  });
  if (rows) {
#pragma unroll
    for (int p = 0; p < kJointOuts; ++p)
#pragma unroll
      for (int e = 0; e < kTiles; ++e)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int m = m0 + acc_row(r), n = (first + kColGroups * e) * 8 + acc_col(r);
          if (m < M && n < M) epi(p, m, n, acc[p][e].d[r]);
        }
  }
  wait_async<0>();
  __syncthreads();
}

struct GradsShared {
  float daqk[kC][kDaLd];  // d A_qk (lower, diagonal included)
  float dakk[kC][kDaLd];  // beta_i d A_kk[i, j] (strictly lower): d of the unscaled products
  float dbeta[kC][kEpilogueSlots];  // d beta's row sums, by epilogue slot
  float beta[kC];
  float gamma[kC];    // scalar gate: Gamma per row
  // Per row: the short scalar form's d Gamma summed over the channels (scalar_gate_pairs,
  // scalar_pair_sums, finish_scalar_gate).
  float dg_rows[kC];
  union {
    struct {
      // The unscaled A_kk products (kdot), d beta's factors in d A_kk's epilogue; rows of
      // 4 mod 32 floats: a fragment's 8 rows two to a bank at most.
      alignas(16) float kdot[kC][kC + 4];
      union {
        ProductStage<16> stage;  // T^T dv_new (or, without the delta rule, d A_qk)
        JointStage joint;        // d A_qk and d A_kk
      };
    } products;
    PairScratch pairs;
  };
};
static_assert(2 * (sizeof(GradsShared) + 1024) <= 228 * 1024,
              "two grads blocks per SM (1 KB of shared memory reserved per block)");

// The tile jobs of add_pair_terms, every block's diagonal included. A row job (which, tile)
// takes the row sums of blocks I = 0 .. 3 (2 I + 2 k-steps each: 20); a column job (J,
// tile) the column sums of block J over blocks I >= J (4 k-steps per I: 16, 12, 8, 4 for
// J = 0 .. 3). Every warp runs 20 k-steps: warps 4-7 one (which, tile) of row jobs each,
// warps 0-3 the column jobs of one tile, blocks {0, 3} (warps 0, 1) or {1, 2} (warps 2, 3).
constexpr int kColTiles = kGradSlice / 8;
static_assert(kWarps == 8 && kBlocks == 4 && kColTiles == 2, "the assignment above");

// A C x C float32 matrix (T, or the unscaled A_kk products; row-major in global memory) into
// shared rows of kDstLd floats, as 16-byte asynchronous copies left uncommitted: the next
// commit_async / wait_async lands them.
template <int kDstLd>
__device__ void stage_matrix_async(const float* src, float (&dst)[kC][kDstLd]) {
  static_assert(kDstLd % 4 == 0, "16-byte aligned rows");
  constexpr int kQuads = kC / 4;
  for (int idx = threadIdx.x; idx < kC * kQuads; idx += blockDim.x)
    copy_async<16>(&dst[idx / kQuads][idx % kQuads * 4], src + idx * 4, 16);
}

// L2 prefetches of the chunk's rows, channels [c0, c0 + kGradSlice), of the pairwise stage's
// inputs (q, k, Gamma, dw) or of the gradients it adds to (dq, dk, dg), a slice ahead of the
// copies and read-modify-writes that wait on them (other blocks wrote them long before).
// Worth 1% of grads (bench/NOTES.md (z)); the same in records and keys gained nothing.
// A scalar gate's pairs read no Gamma slice (add_pair_terms); its slices read dg for their
// share of the row's d Gamma (scalar_pair_sums), as the general form's add to it.
template <bool kScalar>
__device__ void prefetch_pair_inputs(const ChunkRows& x, int c0) {
  const BackwardWorkspace& ws = x.b.ws;
  const int64_t K = x.b.p.K, HK = x.b.H * K;
  if (c0 >= K) return;
  prefetch_rows(x.key_head(ws.qn, 0) + c0, HK, x.len, kGradSlice);
  prefetch_rows(x.key_head(ws.kn, 0) + c0, HK, x.len, kGradSlice);
  if (!kScalar) prefetch_rows(x.k_rec(ws.gamma, 0) + c0, K, x.len, kGradSlice);
  if (x.b.p.delta) prefetch_rows(x.k_rec(ws.dw, 0) + c0, K, x.len, kGradSlice);
}
__device__ void prefetch_pair_grads(const ChunkRows& x, int c0) {
  const BackwardWorkspace& ws = x.b.ws;
  const int64_t K = x.b.p.K, VK = x.b.p.HV * K;
  prefetch_rows(x.k_row(ws.dq, 0) + c0, VK, x.len, kGradSlice);
  prefetch_rows(x.k_row(ws.dk, 0) + c0, VK, x.len, kGradSlice);
  prefetch_rows(x.k_row(ws.dg, 0) + c0, VK, x.len, kGradSlice);
}

// add_pair_terms' products and epilogue for a scalar gate, after the slice's dw share:
// rows i, p1 = sum over j <= i of daqk[i][j] k_j and pkk the same of dakk; columns j, q12 =
// sum over r >= j of daqk[r][j] q_r + dakk[r][j] k_r (daqk and dakk carrying the decay). The
// general form's jobs (20 k-steps per warp), each one product with nothing to scale back;
// then dq and dk, and d Gamma summed over the slice's channels into dg_rows: keys' dg, T^T
// dw's share, and d Gamma_end at the last row.
__device__ void scalar_pair_sums(const ChunkRows& x, int c0, const float (*daqk)[kDaLd],
                                 const float (*dakk)[kDaLd], float* dg_rows, PairScratch& pr) {
  const BackwardWorkspace& ws = x.b.ws;
  const int K = static_cast<int>(x.b.p.K), len = x.len, warp = threadIdx.x / 32;
  const int cc = threadIdx.x % kGradSlice, rg = threadIdx.x / kGradSlice;
  constexpr int kRowGroups = kBackwardThreads / kGradSlice;
  const bool delta = x.b.p.delta;
  const GradSlice& s = pr.slice;
  if (warp >= 4) {
    const int which = (warp - 4) / kColTiles, n0 = warp % kColTiles * 8;
    const float(*dA)[kDaLd] = which ? dakk : daqk;
    float(*out)[kGradSlice + 1] = which ? pr.pkk : pr.p1;
    for (int I = 0; I < kBlocks && kBlock * I < len; ++I) {
      Acc acc;
      tile_product(
          acc, 2 * I + 2, [&](int m, int k) { return dA[kBlock * I + m][k]; },
          [&](int k, int n) { return s.k[k][n0 + n]; });
#pragma unroll
      for (int r = 0; r < 4; ++r) out[kBlock * I + acc_row(r)][n0 + acc_col(r)] = acc.d[r];
    }
  } else {
    const int n0 = warp % kColTiles * 8, steps_to = (len + 7) / 8;
    for (int pass = 0; pass < 2; ++pass) {
      const int J = warp < 2 ? 3 * pass : 1 + pass, j0 = kBlock * J;
      if (j0 >= len) continue;
      Acc acc;
      tile_product(
          acc, steps_to - j0 / 8, [&](int m, int k) { return daqk[j0 + k][j0 + m]; },
          [&](int k, int n) { return s.q[j0 + k][n0 + n]; });
      tile_product(
          acc, steps_to - j0 / 8, [&](int m, int k) { return dakk[j0 + k][j0 + m]; },
          [&](int k, int n) { return s.k[j0 + k][n0 + n]; });
#pragma unroll
      for (int r = 0; r < 4; ++r) pr.q12[j0 + acc_row(r)][n0 + acc_col(r)] = acc.d[r];
    }
  }
  __syncthreads();
  const int c = c0 + cc;
  const bool live = c < K;
  float dq[kBlocks], dk[kBlocks], dg[kBlocks];
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    if (i >= len || !live) continue;
    dq[u] = x.k_row(ws.dq, i)[c];
    dk[u] = x.k_row(ws.dk, i)[c];
    dg[u] = x.k_row(ws.dg, i)[c];
  }
  const float dgamma_end = live ? ws.dgamma[x.rec * K + c] : 0.f;
  // This channel's part of the row's d Gamma: keys' dg, T^T dw's share, and d Gamma_end at the
  // last row (where the reverse sum down the rows, taken once for the sum over the channels
  // in finish_scalar_gate, starts).
  float share[kBlocks];
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    share[u] = 0.f;
    if (i < len && live) {
      const float p2 = delta ? pr.p2[i][cc] : 0.f;
      x.k_row(ws.dq, i)[c] = dq[u] + pr.p1[i][cc];
      x.k_row(ws.dk, i)[c] = dk[u] + (p2 + pr.pkk[i][cc] + pr.q12[i][cc]);
      share[u] = dg[u] + s.k[i][cc] * p2 + (i == len - 1 ? dgamma_end : 0.f);
    }
  }
  // dg_rows' read-modify-writes after every row's reads and sums (over the half-warp's
  // channels; reads before stores: cuda/device_io.cuh), which chained the rows' shuffles.
  float before[kBlocks];
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    share[u] = lane_sum<1, kGradSlice / 2>(share[u]);
    before[u] = cc == 0 ? dg_rows[rg + u * kRowGroups] : 0.f;
  }
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    if (cc == 0 && i < len) dg_rows[i] = before[u] + share[u];
  }
}

// Adds the pairwise terms of d A_qk and d A_kk (row-major [i][j] in shared memory, zero
// outside j <= i < len) over key channels c0 .. c0 + kGradSlice - 1 to the chunk's rows of dq,
// dk and dg (cuda/backward_blocks.cuh): row sums (their i side) and column sums (j side), on
// the tensor cores block by block, each product's rows scaled back by their own e^(Gamma -
// rho) factor in its epilogue; a (block, channel) that fails the diagonal bound adds its
// diagonal pairs one by one, exactly, in the final epilogue (d Gamma's reverse sum down the
// rows comes after every slice: reverse_cumsum_dg). Starts with a barrier (the scratch's last
// use and the dA writes are behind it). With the delta rule, T (pr.tm) must have landed with
// the first slice (stage_matrix_async before it) and T^T dw's d beta share goes to dbeta's
// epilogue slots.
// kScalar (a scalar gate): daqk and dakk already carry e^(Gamma_i - Gamma_j)
// (scalar_gate_pairs), so the sums are plain products over the slice with no tables, and
// the pairs' share of d Gamma was taken whole there; T^T dw's share and keys' dg (d Gamma_end
// at the last row), summed over the slice's channels, are added here, to dg_rows (gamma:
// Gamma per row; scalar_pair_sums).
template <bool kScalar>
__device__ void add_pair_terms(const ChunkRows& x, int c0, const float (*daqk)[kDaLd],
                               const float (*dakk)[kDaLd], const float* beta, const float* gamma,
                               float* dg_rows, float (*dbeta)[kEpilogueSlots], PairScratch& pr) {
  const BackwardWorkspace& ws = x.b.ws;
  const int K = static_cast<int>(x.b.p.K), len = x.len, warp = threadIdx.x / 32;
  const int cc = threadIdx.x % kGradSlice, rg = threadIdx.x / kGradSlice;
  constexpr int kRowGroups = kBackwardThreads / kGradSlice;
  static_assert(kRowGroups == kBlock, "a thread's epilogue rows: one per block");
  const bool delta = x.b.p.delta;
  prefetch_pair_inputs<kScalar>(x, c0 + kGradSlice);
  prefetch_pair_grads(x, c0);
  __syncthreads();
  const auto head_row = [&](const float* a) { return [&x, a](int i) { return x.key_head(a, i); }; };
  const auto rec_row = [&](const float* a) {
    return [&x, a](int i) { return x.k_rec(const_cast<float*>(a), i); };
  };
  if (!kScalar && threadIdx.x < kBlocks) pr.fails[threadIdx.x] = 0u;  // marked after the next barrier
  copy_slice_async<kGradSlice>(x, c0, head_row(ws.qn), ws.qn, pr.slice.q);
  copy_slice_async<kGradSlice>(x, c0, head_row(ws.kn), ws.kn, pr.slice.k);
  if (!kScalar) copy_slice_async<kGradSlice>(x, c0, rec_row(ws.gamma), ws.gamma, pr.slice.g);
  if (delta) copy_slice_async<kGradSlice>(x, c0, rec_row(ws.dw), ws.dw, pr.dw);
  commit_async();
  wait_async<0>();
  __syncthreads();
  const GradSlice& s = pr.slice;
  if (!kScalar) mark_failing_blocks(s, len, pr.fails, pr.tables);
  if (delta) {
    // p2 = beta e^Gamma (T^T dw) for the slice, a 16 x 8 tile per warp (rows 16 (w % 4) on,
    // columns 8 (w / 4) on); d beta's share, k e^Gamma (T^T dw), into the lane's slot.
    static_assert(kWarps == 2 * kBlocks && kGradSlice == 16, "a tile per warp");
    const int m0 = kBlock * (warp % kBlocks), n0 = 8 * (warp / kBlocks);
    Acc acc;
    if (m0 < len)
      tile_product(
          acc, kC / 8, [&](int m, int k) { return pr.tm[k][m0 + m]; },
          [&](int k, int n) { return pr.dw[k][n0 + n]; });
    const int slot = epilogue_slot(c0 + n0 + acc_col(0));  // the same for the lane's 4
    // Every read before the stores (cuda/device_io.cuh).
    float g[4], k[4], beta_m[2], dbeta_m[2];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = m0 + acc_row(r), n = n0 + acc_col(r);
      g[r] = kScalar ? gamma[m] : s.g[m][n];
      k[r] = s.k[m][n];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + acc_row(2 * h);
      beta_m[h] = beta[m];
      dbeta_m[h] = dbeta[m][slot];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + acc_row(2 * h);
      float share = 0.f;
#pragma unroll
      for (int r = 2 * h; r < 2 * h + 2; ++r) {
        const int n = n0 + acc_col(r);
        const float e = m < len ? __expf(g[r]) * acc.d[r] : 0.f;
        pr.p2[m][n] = beta_m[h] * e;
        share = fmaf(k[r], e, share);
      }
      if (m < len) dbeta[m][slot] = dbeta_m[h] + share;
    }
  }
  __syncthreads();  // fails marked; dw read (the tables, or pkk, take its place)
  if constexpr (kScalar) return scalar_pair_sums(x, c0, daqk, dakk, dg_rows, pr);
  fill_diagonal_tables(s, len, pr.fails, pr.tables);
  __syncthreads();
  const GradTables& t = pr.tables;
  if (warp >= 4) {
    // Rows of every block I: sum over j < 16 (I + 1) of dA[i][j] k~_I[j] (which: A_qk or A_kk).
    const int which = (warp - 4) / kColTiles, n0 = warp % kColTiles * 8;
    const float(*dA)[kDaLd] = which ? dakk : daqk;
    float(*out)[kGradSlice + 1] = which ? pr.p2 : pr.p1;
    const bool add = which == 1 && delta;  // p2 holds T^T dw's share
    for (int I = 0; I < kBlocks && kBlock * I < len; ++I) {
      const int j0 = kBlock * I, base = diagonal_column_base(I);
      // The epilogue's reads before the products and every store: a read after a store waits
      // for it, which chained the four outputs' reads, exponentials and stores.
      const unsigned fails = I == 0 ? pr.fails[0] : 0u;
      const float rho[2] = {s.g[j0][n0 + acc_col(0)], s.g[j0][n0 + acc_col(1)]};
      float g[4], before[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = j0 + acc_row(r), n = n0 + acc_col(r);
        g[r] = s.g[i][n];
        before[r] = add ? out[i][n] : 0.f;
      }
      // Columns before the block in tf32, the diagonal block's split (backward_blocks.cuh).
      Acc acc;
      tile_product(
          acc, 2 * I, [&](int m, int k) { return dA[j0 + m][k]; },
          [&](int k, int n) { return t.cols[base + k][n0 + n]; });
      tile_product_split(
          acc, 2, [&](int m, int k) { return dA[j0 + m][j0 + k]; },
          [&](int k, int n) { return t.cols[base + j0 + k][n0 + n]; });
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = j0 + acc_row(r), n = n0 + acc_col(r);
        if (i >= len) continue;
        // Block 0's columns are all diagonal: none for a failing channel, whose factor
        // need not be finite.
        const float v = fails >> n & 1u ? 0.f : acc.d[r] * __expf(g[r] - rho[r % 2]);
        out[i][n] = add ? before[r] + v : v;
      }
    }
  } else {
    // Rows j of block J: sum over blocks I >= J of e^(rho_I - Gamma_j) times the sum over
    // r in I of dA_qk[r][j] q^_I[r] + dA_kk[r][j] k^_I[r]; the diagonal block's only where
    // its channel passes (a failing one adds it pairwise below). The later blocks' factor is
    // e^(rho_(J+1) - Gamma_j) e^(rho_I - rho_(J+1)), both at most 1: the second is a product
    // of the tables' steps, the same for every row of the lane (its two channels), and the
    // first multiplies their sum once, so a row takes two exponentials, not one per block.
    const int n0 = warp % kColTiles * 8;
    for (int pass = 0; pass < 2; ++pass) {
      const int J = warp < 2 ? 3 * pass : 1 + pass;
      if (kBlock * J >= len) continue;
      float total[4] = {0.f, 0.f, 0.f, 0.f}, later[4] = {0.f, 0.f, 0.f, 0.f};
      float scale[2] = {1.f, 1.f};  // e^(rho_I - rho_(J+1)) for channels n0 + acc_col(0), + 1
      for (int I = J; I < kBlocks && kBlock * I < len; ++I) {
        Acc acc;
        const int r0 = kBlock * I, j0 = kBlock * J;
        const auto aq = [&](int m, int k) { return daqk[r0 + k][j0 + m]; };
        const auto ak = [&](int m, int k) { return dakk[r0 + k][j0 + m]; };
        const auto bq = [&](int k, int n) { return t.rows[0][r0 + k][n0 + n]; };
        const auto bk = [&](int k, int n) { return t.rows[1][r0 + k][n0 + n]; };
        if (I > J) {
          tile_product(acc, 2, aq, bq);
          tile_product(acc, 2, ak, bk);
        } else {  // the diagonal block split, as the row sums'
          tile_product_split(acc, 2, aq, bq);
          tile_product_split(acc, 2, ak, bk);
        }
        if (I == J) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int j = j0 + acc_row(r), n = n0 + acc_col(r);
            if (!(pr.fails[J] >> n & 1u)) total[r] += acc.d[r] * __expf(s.g[r0][n] - s.g[j][n]);
          }
          continue;
        }
        if (I > J + 1)
#pragma unroll
          for (int h = 0; h < 2; ++h) scale[h] *= t.steps[I][n0 + acc_col(h)];
#pragma unroll
        for (int r = 0; r < 4; ++r) later[r] = fmaf(acc.d[r], scale[r % 2], later[r]);
      }
      const int next = kBlock * (J + 1);  // rho_(J+1)'s row
      if (J + 1 < kBlocks && next < len)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int j = kBlock * J + acc_row(r), n = n0 + acc_col(r);
          total[r] += later[r] * __expf(s.g[next][n] - s.g[j][n]);
        }
#pragma unroll
      for (int r = 0; r < 4; ++r) pr.q12[kBlock * J + acc_row(r)][n0 + acc_col(r)] = total[r];
    }
  }
  __syncthreads();
  const int c = c0 + cc;
  if (c >= K) return;
  // Row i = rg + 16 u lies in block u. A failing block's diagonal pairs one by one, added to
  // this thread's own entries (exponents <= 0 for j <= i: Gamma falls). Rare: not unrolled.
#pragma unroll 1
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    if (i >= len || !(pr.fails[u] >> cc & 1u)) continue;
    const int first = u * kBlock, last = min(first + kBlock, len);
    const float gi = s.g[i][cc];
    float p1 = pr.p1[i][cc], p2 = pr.p2[i][cc], q12 = pr.q12[i][cc];
    for (int j = first; j <= i; ++j) {
      const float f = __expf(gi - s.g[j][cc]) * s.k[j][cc];
      p1 = fmaf(daqk[i][j], f, p1);
      p2 = fmaf(dakk[i][j], f, p2);
    }
    for (int r = i; r < last; ++r) {
      const float e = daqk[r][i] * s.q[r][cc] + dakk[r][i] * s.k[r][cc];
      q12 = fmaf(e, __expf(s.g[r][cc] - gi), q12);
    }
    pr.p1[i][cc] = p1, pr.p2[i][cc] = p2, pr.q12[i][cc] = q12;
  }
  // Every row's dq, dk and dg loaded before any is stored: the loads in flight together.
  float dq[kBlocks], dk[kBlocks], dg[kBlocks];
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    if (i >= len) continue;
    dq[u] = x.k_row(ws.dq, i)[c];
    dk[u] = x.k_row(ws.dk, i)[c];
    dg[u] = x.k_row(ws.dg, i)[c];
  }
  // And their shared factors: read in each row's branch, they waited for the row before.
  float p1[kBlocks], p2[kBlocks], q12[kBlocks], qi[kBlocks], ki[kBlocks];
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    p1[u] = pr.p1[i][cc], p2[u] = pr.p2[i][cc], q12[u] = pr.q12[i][cc];
    qi[u] = s.q[i][cc], ki[u] = s.k[i][cc];
  }
#pragma unroll
  for (int u = 0; u < kBlocks; ++u) {
    const int i = rg + u * kRowGroups;
    if (i >= len) continue;
    x.k_row(ws.dq, i)[c] = dq[u] + p1[u];
    x.k_row(ws.dk, i)[c] = dk[u] + (p2[u] + q12[u]);
    x.k_row(ws.dg, i)[c] = dg[u] + (qi[u] * p1[u] + ki[u] * p2[u] - ki[u] * q12[u]);
  }
}

// A scalar gate's pairs, once per chunk instead of per key slice: e^(Gamma_i - Gamma_j) is one
// number per pair (at most 1 for j <= i), so it moves onto d A_qk and d A_kk (scaled in
// place, for add_pair_terms<true>), and the pairs' whole share of d Gamma is one matrix:
//     M[i][j] = d A_qk[i][j] A_qk[i][j] + d A_kk[i][j] A_kk[i][j]   (A_kk unscaled by beta)
//     d Gamma_i += sum_j M[i][j] - sum_r M[r][i]
// (the vector gate's row and column sums, summed over the channels). A pair adds the same
// float to d Gamma_i as it takes from d Gamma_j, so below j the reverse cumulative sum cancels
// it to float32's rounding of the sums (the vector form computes the two copies apart, and
// needs float32-precise products on the diagonal blocks for that). Written to
// dg_rows; the column sums pass through `scratch` (8 x 64 floats). Ends with a barrier.
__device__ void scalar_gate_pairs(const ChunkRows& x, const float* aqk, const float* kdot,
                                  float (*daqk)[kDaLd], float (*dakk)[kDaLd], const float* gamma,
                                  float* dg_rows, float (*scratch)[kC]) {
  constexpr int kRows = kC / kWarps;  // a warp's rows: warp, warp + 8, ...
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, len = x.len;
  const bool delta = x.b.p.delta;
  // Every load of the warp's rows out before the first use.
  float a[kRows][2], kd[kRows][2];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = warp + kWarps * r, j = lane + 32 * h;
      const bool pair = j <= i && i < len;
      a[r][h] = pair ? aqk[i * kC + j] : 0.f;
      kd[r][h] = pair && delta ? kdot[i * kC + j] : 0.f;
    }
  // A row's shared reads all before its stores, and the row sums stored after the loop
  // (reads before stores: cuda/device_io.cuh), which chained the pairs and the rows' shuffles.
  const float gamma_j[2] = {gamma[lane], gamma[lane + 32]};
  float col[2] = {0.f, 0.f}, rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp + kWarps * r;
    const float gamma_i = gamma[i];
    float dq[2], dk[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) dq[h] = daqk[i][lane + 32 * h], dk[h] = dakk[i][lane + 32 * h];
    float row = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = lane + 32 * h;
      if (j > i || i >= len) continue;
      const float m = dq[h] * a[r][h] + dk[h] * kd[r][h];
      row += m;
      col[h] += m;
      const float d = __expf(gamma_i - gamma_j[h]);
      daqk[i][j] = dq[h] * d;
      dakk[i][j] = dk[h] * d;
    }
    rows[r] = lane_sum<1, 16>(row);
  }
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < kRows; ++r) dg_rows[warp + kWarps * r] = rows[r];
  scratch[warp][lane] = col[0];
  scratch[warp][lane + 32] = col[1];
  __syncthreads();
  if (threadIdx.x < kC) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += scratch[w][threadIdx.x];
    dg_rows[threadIdx.x] -= sum;
  }
  __syncthreads();
}

// A scalar gate's gradient per row, the short form's (kScalar): the reverse sum down the rows
// of dg_rows, which holds the whole of d Gamma summed over the channels (the pairs' share from
// scalar_gate_pairs, each key slice's from scalar_pair_sums). To channel 0 of the workspace's
// dg for the outputs stage, which reads that channel alone (BackwardParams::scalar_pairs), or
// finished here (gate_in_grads): the raw gate's gradient in its dtype, its float32 copy in the
// workspace for ddt_bias's sum, A_log's share. Every thread calls it (a barrier).
__device__ void finish_scalar_gate(const ChunkRows& x, float* dg_rows) {
  const BackwardParams& b = x.b;
  const int len = x.len;
  if (threadIdx.x < 32) {  // a warp's suffix sums, rows 2 l and 2 l + 1 in lane l
    const int l = threadIdx.x;
    const float a0 = 2 * l < len ? dg_rows[2 * l] : 0.f;
    const float a1 = 2 * l + 1 < len ? dg_rows[2 * l + 1] : 0.f;
    float suffix = a0 + a1;  // from lane l on, once the shuffles are done
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float t = __shfl_down_sync(0xffffffffu, suffix, off);
      if (l + off < 32) suffix += t;
    }
    float later = __shfl_down_sync(0xffffffffu, suffix, 1);  // from lane l + 1 on
    if (l == 31) later = 0.f;
    const float odd = later + a1;
    dg_rows[2 * l + 1] = odd;
    dg_rows[2 * l] = odd + a0;
  }
  __syncthreads();
  const int m = threadIdx.x;
  if (m >= len) return;
  const float d = dg_rows[m];
  const RecurrentParams& p = b.p;
  if (!b.gate_in_grads) {
    x.k_row(b.ws.dg, m)[0] = d;
    return;
  }
  const float raw = raw_gate(p, x.token_base(p.g) + m * p.g.stride[1], x.hv, 0);
  const GateGrad gg = gate_grad(p, raw, gate_scale(p, x.hv), d);
  if (b.dg.data)
    store_float(const_cast<void*>(b.dg.data), b.dg.dtype, x.token_base(b.dg) + m * b.dg.stride[1],
                gg.raw);
  if (b.ddt_bias.data) x.k_row(b.ws.dg, m)[0] = gg.raw;
  if (b.dA_log.data) b.ws.dA_log_part[(x.r0 + m) * p.HV + x.hv] = gg.A_log;
}

// The chunk's rows of dq, dk, dv and d beta in their dtypes, as the outputs stage would take
// them (BackwardParams::rows_in_grads: one value head per key head, so nothing is summed over
// heads, and every token row is some chunk's): dq and dk from the workspace's, final once
// every key slice is done; dv and d beta from d(beta v) (the workspace's dv, written at the
// start) and d beta's other terms (its epilogue slots). A warp takes one or two rows at a
// time (RowLanes), every load of the rows out before the first store. Every thread calls it
// (the lane sums).
__device__ void finish_rows(const ChunkRows& x, const float (*dbeta_slots)[kEpilogueSlots],
                            const float* beta) {
  const BackwardParams& b = x.b;
  const RecurrentParams& p = b.p;
  const BackwardWorkspace& ws = b.ws;
  const RowLanes rl(p);
  const int c0 = rl.c0, rows = rl.rows(), warp = threadIdx.x / 32;
  const bool v_dot = p.delta && b.dbeta.data;
  const int key_run = clamp_run(p.K - c0);
  const int value_run = b.dv.data || v_dot ? clamp_run(p.V - c0) : 0;
  const int64_t T = p.T;
  const int64_t q0 = token_row_offset(p.q, x.r0, T, x.h), k0 = token_row_offset(p.k, x.r0, T, x.h);
  const int64_t dq0 = token_row_offset(b.dq, x.r0, T, x.h), dk0 = token_row_offset(b.dk, x.r0, T, x.h);
  const int64_t v0 = x.token_base(p.v), dv0 = x.token_base(b.dv), db0 = x.token_base(b.dbeta);
  const int64_t beta0 = x.token_base(p.beta);
  // The same count of rows for both halves of a warp (C is even): the lane sums stay whole.
  for (int m = warp * rows + rl.sub; m < kC; m += kWarps * rows) {
    const bool active = m < x.len;
    const int kvalid = active ? key_run : 0, vvalid = active ? value_run : 0;
    const bool want_q = b.dq.data && kvalid > 0, want_k = b.dk.data && kvalid > 0;
    const bool beta_lane = b.dbeta.data && rl.leader() && active;
    float yq[8], yk[8], d[8];
    load_floats8(x.k_row(ws.dq, m) + c0, want_q ? kvalid : 0, yq);
    load_floats8(x.k_row(ws.dk, m) + c0, want_k ? kvalid : 0, yk);
    load_floats8(x.v_row(ws.dv, m) + c0, vvalid, d);
    Run8 rq{}, rk{}, vraw{};
    if (p.qk_l2norm && want_q) rq = load_run8(p.q, q0 + m * p.q.stride[1] + c0 * p.q.stride[3], kvalid);
    if (p.qk_l2norm && want_k) rk = load_run8(p.k, k0 + m * p.k.stride[1] + c0 * p.k.stride[3], kvalid);
    if (v_dot && vvalid > 0) vraw = load_run8(p.v, v0 + m * p.v.stride[1] + c0 * p.v.stride[3], vvalid);
    float dbeta = 0.f, raw_beta = 0.f;
    if (beta_lane) {
#pragma unroll
      for (int e = 0; e < kEpilogueSlots; ++e) dbeta += dbeta_slots[m][e];
      if (p.beta_sigmoid) raw_beta = load_float(p.beta.data, p.beta.dtype, beta0 + m * p.beta.stride[1]);
    }
    finish_key_grad(p, rl, rq, p.q.dtype, b.dq, dq0 + m * b.dq.stride[1] + c0 * b.dq.stride[3],
                    p.scale, kvalid, want_q, yq);
    finish_key_grad(p, rl, rk, p.k.dtype, b.dk, dk0 + m * b.dk.stride[1] + c0 * b.dk.stride[3],
                    1.f, kvalid, want_k, yk);
    finish_value_row(b, rl, d, vraw, vvalid, active ? beta[m] : 0.f,
                     dv0 + m * b.dv.stride[1] + c0 * b.dv.stride[3], v_dot, beta_lane, dbeta,
                     raw_beta, db0 + m * b.dbeta.stride[1]);
  }
}

// Gamma = cumsum(g) inside the chunk: g's gradient is the reverse cumulative sum, from the
// chunk-end term dgamma_end[c] down the rows. Rows are loaded kRun at a time, so the loads do
// not wait on each other. (A scalar gate's short form sums over the channels first:
// finish_scalar_gate.)
__device__ void reverse_cumsum_dg(const ChunkRows& x, const float* dgamma_end) {
  constexpr int kRun = 16;
  const BackwardWorkspace& ws = x.b.ws;
  const int len = x.len, K = static_cast<int>(x.b.p.K);
  for (int c = threadIdx.x; c < K; c += blockDim.x) {
    float run = dgamma_end[c];
    for (int top = kC; top > 0; top -= kRun) {
      float col[kRun];
#pragma unroll
      for (int i = 0; i < kRun; ++i) {
        const int row = top - kRun + i;
        col[i] = row < len ? x.k_row(ws.dg, row)[c] : 0.f;
      }
#pragma unroll
      for (int i = kRun - 1; i >= 0; --i) {
        run += col[i];
        if (top - kRun + i < len) x.k_row(ws.dg, top - kRun + i)[c] = run;
      }
    }
  }
}

// kScalar: a scalar gate (GateForm::scalar), whose pairs take the short form
// (scalar_gate_pairs, add_pair_terms<true>).
template <bool kScalar, bool kJointBf16>
__global__ void __launch_bounds__(kBackwardThreads, 2) grads_kernel(const BackwardParams b) {
  const int64_t rec = blockIdx.x, hv = rec % b.p.HV;
  ChunkRef ref;
  int64_t r0 = 0;
  if (!chunk_at(b, rec / b.p.HV, ref, r0)) return;
  // The same in every lane: through a shuffle, ptxas keeps len in a register instead of
  // recomputing it from the sequence's bounds, which it would hold (or spill) all kernel long.
  const int len = __shfl_sync(0xffffffffu, ref.len, 0);
  const ChunkRows x{b, r0, rec, hv, hv / b.p.group, len};
  const int K = static_cast<int>(b.p.K), V = static_cast<int>(b.p.V);
  const BackwardWorkspace& ws = b.ws;
  const float* tm = ws.tm + rec * kC * kC;
  const float* kdot = ws.kdot + rec * kC * kC;
  extern __shared__ __align__(16) unsigned char smem[];
  GradsShared& sh = *reinterpret_cast<GradsShared*>(smem);
  for (int idx = threadIdx.x; idx < kC * kC; idx += blockDim.x) {
    sh.daqk[idx / kC][idx % kC] = 0.f;
    sh.dakk[idx / kC][idx % kC] = 0.f;
  }
  for (int idx = threadIdx.x; idx < kC * kEpilogueSlots; idx += blockDim.x)
    sh.dbeta[idx / kEpilogueSlots][idx % kEpilogueSlots] = 0.f;
  stage_beta(x, sh.beta);
  if (kScalar)  // every channel's Gamma is the same: channel 0's
    for (int i = threadIdx.x; i < kC; i += blockDim.x)
      sh.gamma[i] = i < len ? x.k_rec(ws.gamma, i)[0] : 0.f;
  // d beta[m] = sum over n of beta_m's share of the products' outputs, added in their
  // epilogues (epilogue_slot; T^T dw's in add_pair_terms): nothing is stored for a second
  // pass to sum.
  auto add_dbeta = [&](int m, int n, float v) { sh.dbeta[m][epilogue_slot(n)] += v; };
  const Rows dO = x.v_rows(ws.dout);
  ProductStage<16>& st = sh.products.stage;
  prefetch_pair_inputs<kScalar>(x, 0);  // the first key slice, needed after the products
  // keys_kernel wrote dq, dk, dg (their products over V) and dw; d Gamma_end waits in the
  // workspace for the reverse sum of d Gamma (reverse_cumsum_dg; the scalar form's sum over
  // the channels first, scalar_pair_sums).

  if (b.p.delta) {
    const Cols T_t{tm, kC};  // T^T
    stage_matrix_async(kdot, sh.products.kdot);  // lands with the product's first slice
    // d(beta v) = T^T dv_new, stored as it is: the outputs stage scales it by beta into dv
    // and adds its products with v to d beta, a row at a time in 16-byte loads (here every
    // output waited on its own load of v).
    staged_product(len, V, len, T_t, x.v_recs(ws.dvn), st,
                   store_rows([&](int m) { return x.v_row(ws.dv, m); }));
    // d A_kk = -T^T dT T^T (strictly lower) needs neither dT nor T twice: w and u enter only
    // v_new = u - w S, so dT = dv_new (beta v)^T + dw (beta k e^Gamma)^T with
    // dw = -dv_new S^T is dv_new (beta v - beta k e^Gamma S)^T = dv_new ((I + A_kk) v_new)^T,
    // and T^T dT T^T = T^T dv_new v_new^T (I + A_kk)^T T^T = d(beta v) v_new^T. So
    // d A_qk = tril(dO v_new^T) and d A_kk = -tril(d(beta v) v_new^T, -1) come from one pass
    // over V with a shared right operand, d(beta v) read back from dv (this block wrote it
    // before the product's closing barrier). d beta takes d A_kk's products with the
    // unscaled A_kk products.
    const Rows a[kJointOuts] = {dO, x.v_rows(ws.dv)};
    joint_products<kJointBf16>(len, V, a, x.v_recs(ws.vn), sh.products.joint,
                               [&](int p, int m, int n, float acc) {
                                 if (p == 0) {
                                   sh.daqk[m][n] = n <= m ? acc : 0.f;
                                   return;
                                 }
                                 const float d = n < m ? -acc : 0.f;
                                 sh.dakk[m][n] = sh.beta[m] * d;
                                 add_dbeta(m, n, d * sh.products.kdot[m][n]);
                               });
    // d(beta k e^Gamma) = T^T dw, per key slice in add_pair_terms (its epilogue there adds
    // to dk and dg with the slice's k and Gamma staged).
    stage_matrix_async(tm, sh.pairs.tm);  // lands with the first key slice
  } else {
    // d A_qk = tril(dO v_new^T).
    staged_product(len, len, V, dO, x.v_recs_t(ws.vn), st,
                   [&](int m, int n, float acc) { sh.daqk[m][n] = n <= m ? acc : 0.f; });
    for (int idx = threadIdx.x; idx < len * V; idx += blockDim.x)
      x.v_row(ws.dv, idx / V)[idx % V] = x.v_rec(ws.dvn, idx / V)[idx % V];
  }

  if (kScalar)  // its column sums pass through p1, which the slices write after a barrier
    scalar_gate_pairs(x, ws.aqk + rec * kC * kC, kdot, sh.daqk, sh.dakk, sh.gamma, sh.dg_rows,
                      reinterpret_cast<float(*)[kC]>(&sh.pairs.p1[0][0]));
  for (int c0 = 0; c0 < K; c0 += kGradSlice)
    add_pair_terms<kScalar>(x, c0, sh.daqk, sh.dakk, sh.beta, sh.gamma, sh.dg_rows, sh.dbeta,
                            sh.pairs);
  __syncthreads();
  if (b.rows_in_grads) {
    finish_rows(x, sh.dbeta, sh.beta);
  } else if (b.p.delta) {
    for (int m = threadIdx.x; m < len; m += blockDim.x) {
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < kEpilogueSlots; ++e) s += sh.dbeta[m][e];
      ws.dbeta[(x.r0 + m) * b.p.HV + hv] = s;
    }
  }
  if constexpr (kScalar)
    finish_scalar_gate(x, sh.dg_rows);
  else
    reverse_cumsum_dg(x, ws.dgamma + rec * K);
}

// One block per record; both kernels keep more than the 48 KB of static shared memory.
template <class Shared>
void launch_per_record(void (*kernel)(BackwardParams), const BackwardParams& b, void* stream) {
  const unsigned blocks = static_cast<unsigned>(b.max_chunks * b.p.HV);
  if (blocks == 0) return;
  set_shared_bytes(kernel, sizeof(Shared));
  // Two blocks per SM (grads: 2 x 113 KB, exactly 228 KB with the reserved 1 KB each) need
  // all of it as shared memory; the driver's own pick is not promised.
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                       cudaSharedmemCarveoutMaxShared);
  kernel<<<blocks, kBackwardThreads, sizeof(Shared), static_cast<cudaStream_t>(stream)>>>(b);
}

}  // namespace

int64_t backward_chunk_shared_bytes() {
  return sizeof(GradsShared) > sizeof(RecordsShared) ? sizeof(GradsShared) : sizeof(RecordsShared);
}

void launch_backward_records(const BackwardParams& b, void* stream) {
  launch_per_record<RecordsShared>(
      b.scalar_pairs ? records_kernel<true> : records_kernel<false>, b, stream);
}

void launch_backward_grads(const BackwardParams& b, void* stream) {
  if (b.joint_bf16)
    return launch_per_record<GradsShared>(
        b.scalar_pairs ? grads_kernel<true, true> : grads_kernel<false, true>, b, stream);
  launch_per_record<GradsShared>(
      b.scalar_pairs ? grads_kernel<true, false> : grads_kernel<false, false>, b, stream);
}

}  // namespace flashdelta::detail::cuda
