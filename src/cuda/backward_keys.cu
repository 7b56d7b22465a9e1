// The key gradients' products over V of the CUDA backward (stage `keys`, before `grads`;
// cuda/backward_params.h). Per (chunk, value head, 64-key tile), the three products that sum
// over the value columns,
//     A1 = dO S^T,   A2 = v_new dS^T,   A3 = dv_new S^T          (kC x 64 keys each),
// accumulate together in tensor-core registers over 16-column slices of V (dO, v_new, dv_new,
// S and dS staged together, two or three slices in flight), and each gradient they feed is
// written once:
//     dq = A1 e^Gamma,   dk = A2 e^(Gamma_end - Gamma),   dg = A1 qg - A2 kg,   dw = -A3,
//     d Gamma_end = decay * (sum over V of dS S) + (sum over the chunk's rows of A2 kg),
// the last from the same staged slices; grads_kernel adds the rest of these gradients'
// terms. (grads_kernel once ran these products one after another, each its own round of
// staged slices and its own read-modify-write epilogue: slower, bench/NOTES.md (t).)
// Products are m16n8k8 tf32 with float32 sums; S and dS' come in bfloat16 where the scans
// stored them so (BackwardParams::bf16_states), a bfloat16 value being exact in tf32. With
// bfloat16 states, KeysProducts::mixed and ::bf16 take some or all of the products to
// m16n8k16 on bfloat16 operands (cuda/backward_params.h): half the mma per value column and no
// conversion of S and dS at all.
#include <cuda_runtime.h>

#include "cuda/backward_common.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Keys per block: kKeysTile (cuda/backward_params.h).
constexpr int kKeysWarps = kC / 16;  // warp w: token rows 16 w .. 16 w + 15
constexpr int kKeysThreads = 32 * kKeysWarps;
constexpr int kVSlice = 16;                // value columns per staged slice
constexpr int kSliceLd = kVSlice + 4;      // [row][v] rows: a fragment's lanes in distinct banks
constexpr int kKeyTiles8 = kKeysTile / 8;  // n8 tiles per warp

static_assert(kKeysThreads == 2 * kKeysTile, "two threads per key sum dS S (dss below)");

__host__ __device__ inline int64_t key_tiles(int64_t K) { return (K + kKeysTile - 1) / kKeysTile; }

// S and dS' as the workspace holds them: float32, or bfloat16 bits. Rows of 12 mod 32
// 32-bit words for bfloat16 (a fragment's 8 keys in distinct banks, lanes 2c and 2c + 1
// sharing a word) and 16-byte aligned for the copies.
template <bool kBf16>
struct StateOperand {
  using T = float;
  static constexpr int kLd = kSliceLd;
  __device__ static const float* slab(const float* f32, const uint16_t*) { return f32; }
  __device__ static uint32_t tf32(float x) { return to_tf32(x); }
  __device__ static float value(float x) { return x; }
};
template <>
struct StateOperand<true> {
  using T = uint16_t;
  static constexpr int kLd = kVSlice + 8;
  __device__ static const uint16_t* slab(const float*, const uint16_t* b16) { return b16; }
  __device__ static uint32_t tf32(uint16_t x) { return static_cast<uint32_t>(x) << 16; }
  __device__ static float value(uint16_t x) { return __uint_as_float(tf32(x)); }
};

// One staged slice. The tf32 form reads its operands element by element (rows padded so a
// fragment's lanes fall in distinct banks); the bfloat16 forms read a lane's four values of a
// row at once (quad_products), from unpadded rows: 16 floats (a quarter-warp's 16-byte
// reads in distinct banks) and 16 bfloat16 (a half-warp's 8-byte reads likewise).
template <bool kBf16, KeysProducts kOps>
struct alignas(16) KeysStage {
  static_assert(kBf16 || kOps == KeysProducts::tf32, "bfloat16 products need bfloat16 states");
  using Op = StateOperand<kBf16>;
  static constexpr bool kQuads = kOps != KeysProducts::tf32;
  static constexpr int kALd = kQuads ? kVSlice : kSliceLd, kBLd = kQuads ? kVSlice : Op::kLd;
  float a[3][kC][kALd];                                 // dO, v_new, dv_new: [token][v]
  alignas(16) typename Op::T b[2][kKeysTile][kBLd];  // S, dS: [key][v]
};

// Queues values [l0, l0 + kVSlice) of keys [0, keys) of a bfloat16 [key][V] slab into dst
// (zeros past keys or V): 16-byte copies where V is a multiple of 8, else element by element.
// One run of 8 values per thread: key t / 2, values 8 (t % 2) ...
template <int kLd>
__device__ void stage_bf16_keys(const uint16_t* src, int keys, int V, int l0,
                                uint16_t (*dst)[kLd]) {
  constexpr int kRuns = kVSlice / 8;
  static_assert(kKeysTile * kRuns == kKeysThreads, "one run per thread");
  const int n = threadIdx.x / kRuns, r = threadIdx.x % kRuns * 8, l = l0 + r;
  uint16_t* d = &dst[n][r];
  const uint16_t* from = src + static_cast<int64_t>(n) * V + l;
  if (V % 8 == 0) {
    const bool ok = n < keys && l < V;
    copy_async<16>(d, ok ? from : src, ok ? 16 : 0);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) d[e] = n < keys && l + e < V ? from[e] : uint16_t{0};
}

// The bfloat16 forms' staging of slice values [l0, l0 + kVSlice): rows of dO, v_new and dv_new
// by stage_row_runs, S and dS by stage_bf16_keys (one run of 8 values per thread).
template <class Stage>
__device__ __forceinline__ void stage_quad_slice(Stage& st, const float* dout, int64_t dout_ld,
                                                 const float* vn, const float* dvn,
                                                 int64_t rec_ld, const uint16_t* S,
                                                 const uint16_t* dS, int len, int keys, int V,
                                                 int l0, bool delta) {
  static_assert(Stage::kALd == kVSlice && Stage::kBLd == kVSlice, "unpadded rows");
  stage_row_runs<kKeysThreads, kVSlice, kC>(dout, dout_ld, len, V, l0, st.a[0]);
  stage_row_runs<kKeysThreads, kVSlice, kC>(vn, rec_ld, len, V, l0, st.a[1]);
  if (delta) stage_row_runs<kKeysThreads, kVSlice, kC>(dvn, rec_ld, len, V, l0, st.a[2]);
  stage_bf16_keys<kVSlice>(S, keys, V, l0, st.b[0]);
  stage_bf16_keys<kVSlice>(dS, keys, V, l0, st.b[1]);
}

// The epilogue's factors of the tile, Gamma, qg and kg [token][key], staged once the products
// are done (one round trip instead of one per output tile). Rows of 8 mod 32 floats: a
// lane's two adjacent keys are one 8-byte read, a half-warp's in distinct banks.
constexpr int kFactorLd = kKeysTile + 8;
struct KeysFactors {
  float gamma[kC][kFactorLd], qg[kC][kFactorLd], kg[kC][kFactorLd];
};

template <bool kBf16, KeysProducts kOps>
struct KeysShared {
  // Slices staged while one is multiplied: the bfloat16 forms' smaller stages fit three in
  // the factors' place (48 of its 54 KB); the tf32 form keeps two.
  static constexpr int kStages = KeysStage<kBf16, kOps>::kQuads ? 3 : 2;
  union {
    KeysStage<kBf16, kOps> stage[kStages];
    KeysFactors factors;
  };
  float colsum[kKeysWarps][kKeysTile];  // per warp: its rows' sum of A2 kg per key
};

// The tf32 form's products over one staged slice (warp rows m0 .. m0 + 15).
template <bool kBf16>
__device__ __forceinline__ void element_products(const KeysStage<kBf16, KeysProducts::tf32>& st,
                                                 int m0, bool delta,
                                                 Acc (&a1)[kKeyTiles8], Acc (&a2)[kKeyTiles8],
                                                 Acc (&a3)[kKeyTiles8]) {
  using Op = StateOperand<kBf16>;
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  auto ea = [&](int which, int m, int k) { return to_tf32(st.a[which][m][k]); };
  const int operands = delta ? 3 : 2;  // dv_new is staged for the delta rule only
#pragma unroll
  for (int kk = 0; kk < kVSlice; kk += 8) {
    uint32_t f[3][4] = {};
#pragma unroll
    for (int which = 0; which < 3; ++which) {
      if (which >= operands) continue;
      f[which][0] = ea(which, m0 + g, kk + c);
      f[which][1] = ea(which, m0 + g + 8, kk + c);
      f[which][2] = ea(which, m0 + g, kk + c + 4);
      f[which][3] = ea(which, m0 + g + 8, kk + c + 4);
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTiles8; ++nt) {
      const int n = 8 * nt + g;
      const uint32_t s0 = Op::tf32(st.b[0][n][kk + c]), s1 = Op::tf32(st.b[0][n][kk + c + 4]);
      const uint32_t d0 = Op::tf32(st.b[1][n][kk + c]), d1 = Op::tf32(st.b[1][n][kk + c + 4]);
      mma_tf32(a1[nt], f[0], s0, s1);
      mma_tf32(a2[nt], f[1], d0, d1);
      if (delta) mma_tf32(a3[nt], f[2], s0, s1);
    }
  }
}

// The bfloat16 forms' products over one staged slice (warp rows m0 .. m0 + 15). A sum over
// the slice's 16 values may take them in any order as long as both operands agree, so lane
// (g, c) gives the mma its own four values 4c .. 4c + 3 of each row: one 16-byte read of an
// A row (float32), one 8-byte read of a B row (bfloat16). m16n8k16: k slots 2c, 2c + 1 hold
// values 4c, 4c + 1 and slots 2c + 8, 2c + 9 values 4c + 2, 4c + 3 (cuda/mma.cuh's
// fragments: a[0] / a[2] and b[0] / b[1] are those pairs, the lower value in the low half).
// The mixed form's A2 is two m16n8k8 tf32 steps: step s has slot c hold value 4c + 2s and
// slot c + 4 value 4c + 2s + 1.
template <KeysProducts kOps>
__device__ __forceinline__ void quad_products(const KeysStage<true, kOps>& st, int m0, bool delta,
                                              Acc (&a1)[kKeyTiles8], Acc (&a2)[kKeyTiles8],
                                              Acc (&a3)[kKeyTiles8]) {
  const int lane = threadIdx.x % 32, g = lane / 4, c4 = 4 * (lane % 4);
  auto row = [&](int which, int m) {
    return *reinterpret_cast<const float4*>(&st.a[which][m][c4]);
  };
  auto bf16_fragment = [](const float4& lo_row, const float4& hi_row, uint32_t (&f)[4]) {
    f[0] = pack_bf16(lo_row.x, lo_row.y);
    f[1] = pack_bf16(hi_row.x, hi_row.y);
    f[2] = pack_bf16(lo_row.z, lo_row.w);
    f[3] = pack_bf16(hi_row.z, hi_row.w);
  };
  uint32_t f_dout[4], f_dvn[4] = {}, f_vn[4] = {};
  bf16_fragment(row(0, m0 + g), row(0, m0 + g + 8), f_dout);
  if (delta) bf16_fragment(row(2, m0 + g), row(2, m0 + g + 8), f_dvn);
  const float4 vn_lo = row(1, m0 + g), vn_hi = row(1, m0 + g + 8);
  if constexpr (kOps == KeysProducts::bf16) bf16_fragment(vn_lo, vn_hi, f_vn);
  // The mixed form's tf32 fragments of v_new (unused, and dropped, in the bf16 form).
  const uint32_t t_vn[2][4] = {
      {to_tf32(vn_lo.x), to_tf32(vn_hi.x), to_tf32(vn_lo.y), to_tf32(vn_hi.y)},
      {to_tf32(vn_lo.z), to_tf32(vn_hi.z), to_tf32(vn_lo.w), to_tf32(vn_hi.w)}};
#pragma unroll
  for (int nt = 0; nt < kKeyTiles8; ++nt) {
    const int n = 8 * nt + g;
    const uint2 s4 = *reinterpret_cast<const uint2*>(&st.b[0][n][c4]);   // S, 4 values
    const uint2 ds4 = *reinterpret_cast<const uint2*>(&st.b[1][n][c4]);  // dS
    mma_bf16(a1[nt], f_dout, s4.x, s4.y);
    if (delta) mma_bf16(a3[nt], f_dvn, s4.x, s4.y);
    if constexpr (kOps == KeysProducts::bf16) {
      mma_bf16(a2[nt], f_vn, ds4.x, ds4.y);
    } else {
      // A bfloat16 value in the low or high half, as the tf32 bits of that value.
      mma_tf32(a2[nt], t_vn[0], ds4.x << 16, ds4.x & 0xffff0000u);
      mma_tf32(a2[nt], t_vn[1], ds4.y << 16, ds4.y & 0xffff0000u);
    }
  }
}

template <bool kBf16, KeysProducts kOps>
__global__ void __launch_bounds__(kKeysThreads) keys_kernel(const BackwardParams b) {
  using Op = StateOperand<kBf16>;
  using Stage = KeysStage<kBf16, kOps>;
  const int64_t tiles = key_tiles(b.p.K);
  const int64_t rec = blockIdx.x / tiles, hv = rec % b.p.HV;
  const int k0 = static_cast<int>(blockIdx.x % tiles) * kKeysTile;
  ChunkRef ref;
  int64_t r0 = 0;
  if (!chunk_at(b, rec / b.p.HV, ref, r0)) return;
  const int64_t K = b.p.K, V = b.p.V, HV = b.p.HV;
  const int len = ref.len, keys = static_cast<int>(K - k0 < kKeysTile ? K - k0 : kKeysTile);
  const int Vi = static_cast<int>(V);
  const BackwardWorkspace& ws = b.ws;
  extern __shared__ __align__(16) unsigned char smem[];
  KeysShared<kBf16, kOps>& sh = *reinterpret_cast<KeysShared<kBf16, kOps>*>(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = 16 * warp;

  const float* dout = ws.dout + (r0 * HV + hv) * V;  // token rows, stride HV V
  const float* vn = ws.vn + rec * kC * V;            // record rows, stride V
  const float* dvn = ws.dvn + rec * kC * V;
  // The tile's keys, stride V.
  const typename Op::T* S = Op::slab(ws.states, ws.states16) + rec * K * V + k0 * V;
  const typename Op::T* dS = Op::slab(ws.dstates, ws.dstates16) + rec * K * V + k0 * V;
  constexpr int kStages = KeysShared<kBf16, kOps>::kStages;
  auto stage = [&](int s) {
    Stage& st = sh.stage[s % kStages];
    const int l0 = s * kVSlice;
    if constexpr (Stage::kQuads) {
      stage_quad_slice(st, dout, HV * V, vn, dvn, V, S, dS, len, keys, Vi, l0, b.p.delta);
      return;
    }
    stage_operand<kVSlice, true>([&](int m, int l) { return dout + m * HV * V + l; }, len, kC,
                                 Vi, l0, false, &st.a[0][0][0], Stage::kALd);
    stage_operand<kVSlice, true>([&](int m, int l) { return vn + m * V + l; }, len, kC, Vi, l0,
                                 false, &st.a[1][0][0], Stage::kALd);
    if (b.p.delta)
      stage_operand<kVSlice, true>([&](int m, int l) { return dvn + m * V + l; }, len, kC, Vi,
                                   l0, false, &st.a[2][0][0], Stage::kALd);
    if constexpr (kBf16) {
      stage_bf16_keys<Stage::kBLd>(S, keys, Vi, l0, st.b[0]);
      stage_bf16_keys<Stage::kBLd>(dS, keys, Vi, l0, st.b[1]);
    } else {
      stage_operand<kVSlice, true>([&](int n, int l) { return S + n * V + l; }, keys,
                                   kKeysTile, Vi, l0, false, &st.b[0][0][0], Stage::kBLd);
      stage_operand<kVSlice, true>([&](int n, int l) { return dS + n * V + l; }, keys,
                                   kKeysTile, Vi, l0, false, &st.b[1][0][0], Stage::kBLd);
    }
  };

  Acc a1[kKeyTiles8], a2[kKeyTiles8], a3[kKeyTiles8];
  // sum over V of dS S for key threadIdx.x / 2, this thread's half of each slice's columns.
  const int dss_key = threadIdx.x / 2, dss_half = threadIdx.x % 2;
  float dss = 0.f;
  const int slices = (Vi + kVSlice - 1) / kVSlice;
  over_buffered_slices<kStages>(slices, stage, [&](int s) {
    const Stage& st = sh.stage[s % kStages];
    if constexpr (Stage::kQuads) {
      quad_products(st, m0, b.p.delta, a1, a2, a3);
      // dS . S as below, the same sum in the same order, the thread's 8 values of each row in
      // one 16-byte read (value 2j in word j's low half, 2j + 1 in its high half).
      const uint4 sv = *reinterpret_cast<const uint4*>(&st.b[0][dss_key][dss_half * 8]);
      const uint4 dv = *reinterpret_cast<const uint4*>(&st.b[1][dss_key][dss_half * 8]);
      const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
      const auto value = [](uint32_t w, int h) {
        return __uint_as_float(h ? w & 0xffff0000u : w << 16);
      };
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) dss = fmaf(value(dw[j], h), value(sw[j], h), dss);
    } else {
      element_products(st, m0, b.p.delta, a1, a2, a3);
#pragma unroll
      for (int j = 0; j < kVSlice / 2; ++j) {
        const int l = dss_half * (kVSlice / 2) + j;
        dss = fmaf(Op::value(st.b[1][dss_key][l]), Op::value(st.b[0][dss_key][l]), dss);
      }
    }
  });
  wait_async<0>();  // the slice loop ended with a barrier: the stage is free
  const ChunkRows x{b, r0, rec, hv, hv / b.p.group, len};
  {
    KeysFactors& f = sh.factors;
    const auto stage_factors = [&](const float* buf, float (&dst)[kC][kFactorLd]) {
      if constexpr (Stage::kQuads) {
        stage_row_runs<kKeysThreads, kKeysTile, kC>(x.k_rec(const_cast<float*>(buf), 0) + k0, K,
                                                    len, keys, 0, dst);
        return;
      }
      stage_operand<kKeysTile, true>(
          [&](int m, int n) { return x.k_rec(const_cast<float*>(buf), m) + k0 + n; }, len, kC,
          keys, 0, false, &dst[0][0], kFactorLd);
    };
    stage_factors(ws.gamma, f.gamma);
    stage_factors(ws.qg, f.qg);
    stage_factors(ws.kg, f.kg);
    commit_async();
    wait_async<0>();
    __syncthreads();
  }
  dss += __shfl_xor_sync(0xffffffffu, dss, 1);  // both halves of the key's columns

  // The gradients, one output tile at a time, their factors from shared memory. e^x as
  // 2^(x log2 e) by ex2.approx (a few ulp, against tf32's 2^-11), where expf's range reduction
  // was ~20 instructions an element, 64 a thread: as many as half the bfloat16 forms' slice
  // loop. Those flush results below 2^-126 to 0 (.ftz; exponents <= 0); the tf32 form keeps
  // them, as records' and grads' __expf do.
  const auto exp_of = [](float x) {
    return Stage::kQuads ? exp2_approx(x * kLog2e) : __expf(x);
  };
  const KeysFactors& f = sh.factors;
  float kg_colsum[kKeyTiles8][2] = {};  // this lane's rows' A2 kg, per key 8 nt + 2c + e
  // A lane's elements r = 2h and 2h + 1 are keys n and n + 1 of one row (n even): one 8-byte
  // store per buffer where both are inside K and K is even (every row start 8-byte aligned;
  // the buffers' bases are), half the store instructions of four 4-byte ones.
  const bool pairs = K % 2 == 0;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles8; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + acc_row(2 * h), n = 8 * nt + acc_col(2 * h), key = k0 + n;
      if (m >= len || n >= keys) continue;
      float dq[2], dk[2], dg[2], dw[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 2 * h + e;
        const float gamma = f.gamma[m][n + e];
        // Each product rounded before the difference (never contracted into an fma); the A2
        // kg subtracted is the one summed into d Gamma_end.
        const float t = __fmul_rn(a2[nt].d[r], f.kg[m][n + e]);
        dq[e] = a1[nt].d[r] * exp_of(gamma);
        dk[e] = a2[nt].d[r] * exp_of(f.gamma[len - 1][n + e] - gamma);
        dg[e] = __fmul_rn(a1[nt].d[r], f.qg[m][n + e]) - t;
        dw[e] = -a3[nt].d[r];
        if (n + e < keys) kg_colsum[nt][e] += t;
      }
      float* const out[4] = {x.k_row(ws.dq, m) + key, x.k_row(ws.dk, m) + key,
                             x.k_row(ws.dg, m) + key,
                             b.p.delta ? x.k_rec(ws.dw, m) + key : nullptr};  // dw: delta only
      const float* const val[4] = {dq, dk, dg, dw};
      const int outs = b.p.delta ? 4 : 3;
      if (pairs && n + 1 < keys) {
#pragma unroll
        for (int a = 0; a < 4; ++a)
          if (a < outs) *reinterpret_cast<float2*>(out[a]) = make_float2(val[a][0], val[a][1]);
        continue;
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
        if (a < outs) {
          out[a][0] = val[a][0];
          if (n + 1 < keys) out[a][1] = val[a][1];
        }
    }
  }
  // Column sums of A2 kg: over the lane's two rows (above), the warp's 8 row pairs (lanes
  // with the same c), then the warps in order.
#pragma unroll
  for (int nt = 0; nt < kKeyTiles8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float v = lane_sum<4, 16>(kg_colsum[nt][e]);
      if (g == 0) sh.colsum[warp][8 * nt + 2 * c + e] = v;
    }
  __syncthreads();
  if (dss_half == 0 && dss_key < keys) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kKeysWarps; ++w) t += sh.colsum[w][dss_key];
    const int64_t key = k0 + dss_key;
    ws.dgamma[rec * K + key] = ws.decay[rec * K + key] * dss + t;
  }
}

template <bool kBf16, KeysProducts kOps = KeysProducts::tf32>
void launch_keys(const BackwardParams& b, int64_t blocks, cudaStream_t stream) {
  constexpr int kBytes = sizeof(KeysShared<kBf16, kOps>);
  set_shared_bytes(keys_kernel<kBf16, kOps>, kBytes);
  keys_kernel<kBf16, kOps><<<static_cast<unsigned>(blocks), kKeysThreads, kBytes, stream>>>(b);
}

// The factors' union member sizes every form alike.
template <bool kBf16, KeysProducts kOps>
constexpr bool kKeysSizedByFactors =
    sizeof(KeysShared<kBf16, kOps>) == sizeof(KeysShared<false, KeysProducts::tf32>);
static_assert(kKeysSizedByFactors<true, KeysProducts::tf32> &&
                  kKeysSizedByFactors<true, KeysProducts::mixed> &&
                  kKeysSizedByFactors<true, KeysProducts::bf16>,
              "backward_keys_shared_bytes covers every form");

}  // namespace

int64_t backward_keys_shared_bytes() { return sizeof(KeysShared<false, KeysProducts::tf32>); }

void launch_backward_keys(const BackwardParams& b, void* stream) {
  const int64_t blocks = b.max_chunks * b.p.HV * key_tiles(b.p.K);
  if (blocks == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (!b.bf16_states) return launch_keys<false>(b, blocks, s);
  switch (b.keys_products) {
    case KeysProducts::tf32: return launch_keys<true>(b, blocks, s);
    case KeysProducts::mixed: return launch_keys<true, KeysProducts::mixed>(b, blocks, s);
    case KeysProducts::bf16: return launch_keys<true, KeysProducts::bf16>(b, blocks, s);
  }
}

}  // namespace flashdelta::detail::cuda
