// The CUDA recurrent schedule's warp kernel for V-first states: one warp per task of
// (sequence, value head, CW value columns), its K x CW state tile in registers, and no
// shared memory and no barrier at all. Every lane loads and transforms the token inputs of
// its own keys, and the sums over keys (the norms, k^T S' and q^T S') are shuffles. The
// tasks are 8 columns (4 KB of fp32 state at K = 128): small enough that a step has no
// ramp or drain to speak of at any batch size (the block kernel, cuda/recurrent_kernel.cu,
// costs ~10 us per launch in its first and last waves) and short chains where few
// sequences are latency only; large enough that the per-token work (loads, gate, norms)
// is spread over 4 KB of state. With 8 keys per lane (K = 256, and K = 128 for many
// sequences where cuda_recurrent_warp_keys says so) the tasks are 16 columns. Where
// cuda_recurrent_warp_prefetch_eighths says so (one-token pool steps by default), each row
// and value head gets a prefetch block that queues a later row's states into L2 ahead of
// that row's tasks.
//
// The host (cuda/recurrent.cpp) sends it the common case only: a key-contiguous (V-first)
// state, so that a warp's load is whole columns (one 512-byte column of fp32 state at
// K = 128; on a K-first state its rows would be short segments: measured at 35-48% of the
// copy bandwidth, bench/NOTES.md (ae)); K a
// power of two in [32, 256] (no key masking); V a multiple of CW (no column masking);
// states that allow aligned vector runs and whose head tiles are addressable in 32 bits;
// token tensors of float32 or 16-bit with unit channel stride, aligned. The math is the
// block kernel's: with S' = Diag(exp g) S and r = beta (v - S'^T k),
//     S'' = S' + k r^T,    o = S''^T q = S'^T q + (q . k) r.
#include <climits>
#include <string>

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
#include "cuda/recurrent_task.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Lane geometry for head size KB: a lane owns RK keys x 8 adjacent columns, KL key lanes x
// CL column lanes make the warp. The keys come in RK / 4 runs of 4 with the key lanes' runs
// adjacent, so that a warp's load is KL x 16 contiguous bytes of each column.
template <int KB, int KeysPerLane>
struct WarpTile {
  static constexpr int kKeys = KB;
  static constexpr int RK = KeysPerLane;  // 4, or 8 at K >= 128 (tasks of 16 columns)
  static constexpr int KL = KB / RK;
  static constexpr int CL = 32 / KL;
  static constexpr int kColumns = 8;  // per lane (4 measured 25-35% slower from N = 64 on)
  static constexpr int CW = CL * kColumns;
  // After the transposing sums over key lanes (column_sum) a column's sum is held by
  // KL / kColumns adjacent key lanes.
  static constexpr int kSpread = KL / kColumns;
  static_assert(KL * CL == 32 && kSpread >= 1, "a warp of key x column lanes");

  int key_lane, column;  // column: first of the lane's kColumns, within the task's CW
  int sum_column;        // the lane's column (of its kColumns) after column_sum
  __device__ WarpTile() {
    const int lane = threadIdx.x % 32;
    key_lane = lane % KL;
    column = lane / KL * kColumns;
    sum_column = key_lane / kSpread;
  }
  // Key r of the lane's RK: run r / 4, element r % 4.
  __device__ int key(int r) const { return (r / 4) * (KL * 4) + key_lane * 4 + r % 4; }
  // Lane (within the key lanes of the caller's column lane) that holds column e's sum.
  __device__ static int sum_lane(int e) { return e * kSpread; }
};

// One-warp blocks per SM the register budget is sized for.
template <int RK, class T>
constexpr int warp_min_blocks() {
  return RK >= 8 ? 12 : T::kAllBf16 ? 24 : 20;
}

// Sums x[e] over the KL key lanes for every e < CPL, transposing as it goes: each exchange
// sends half of the lane's remaining values and keeps the other half, so CPL values cost
// CPL - 1 shuffles for the first log2(CPL) steps instead of CPL each. On return the lane
// holds the full sum of x[sum_column] (x is used up).
template <class W, int CPL>
__device__ __forceinline__ float column_sum(float (&x)[CPL], int key_lane) {
#pragma unroll
  for (int n = CPL, off = W::KL / 2; n > 1; n /= 2, off /= 2) {
    const bool upper = key_lane & off;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = upper ? x[i] : x[i + n / 2];
      const float keep = upper ? x[i + n / 2] : x[i];
      x[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
  return lane_sum<1, W::kSpread / 2>(x[0]);  // the key lanes left (none when kSpread is 1)
}

// Four consecutive channels of a token tensor (unit channel stride, aligned: the host
// checks) as raw bits: one 8-byte load of a 16-bit tensor (two packed words, w[0] and
// w[1]) or one 16-byte load of float32. Split from the conversion like load_raw, so that
// all of a lane's loads are in flight before it waits on any.
struct Run4 {
  uint32_t w[4];
};

__device__ __forceinline__ Run4 load_run4(const void* data, DType dtype, int64_t off) {
  if (is_16bit(dtype)) {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(data) + off);
    return {{v.x, v.y, 0u, 0u}};
  }
  const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const float*>(data) + off);
  return {{v.x, v.y, v.z, v.w}};
}
template <class T>
__device__ __forceinline__ Run4 load_run4(const TokenTensor& x, int64_t off) {
  return load_run4(x.data, T::of(x), off);
}

__device__ __forceinline__ void run4_to_float(const Run4& r, DType t, float* out) {
  if (t == DType::bf16) {
    bf16_pairs_to_float<4>(r.w, out);
  } else if (t == DType::f16) {
    f16_pairs_to_float<4>(r.w, out);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = __uint_as_float(r.w[e]);
  }
}

// One token's inputs for one lane, as raw bits: q, k and g over its RK keys, v of its
// sum column (the lane computes that column's residual), the scalar gate and beta.
template <int RK>
struct LaneToken {
  Run4 q[RK / 4], k[RK / 4], g[RK / 4], bias[RK / 4];
  uint32_t v, scalar_g, scalar_bias, beta;
};

// The gate's bias (dt_bias) is loaded with every token, like the block kernel: an L1 hit
// after the first, and no registers held across tokens.
template <class W, class T>
__device__ void fetch_lane_token(const RecurrentParams& p, const RowOffsets& row, int64_t t,
                                 int64_t hv, int col, const W& tile, LaneToken<W::RK>& raw) {
  const bool bias = p.gate_in_kernel && p.dt_bias;
  const int64_t oq = row.q + t * p.q.stride[1], ok = row.k + t * p.k.stride[1];
  const int64_t og = row.g + t * p.g.stride[1];
  raw.v = load_raw(p.v.data, T::of(p.v), row.v + t * p.v.stride[1] + col + tile.sum_column);
#pragma unroll
  for (int g = 0; g < W::RK / 4; ++g) {
    const int i = tile.key(4 * g);
    raw.q[g] = load_run4<T>(p.q, oq + i);
    raw.k[g] = load_run4<T>(p.k, ok + i);
    if (p.gate == GateForm::vector) {
      raw.g[g] = load_run4<T>(p.g, og + i);
      if (bias) raw.bias[g] = load_run4(p.dt_bias, p.dt_bias_dtype, hv * p.dt_bias_head_stride + i);
    }
  }
  if (p.gate == GateForm::scalar) {
    raw.scalar_g = load_raw(p.g.data, T::of(p.g), og);
    if (bias) raw.scalar_bias = load_raw(p.dt_bias, p.dt_bias_dtype, hv * p.dt_bias_head_stride);
  }
  if (p.delta) raw.beta = load_raw(p.beta.data, T::of(p.beta), row.beta + t * p.beta.stride[1]);
}

// One token's inputs transformed, for one lane: q (normalised and scaled) and k
// (normalised) over its keys, their decays exp(g), v of its sum column, q . k and beta.
template <int RK>
struct LaneInputs {
  float q[RK], k[RK], d[RK];
  float v, qk, beta;
};

template <class W, class T>
__device__ void transform_lane_token(const RecurrentParams& p, const LaneToken<W::RK>& raw,
                                     float a, LaneInputs<W::RK>& in) {
  const bool bias = p.gate_in_kernel && p.dt_bias;
  constexpr int RK = W::RK;
  in.v = raw_to_float(raw.v, T::of(p.v));
#pragma unroll
  for (int g = 0; g < RK / 4; ++g) {
    run4_to_float(raw.q[g], T::of(p.q), in.q + 4 * g);
    run4_to_float(raw.k[g], T::of(p.k), in.k + 4 * g);
  }
  if (p.gate == GateForm::vector) {
    float gx[RK];
#pragma unroll
    for (int g = 0; g < RK / 4; ++g) run4_to_float(raw.g[g], T::of(p.g), gx + 4 * g);
    if (bias)
#pragma unroll
      for (int g = 0; g < RK / 4; ++g) {
        float b[4];
        run4_to_float(raw.bias[g], p.dt_bias_dtype, b);
#pragma unroll
        for (int e = 0; e < 4; ++e) gx[4 * g + e] += b[e];
      }
    if (p.gate_in_kernel) activate_gates(p, gx, a);
#pragma unroll
    for (int r = 0; r < RK; ++r) in.d[r] = expf(gx[r]);
  } else {
    float d = 1.f;
    if (p.gate == GateForm::scalar) {
      float gx = raw_to_float(raw.scalar_g, T::of(p.g));
      if (bias) gx += raw_to_float(raw.scalar_bias, p.dt_bias_dtype);
      if (p.gate_in_kernel) gx = activate_gate(p, gx, a);
      d = expf(gx);
    }
#pragma unroll
    for (int r = 0; r < RK; ++r) in.d[r] = d;
  }
  in.beta = p.delta ? activate_beta(p, raw_to_float(raw.beta, T::of(p.beta))) : 1.f;

  float sq = 0.f, sk = 0.f, sqk = 0.f;
#pragma unroll
  for (int r = 0; r < RK; ++r) {
    sq = fmaf(in.q[r], in.q[r], sq);
    sk = fmaf(in.k[r], in.k[r], sk);
    sqk = fmaf(in.q[r], in.k[r], sqk);
  }
  sq = lane_sum<1, W::KL / 2>(sq);
  sk = lane_sum<1, W::KL / 2>(sk);
  sqk = lane_sum<1, W::KL / 2>(sqk);
  const float q_mul = p.scale * (p.qk_l2norm ? rsqrtf(sq + kL2NormEps) : 1.f);
  const float k_mul = p.qk_l2norm ? rsqrtf(sk + kL2NormEps) : 1.f;
  in.qk = sqk * q_mul * k_mul;
#pragma unroll
  for (int r = 0; r < RK; ++r) {  // normalised and scaled from here on
    in.q[r] *= q_mul;
    in.k[r] *= k_mul;
  }
}

// Element offset of the lane's chunk c from the tile base: chunk c holds keys
// key(4 (c / kColumns))..+3 of column c % kColumns. 32-bit (the host checks that a tile's
// extent fits): a 64-bit offset per chunk would hold two registers each through the task.
template <class W>
__device__ __forceinline__ int chunk_offset(const StateTensor& st, const W& tile, int col, int c) {
  constexpr int C = W::kColumns;
  return (col + c % C) * static_cast<int>(st.value_stride) + tile.key(4 * (c / C));
}

// Plain loads: evict-first ones (ld.global.cs) measured ~2% slower at N = 256, where the
// state streams through L2 once each way (bench/NOTES.md (aj)).
__device__ __forceinline__ void load_state_run(const float* p, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load_state_run(const __nv_bfloat16* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = __uint_as_float(v.x << 16), x[1] = __uint_as_float(v.x & 0xffff0000u);
  x[2] = __uint_as_float(v.y << 16), x[3] = __uint_as_float(v.y & 0xffff0000u);
}

// A prefetch block's work: the whole state of (row n, value head hv), every value column,
// queued into L2 (nothing where the row starts from no state; a serving row with no tokens
// is prefetched though its tasks will not read it). Not inlined: inlined, its registers
// moved the tasks' allocation (ptxas: 12 -> 20-28 bytes spilled).
template <class W, class S>
__device__ __noinline__ void prefetch_pair(const RecurrentParams& p, int64_t n, int64_t hv) {
  if (!p.state_in.data) return;
  const int64_t slot = start_slot(p, n);
  if (slot < 0) return;
  prefetch_row_lines(tile_base<const S>(p.state_in, slot, hv), p.state_in.value_stride,
                     static_cast<int>(p.V), W::kKeys);
}

// One task: its token inputs, its state (zeros without an initial state), the steps, the
// stores.
template <class W, class T, class S>
__device__ void run_warp_task(const RecurrentParams& p, const W& tile, const Task& w) {
  constexpr int RK = W::RK, CPL = W::kColumns, kChunks = RK / 4 * CPL;
  const int64_t n = w.n, hv = w.hv;
  // The key head by a multiply-shift division where the group fits 31 bits (a 64-bit
  // division is a long call on a one-token step's critical path).
  const int64_t h = p.group <= INT_MAX ? fast_divide(static_cast<uint32_t>(hv), p.group_divisor)
                                       : hv / p.group;
  const Sequence seq = sequence_of(p, n);
  const RowOffsets row = row_offsets(p, seq, h, hv);
  const int col = w.j0 + tile.column;
  const int lane = threadIdx.x % 32;

  // Token 0's loads go out before the slot index is back (a padding row's are unused), and
  // its transform runs while the state loads are in flight: at one token per task the
  // index -> state chain is then the step's only exposed latency.
  LaneToken<RK> raw;
  if (seq.len > 0) fetch_lane_token<W, T>(p, row, 0, hv, col, tile, raw);
  const float a = p.A_log ? expf(load_float(p.A_log, p.A_log_dtype, hv * p.A_log_stride)) : 1.f;

  if (w.start < 0) {  // padding row: zeros out, no state touched
    for (int64_t e = lane; e < seq.len * W::CW; e += 32)
      store_float(const_cast<void*>(p.o.data), T::of(p.o),
                  row.o + (e / W::CW) * p.o.stride[1] + (w.j0 + e % W::CW) * p.o.stride[3], 0.f);
    return;
  }
  if (p.serving && !p.per_token_slots && seq.len == 0) return;  // nothing to update

  float x[kChunks][4];
  if (p.state_in.data) {
    const S* src = tile_base<const S>(p.state_in, w.start, hv);
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      load_state_run(src + chunk_offset(p.state_in, tile, col, c), x[c]);
  } else {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int m = 0; m < 4; ++m) x[c][m] = 0.f;
  }
  LaneInputs<RK> in;
  if (seq.len > 0) transform_lane_token<W, T>(p, raw, a, in);

  for (int64_t t = 0; t < seq.len; ++t) {
    // A later token's loads are not issued early: their registers would hold through the
    // passes (decode is one token; a speculative step a few).
    if (t > 0) {
      fetch_lane_token<W, T>(p, row, t, hv, col, tile, raw);
      transform_lane_token<W, T>(p, raw, a, in);
    }

    // Decay, then the lane's partial column sums k^T S' and q^T S', summed over key lanes
    // into the lane's sum column.
    float pred[CPL], out[CPL];
#pragma unroll
    for (int e = 0; e < CPL; ++e) pred[e] = out[e] = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int r = 4 * (c / CPL) + m, e = c % CPL;  // key r of the lane's, column e
        x[c][m] *= in.d[r];
        pred[e] = fmaf(in.k[r], x[c][m], pred[e]);
        out[e] = fmaf(in.q[r], x[c][m], out[e]);
      }
    const float pred_sum = column_sum<W>(pred, tile.key_lane);
    const float out_sum = column_sum<W>(out, tile.key_lane);
    const float r_sum = p.delta ? in.beta * (in.v - pred_sum) : in.v;
    if (tile.key_lane % W::kSpread == 0)
      store_float(const_cast<void*>(p.o.data), T::of(p.o),
                  row.o + t * p.o.stride[1] + col + tile.sum_column, fmaf(in.qk, r_sum, out_sum));
    float r_col[CPL];  // every column's residual, from the lanes that hold them
#pragma unroll
    for (int e = 0; e < CPL; ++e)
      r_col[e] = __shfl_sync(0xffffffffu, r_sum, W::sum_lane(e), W::KL);

    // S'' = S' + k r^T, kept for the next token and written to its slot, if any.
    const int64_t slot = slot_after(p, n, t, seq.len, w.start);
    S* const dst = slot >= 0 ? tile_base<S>(p.state_out, slot, hv) : nullptr;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int m = 0; m < 4; ++m)
        x[c][m] = fmaf(in.k[4 * (c / CPL) + m], r_col[c % CPL], x[c][m]);
      if (dst) store_run<4>(dst + chunk_offset(p.state_out, tile, col, c), 1, 4, true, x[c]);
    }
  }
  if (!p.serving && seq.len == 0 && p.state_out.data) {  // empty sequence: state passes through
    S* const dst = tile_base<S>(p.state_out, n, hv);
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      store_run<4>(dst + chunk_offset(p.state_out, tile, col, c), 1, 4, true, x[c]);
  }
}

// Blocks of one warp: the task grid, else a grid-stride loop (past 65,535 sequences or heads).
// With kPrefetch (the task grid only), each row and value head has a prefetch block past
// its value tiles; a template parameter, so that the kernels without are unchanged by it.
template <int KB, int RK, class T, class S, bool kPrefetch>
__global__ void __launch_bounds__(32, (warp_min_blocks<RK, T>()))
    recurrent_warp_kernel(const __grid_constant__ RecurrentParams p) {
  using W = WarpTile<KB, RK>;
  const W tile;
  if (p.task_grid) {  // the task is the block index: ~100 instructions of division saved
    if constexpr (kPrefetch) {
      if (blockIdx.x == p.value_tiles) {
        const int64_t n = blockIdx.z + p.prefetch_rows;
        if (n < p.N) prefetch_pair<W, S>(p, n, blockIdx.y);
        return;
      }
    }
    return run_warp_task<W, T, S>(p, tile, task_of_grid<W::CW>(p));
  }
  const int64_t tasks = p.N * p.HV * p.value_tiles;
  for (int64_t blk = blockIdx.x; blk < tasks; blk += gridDim.x)
    run_warp_task<W, T, S>(p, tile, task_of<W::CW>(p, blk, tasks));
}

template <int KB, int RK, class T, class S>
void launch_kernel(const RecurrentParams& p, cudaStream_t stream) {
  const int64_t tasks = p.N * p.HV * p.value_tiles;
  // Prefetch blocks only for the serving common case (bfloat16 tokens): a small
  // instantiation matrix.
  const int64_t rows = recurrent_prefetch_rows(p.prefetch_eighths, p.sms, warp_min_blocks<RK, T>(),
                                                p.HV * p.value_tiles, p.N);
  if (T::kAllBf16 && p.task_grid && rows > 0) {
    RecurrentParams q = p;
    q.prefetch_rows = rows;
    const dim3 grid(static_cast<unsigned>(p.value_tiles + 1), static_cast<unsigned>(p.HV),
                    static_cast<unsigned>(p.N));
    return recurrent_warp_kernel<KB, RK, T, S, T::kAllBf16><<<grid, 32, 0, stream>>>(q);
  }
  const dim3 grid = p.task_grid ? dim3(static_cast<unsigned>(p.value_tiles),
                                       static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N))
                                : dim3(static_cast<unsigned>(tasks < INT_MAX ? tasks : INT_MAX));
  recurrent_warp_kernel<KB, RK, T, S, false><<<grid, 32, 0, stream>>>(p);
}

template <class T, class S>
void launch_for_k(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N * p.HV * p.value_tiles == 0) return;
  switch (p.K) {
    case 32: return launch_kernel<32, 4, T, S>(p, stream);
    case 64: return launch_kernel<64, 4, T, S>(p, stream);
    case 128:
      if (p.warp_keys == 8) return launch_kernel<128, 8, T, S>(p, stream);
      return launch_kernel<128, 4, T, S>(p, stream);
    default: return launch_kernel<256, 8, T, S>(p, stream);
  }
}

template <class S>
void launch_for_tokens(const RecurrentParams& p, cudaStream_t stream) {
  if (all_bf16_tokens(p))
    launch_for_k<TokenTypes<true>, S>(p, stream);
  else
    launch_for_k<TokenTypes<false>, S>(p, stream);
}

}  // namespace

int64_t recurrent_warp_columns(int64_t K, int keys_per_lane) {
  const bool eight = keys_per_lane == 8;
  switch (K) {
    case 32: return eight ? 0 : WarpTile<32, 4>::CW;
    case 64: return eight ? 0 : WarpTile<64, 4>::CW;
    case 128: return eight ? WarpTile<128, 8>::CW : WarpTile<128, 4>::CW;
    case 256: return eight ? WarpTile<256, 8>::CW : 0;
    default: return 0;
  }
}

void launch_recurrent_warp(const RecurrentParams& p, DType state_dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (state_dtype == DType::bf16)
    launch_for_tokens<__nv_bfloat16>(p, s);
  else
    launch_for_tokens<float>(p, s);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(ErrorCode::runtime, std::string("CUDA recurrent warp kernel launch failed: ") +
                                        cudaGetErrorString(err));
}

}  // namespace flashdelta::detail::cuda
