// The CUDA recurrent schedule's warp kernel, for few sequences on a V-first state: one warp
// per task of (sequence, value head, CW value columns), its K x CW state tile in registers,
// and no shared memory and no barrier at all. Every lane loads and transforms the token
// inputs of its own keys, and the sums over keys (the norms, k^T S' and q^T S') are
// shuffles. The block kernel (cuda/recurrent_kernel.cu) stages a token once per 4 warps
// behind a barrier; where its blocks are too few to fill the GPU, that barrier and the
// shared-memory passes are the step's latency, and a one-token step of 32 heads is latency
// only (2 MiB each way is ~1 us of bandwidth). Here the tasks are 4 columns (2 KB of fp32
// state at K = 128) and each lane's chain is 16 values long.
//
// The host (cuda/recurrent.cpp) sends it the problems whose tasks fit in one wave, and only
// the common case: a key-contiguous (V-first) state, so that a warp's load is one 512-byte
// column (on a K-first state its rows would be 16-byte segments: measured at 35-48% of the
// copy bandwidth against 67-78% V-first, bench/NOTES.md (ae)); K a power of two in [32, 256]
// (no key masking); V a multiple of CW (no column masking); states that allow aligned vector
// runs; token tensors of float32 or 16-bit with unit channel stride, aligned. The math is
// the block kernel's: with S' = Diag(exp g) S and r = beta (v - S'^T k),
//     S'' = S' + k r^T,    o = S''^T q = S'^T q + (q . k) r.
#include <climits>
#include <string>

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
#include "cuda/recurrent_task.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Lane geometry for head size KB: a lane owns RK keys x 4 adjacent columns, KL key lanes x
// CL column lanes make the warp. The keys come in RK / 4 runs of 4 with the key lanes' runs
// adjacent, so that a warp's load is KL x 16 contiguous bytes of each column.
template <int KB>
struct WarpTile {
  static constexpr int RK = KB >= 256 ? 8 : 4;  // 16 state values per lane (32 at K = 256)
  static constexpr int KL = KB / RK;
  static constexpr int CL = 32 / KL;
  static constexpr int CW = CL * 4;
  static_assert(KL * CL == 32 && KL >= 1 && KL <= 32, "a warp of key x column lanes");
  // Blocks of one warp per SM the register budget is sized for, without spills (80
  // registers at K = 128, 96 at K = 32 and 64, 128 at K = 256).
  static constexpr int kMinBlocks = KB == 128 ? 24 : KB < 128 ? 20 : 16;

  int key_lane, column;  // column: first of the lane's 4, within the task's CW
  __device__ WarpTile() {
    const int lane = threadIdx.x % 32;
    key_lane = lane % KL;
    column = lane / KL * 4;
  }
  // Key r of the lane's RK: run r / 4, element r % 4.
  __device__ int key(int r) const { return (r / 4) * (KL * 4) + key_lane * 4 + r % 4; }
};

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
__device__ __forceinline__ Run4 load_run4(const TokenTensor& x, int64_t off) {
  return load_run4(x.data, x.dtype, off);
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

// Stores four consecutive channels of a token tensor (unit channel stride, aligned).
__device__ __forceinline__ void store_run4(const TokenTensor& x, int64_t off, const float (&in)[4]) {
  void* base = const_cast<void*>(x.data);
  if (x.dtype == DType::f32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + off) = make_float4(in[0], in[1], in[2], in[3]);
    return;
  }
  uint32_t w[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) w[e] = pack_16bit(x.dtype, in[2 * e], in[2 * e + 1]);
  *reinterpret_cast<uint2*>(static_cast<unsigned short*>(base) + off) = make_uint2(w[0], w[1]);
}

// One token's inputs for one lane, as raw bits: q, k and g over its RK keys, v over its 4
// columns, the scalar gate and beta.
template <int RK>
struct LaneToken {
  Run4 q[RK / 4], k[RK / 4], g[RK / 4], bias[RK / 4], v;
  uint32_t scalar_g, scalar_bias, beta;
};

// The gate's bias (dt_bias) is loaded with every token, like the block kernel: an L1 hit
// after the first, and no registers held across tokens.
template <class W>
__device__ void fetch_lane_token(const RecurrentParams& p, const RowOffsets& row, int64_t t,
                                 int64_t hv, int col, const W& tile, LaneToken<W::RK>& raw) {
  const bool bias = p.gate_in_kernel && p.dt_bias;
  const int64_t oq = row.q + t * p.q.stride[1], ok = row.k + t * p.k.stride[1];
  const int64_t og = row.g + t * p.g.stride[1];
  raw.v = load_run4(p.v, row.v + t * p.v.stride[1] + col);
#pragma unroll
  for (int g = 0; g < W::RK / 4; ++g) {
    const int i = tile.key(4 * g);
    raw.q[g] = load_run4(p.q, oq + i);
    raw.k[g] = load_run4(p.k, ok + i);
    if (p.gate == GateForm::vector) {
      raw.g[g] = load_run4(p.g, og + i);
      if (bias) raw.bias[g] = load_run4(p.dt_bias, p.dt_bias_dtype, hv * p.dt_bias_head_stride + i);
    }
  }
  if (p.gate == GateForm::scalar) {
    raw.scalar_g = load_raw(p.g.data, p.g.dtype, og);
    if (bias) raw.scalar_bias = load_raw(p.dt_bias, p.dt_bias_dtype, hv * p.dt_bias_head_stride);
  }
  if (p.delta) raw.beta = load_raw(p.beta.data, p.beta.dtype, row.beta + t * p.beta.stride[1]);
}

// One token's inputs transformed, for one lane: q (normalised and scaled) and k
// (normalised) over its keys, their decays exp(g), v over its columns, q . k and beta.
template <int RK>
struct LaneInputs {
  float q[RK], k[RK], d[RK], v[4];
  float qk, beta;
};

template <class W>
__device__ void transform_lane_token(const RecurrentParams& p, const LaneToken<W::RK>& raw,
                                     float a, LaneInputs<W::RK>& in) {
  const bool bias = p.gate_in_kernel && p.dt_bias;
  constexpr int RK = W::RK;
  run4_to_float(raw.v, p.v.dtype, in.v);
#pragma unroll
  for (int g = 0; g < RK / 4; ++g) {
    run4_to_float(raw.q[g], p.q.dtype, in.q + 4 * g);
    run4_to_float(raw.k[g], p.k.dtype, in.k + 4 * g);
  }
  if (p.gate == GateForm::vector) {
    float gx[RK];
#pragma unroll
    for (int g = 0; g < RK / 4; ++g) run4_to_float(raw.g[g], p.g.dtype, gx + 4 * g);
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
      float gx = raw_to_float(raw.scalar_g, p.g.dtype);
      if (bias) gx += raw_to_float(raw.scalar_bias, p.dt_bias_dtype);
      if (p.gate_in_kernel) gx = activate_gate(p, gx, a);
      d = expf(gx);
    }
#pragma unroll
    for (int r = 0; r < RK; ++r) in.d[r] = d;
  }
  in.beta = p.delta ? activate_beta(p, raw_to_float(raw.beta, p.beta.dtype)) : 1.f;

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

// Element offset of the lane's chunk c from the tile base: chunk 4 g + e holds keys
// key(4 g)..+3 of column e.
template <class W>
__device__ __forceinline__ int64_t chunk_offset(const StateTensor& st, const W& tile, int col,
                                                int c) {
  return (col + c % 4) * st.value_stride + tile.key(4 * (c / 4));
}

__device__ __forceinline__ void load_state_run(const float* p, float (&x)[4]) {
  const float4 v = __ldcs(reinterpret_cast<const float4*>(p));
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load_state_run(const __nv_bfloat16* p, float (&x)[4]) {
  const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
  x[0] = __uint_as_float(v.x << 16), x[1] = __uint_as_float(v.x & 0xffff0000u);
  x[2] = __uint_as_float(v.y << 16), x[3] = __uint_as_float(v.y & 0xffff0000u);
}

template <int KB, class S>
__device__ void run_warp_task(const RecurrentParams& p, const WarpTile<KB>& tile,
                              const Task& w) {
  using W = WarpTile<KB>;
  constexpr int RK = W::RK;
  const int64_t n = w.n, hv = w.hv,
                h = p.group <= INT_MAX ? w.hv / static_cast<int>(p.group) : hv / p.group;
  const Sequence seq = sequence_of(p, n);
  const RowOffsets row = row_offsets(p, seq, h, hv);
  const int col = w.j0 + tile.column;
  const int lane = threadIdx.x % 32;

  // Token 0's loads go out before the slot index is back (a padding row's are unused), and
  // its transform runs while the state loads are in flight: at one token per task the
  // index -> state chain is then the step's only exposed latency.
  LaneToken<RK> raw;
  if (seq.len > 0) fetch_lane_token(p, row, 0, hv, col, tile, raw);
  const float a = p.A_log ? expf(load_float(p.A_log, p.A_log_dtype, hv * p.A_log_stride)) : 1.f;

  if (w.start < 0) {  // padding row: zeros out, no state touched
    for (int64_t e = lane; e < seq.len * W::CW; e += 32)
      store_float(const_cast<void*>(p.o.data), p.o.dtype,
                  row.o + (e / W::CW) * p.o.stride[1] + (w.j0 + e % W::CW) * p.o.stride[3], 0.f);
    return;
  }
  if (p.serving && !p.per_token_slots && seq.len == 0) return;  // nothing to update

  float x[RK][4];
  if (p.state_in.data) {
    const S* src = tile_base<const S>(p.state_in, w.start, hv);
#pragma unroll
    for (int c = 0; c < RK; ++c) load_state_run(src + chunk_offset(p.state_in, tile, col, c), x[c]);
  } else {
#pragma unroll
    for (int c = 0; c < RK; ++c)
#pragma unroll
      for (int m = 0; m < 4; ++m) x[c][m] = 0.f;
  }
  LaneInputs<RK> in;
  if (seq.len > 0) transform_lane_token<W>(p, raw, a, in);

  for (int64_t t = 0; t < seq.len; ++t) {
    // A later token's loads are not issued early: their registers would hold through the
    // passes (decode is one token; a speculative step a few).
    if (t > 0) {
      fetch_lane_token(p, row, t, hv, col, tile, raw);
      transform_lane_token<W>(p, raw, a, in);
    }

    // Decay, then the lane's partial column sums k^T S' and q^T S', summed over key lanes.
    float pred[4] = {0.f, 0.f, 0.f, 0.f}, out[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < RK; ++c)
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int r = 4 * (c / 4) + m, e = c % 4;  // key r of the lane's, column e
        x[c][m] *= in.d[r];
        pred[e] = fmaf(in.k[r], x[c][m], pred[e]);
        out[e] = fmaf(in.q[r], x[c][m], out[e]);
      }
    float r_col[4], o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pred[e] = lane_sum<1, W::KL / 2>(pred[e]);
      out[e] = lane_sum<1, W::KL / 2>(out[e]);
      r_col[e] = p.delta ? in.beta * (in.v[e] - pred[e]) : in.v[e];
      o[e] = fmaf(in.qk, r_col[e], out[e]);
    }
    if (tile.key_lane == 0) store_run4(p.o, row.o + t * p.o.stride[1] + col, o);

    // S'' = S' + k r^T, kept for the next token and written to its slot, if any.
    const int64_t slot = slot_after(p, n, t, seq.len, w.start);
    S* const dst = slot >= 0 ? tile_base<S>(p.state_out, slot, hv) : nullptr;
#pragma unroll
    for (int c = 0; c < RK; ++c) {
#pragma unroll
      for (int m = 0; m < 4; ++m)
        x[c][m] = fmaf(in.k[4 * (c / 4) + m], r_col[c % 4], x[c][m]);
      if (dst) store_run<4>(dst + chunk_offset(p.state_out, tile, col, c), 1, 4, true, x[c]);
    }
  }
  if (!p.serving && seq.len == 0 && p.state_out.data) {  // empty sequence: state passes through
    S* const dst = tile_base<S>(p.state_out, n, hv);
#pragma unroll
    for (int c = 0; c < RK; ++c)
      store_run<4>(dst + chunk_offset(p.state_out, tile, col, c), 1, 4, true, x[c]);
  }
}

// Blocks of one warp (a grid-stride loop only past 2^31 - 1 tasks).
template <int KB, class S>
__global__ void __launch_bounds__(32, WarpTile<KB>::kMinBlocks)
    recurrent_warp_kernel(const __grid_constant__ RecurrentParams p) {
  using W = WarpTile<KB>;
  const W tile;
  const int64_t tasks = p.N * p.HV * p.value_tiles;
  for (int64_t blk = blockIdx.x; blk < tasks; blk += gridDim.x)
    run_warp_task<KB, S>(p, tile, task_of<W::CW>(p, blk, tasks));
}

template <class S>
void launch_for_k(const RecurrentParams& p, cudaStream_t stream) {
  const int64_t tasks = p.N * p.HV * p.value_tiles;
  if (tasks == 0) return;
  const unsigned grid = static_cast<unsigned>(tasks < INT_MAX ? tasks : INT_MAX);
  switch (p.K) {
    case 32: return recurrent_warp_kernel<32, S><<<grid, 32, 0, stream>>>(p);
    case 64: return recurrent_warp_kernel<64, S><<<grid, 32, 0, stream>>>(p);
    case 128: return recurrent_warp_kernel<128, S><<<grid, 32, 0, stream>>>(p);
    default: return recurrent_warp_kernel<256, S><<<grid, 32, 0, stream>>>(p);
  }
}

}  // namespace

int64_t recurrent_warp_columns(int64_t K) {
  switch (K) {
    case 32: return WarpTile<32>::CW;
    case 64: return WarpTile<64>::CW;
    case 128: return WarpTile<128>::CW;
    case 256: return WarpTile<256>::CW;
    default: return 0;
  }
}

int64_t recurrent_warp_blocks_per_sm(int64_t K) {
  switch (K) {
    case 32: return WarpTile<32>::kMinBlocks;
    case 64: return WarpTile<64>::kMinBlocks;
    case 128: return WarpTile<128>::kMinBlocks;
    default: return WarpTile<256>::kMinBlocks;
  }
}

void launch_recurrent_warp(const RecurrentParams& p, DType state_dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (state_dtype == DType::bf16)
    launch_for_k<__nv_bfloat16>(p, s);
  else
    launch_for_k<float>(p, s);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(ErrorCode::runtime, std::string("CUDA recurrent warp kernel launch failed: ") +
                                        cudaGetErrorString(err));
}

}  // namespace flashdelta::detail::cuda
