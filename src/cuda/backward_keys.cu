// The key gradients' products over V of the CUDA backward (stage `keys`, before `grads`;
// cuda/backward_params.h). Per (chunk, value head, 64-key tile), the three products that sum
// over the value columns,
//     A1 = dO S^T,   A2 = v_new dS^T,   A3 = dv_new S^T          (kC x 64 keys each),
// accumulate together in tensor-core registers over 16-column slices of V (dO, v_new, dv_new,
// S and dS staged together, double-buffered), and each gradient they feed is written once:
//     dq = A1 e^Gamma,   dk = A2 e^(Gamma_end - Gamma),   dg = A1 qg - A2 kg,   dw = -A3,
//     d Gamma_end = decay * (sum over V of dS S) + (sum over the chunk's rows of A2 kg),
// the last from the same staged slices; grads_kernel adds the rest of these gradients'
// terms. (grads_kernel once ran these products one after another, each its own round of
// staged slices and its own read-modify-write epilogue: slower, bench/NOTES.md (t).)
// Products are m16n8k8 tf32 with float32 sums; S and dS' come in bfloat16 where the scans
// stored them so (BackwardParams::bf16_states), a bfloat16 value being exact in tf32.
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

template <bool kBf16>
struct alignas(16) KeysStage {
  using Op = StateOperand<kBf16>;
  float a[3][kC][kSliceLd];                           // dO, v_new, dv_new: [token][v]
  alignas(16) typename Op::T b[2][kKeysTile][Op::kLd];  // S, dS: [key][v]
};

// Queues values [l0, l0 + kVSlice) of keys [0, keys) of a bfloat16 [key][V] slab into dst
// (zeros past keys or V): 16-byte copies where V is a multiple of 8, else element by element.
__device__ void stage_bf16_keys(const uint16_t* src, int keys, int V, int l0,
                                uint16_t (*dst)[StateOperand<true>::kLd]) {
  constexpr int kRuns = kVSlice / 8;
  const bool runs = V % 8 == 0;
  for (int idx = threadIdx.x; idx < kKeysTile * kRuns; idx += blockDim.x) {
    const int n = idx / kRuns, l = l0 + idx % kRuns * 8;
    uint16_t* d = &dst[n][idx % kRuns * 8];
    const uint16_t* from = src + static_cast<int64_t>(n) * V + l;
    if (runs) {
      const bool ok = n < keys && l < V;
      copy_async<16>(d, ok ? from : src, ok ? 16 : 0);
      continue;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) d[e] = n < keys && l + e < V ? from[e] : uint16_t{0};
  }
}

// The epilogue's factors of the tile, Gamma, qg and kg [token][key], staged once the products
// are done (one round trip instead of one per output tile). Rows of 8 mod 32 floats: a
// lane's two adjacent keys are one 8-byte read, a half-warp's in distinct banks.
constexpr int kFactorLd = kKeysTile + 8;
struct KeysFactors {
  float gamma[kC][kFactorLd], qg[kC][kFactorLd], kg[kC][kFactorLd];
};

template <bool kBf16>
struct KeysShared {
  union {
    KeysStage<kBf16> stage[2];
    KeysFactors factors;
  };
  float colsum[kKeysWarps][kKeysTile];  // per warp: its rows' sum of A2 kg per key
};

template <bool kBf16>
__global__ void __launch_bounds__(kKeysThreads) keys_kernel(const BackwardParams b) {
  using Op = StateOperand<kBf16>;
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
  KeysShared<kBf16>& sh = *reinterpret_cast<KeysShared<kBf16>*>(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = 16 * warp;

  const float* dout = ws.dout + (r0 * HV + hv) * V;  // token rows, stride HV V
  const float* vn = ws.vn + rec * kC * V;            // record rows, stride V
  const float* dvn = ws.dvn + rec * kC * V;
  // The tile's keys, stride V.
  const typename Op::T* S = Op::slab(ws.states, ws.states16) + rec * K * V + k0 * V;
  const typename Op::T* dS = Op::slab(ws.dstates, ws.dstates16) + rec * K * V + k0 * V;
  auto stage = [&](int s) {
    KeysStage<kBf16>& st = sh.stage[s & 1];
    const int l0 = s * kVSlice;
    stage_operand<kVSlice, true>([&](int m, int l) { return dout + m * HV * V + l; }, len, kC,
                                 Vi, l0, false, &st.a[0][0][0], kSliceLd);
    stage_operand<kVSlice, true>([&](int m, int l) { return vn + m * V + l; }, len, kC, Vi, l0,
                                 false, &st.a[1][0][0], kSliceLd);
    if (b.p.delta)
      stage_operand<kVSlice, true>([&](int m, int l) { return dvn + m * V + l; }, len, kC, Vi,
                                   l0, false, &st.a[2][0][0], kSliceLd);
    if constexpr (kBf16) {
      stage_bf16_keys(S, keys, Vi, l0, st.b[0]);
      stage_bf16_keys(dS, keys, Vi, l0, st.b[1]);
    } else {
      stage_operand<kVSlice, true>([&](int n, int l) { return S + n * V + l; }, keys,
                                   kKeysTile, Vi, l0, false, &st.b[0][0][0], kSliceLd);
      stage_operand<kVSlice, true>([&](int n, int l) { return dS + n * V + l; }, keys,
                                   kKeysTile, Vi, l0, false, &st.b[1][0][0], kSliceLd);
    }
  };

  Acc a1[kKeyTiles8], a2[kKeyTiles8], a3[kKeyTiles8];
  // sum over V of dS S for key threadIdx.x / 2, this thread's half of each slice's columns.
  const int dss_key = threadIdx.x / 2, dss_half = threadIdx.x % 2;
  float dss = 0.f;
  const int slices = (Vi + kVSlice - 1) / kVSlice;
  const int operands = b.p.delta ? 3 : 2;  // dv_new is staged for the delta rule only
  over_double_buffered_slices(slices, stage, [&](int s) {
    const KeysStage<kBf16>& st = sh.stage[s & 1];
    auto ea = [&](int which, int m, int k) { return to_tf32(st.a[which][m][k]); };
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
        if (b.p.delta) mma_tf32(a3[nt], f[2], s0, s1);
      }
    }
#pragma unroll
    for (int j = 0; j < kVSlice / 2; ++j) {
      const int l = dss_half * (kVSlice / 2) + j;
      dss = fmaf(Op::value(st.b[1][dss_key][l]), Op::value(st.b[0][dss_key][l]), dss);
    }
  });
  wait_async<0>();  // the slice loop ended with a barrier: the stage is free
  const ChunkRows x{b, r0, rec, hv, hv / b.p.group, len};
  {
    KeysFactors& f = sh.factors;
    const auto stage_factors = [&](const float* buf, float (&dst)[kC][kFactorLd]) {
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

  // The gradients, one output tile at a time, their factors from shared memory.
  const KeysFactors& f = sh.factors;
  float kg_colsum[kKeyTiles8][2] = {};  // this lane's rows' A2 kg, per key 8 nt + 2c + e
#pragma unroll
  for (int nt = 0; nt < kKeyTiles8; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = m0 + acc_row(r), n = 8 * nt + acc_col(r), key = k0 + n;
      if (m >= len || n >= keys) continue;
      const float gamma = f.gamma[m][n];
      // Each product rounded before the difference (never contracted into an fma); the A2 kg
      // subtracted is the one summed into d Gamma_end.
      const float t = __fmul_rn(a2[nt].d[r], f.kg[m][n]);
      x.k_row(ws.dq, m)[key] = a1[nt].d[r] * expf(gamma);
      x.k_row(ws.dk, m)[key] = a2[nt].d[r] * expf(f.gamma[len - 1][n] - gamma);
      x.k_row(ws.dg, m)[key] = __fmul_rn(a1[nt].d[r], f.qg[m][n]) - t;
      if (b.p.delta) x.k_rec(ws.dw, m)[key] = -a3[nt].d[r];
      kg_colsum[nt][r % 2] += t;
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

template <bool kBf16>
void launch_keys(const BackwardParams& b, int64_t blocks, cudaStream_t stream) {
  set_shared_bytes(keys_kernel<kBf16>, sizeof(KeysShared<kBf16>));
  keys_kernel<kBf16><<<static_cast<unsigned>(blocks), kKeysThreads, sizeof(KeysShared<kBf16>),
                       stream>>>(b);
}

}  // namespace

int64_t backward_keys_shared_bytes() {
  return sizeof(KeysShared<false>) > sizeof(KeysShared<true>) ? sizeof(KeysShared<false>)
                                                              : sizeof(KeysShared<true>);
}

void launch_backward_keys(const BackwardParams& b, void* stream) {
  const int64_t blocks = b.max_chunks * b.p.HV * key_tiles(b.p.K);
  if (blocks == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (b.bf16_states)
    launch_keys<true>(b, blocks, s);
  else
    launch_keys<false>(b, blocks, s);
}

}  // namespace flashdelta::detail::cuda
