// The per-token stages of the CUDA backward (cuda/backward_params.h): the fused input
// transforms forward and d_o in float32 (inputs), the transforms' derivatives with the GVA
// sums (outputs), and the fixed-order sums of the gate parameters' gradients over all tokens
// (params).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/backward_common.cuh"
#include "cuda/backward_gate.cuh"
#include "cuda/backward_rows.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kWarps = kBackwardThreads / 32;

// The rows of a per-token stage: key items (row, key head) and value items (row, value head),
// each kind padded to whole warps' worth of rows, so that the rows of a warp are of one kind
// (their lane sums run together); a padding row is inactive: it reads and writes nothing.
// The outputs stage (`outputs`) takes only what grads left: no key rows where grads finished
// them, no value rows where it finished the gate's gradient too (or there is no gate).
struct RowSlots {
  int64_t key_items, value_items, key_slots, slots;
  __host__ __device__ RowSlots(const BackwardParams& b, int rows_per_warp, bool outputs) {
    const int64_t rows = b.B * b.p.T, r = rows_per_warp;
    const bool rows_done = outputs && b.rows_in_grads;
    const bool gate_done = b.gate_in_grads || b.p.gate == GateForm::none;
    key_items = rows_done ? 0 : rows * b.H;
    value_items = rows_done && gate_done ? 0 : rows * b.p.HV;
    key_slots = (key_items + r - 1) / r * r;
    slots = key_slots + (value_items + r - 1) / r * r;
  }
};

// body(is_key, item, active) for each of this lane's slots, grid-stride over warps.
template <bool kOutputs, class Body>
__device__ void over_rows(const BackwardParams& b, const RowLanes& rl, const Body& body) {
  const RowSlots rs(b, rl.rows(), kOutputs);
  const int64_t r = rl.rows();
  for (int64_t w = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; w * r < rs.slots;
       w += int64_t{gridDim.x} * kWarps) {
    const int64_t slot = w * r + rl.sub;
    if (w * r < rs.key_slots)
      body(true, slot, slot < rs.key_items);
    else
      body(false, slot - rs.key_slots, slot - rs.key_slots < rs.value_items);
  }
}

// The lane's run of a token tensor at element offset `off` (its first channel) as floats.
__device__ __forceinline__ void load_token8(const TokenTensor& x, int64_t off, int valid,
                                            float (&v)[8]) {
  if (valid > 0) return run8_to_float(load_run8(x, off, valid), x.dtype, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = 0.f;
}

// x / d and x % d, in 32-bit arithmetic when both fit (a 64-bit division is a long call).
__device__ __forceinline__ void split_index(int64_t x, int64_t d, int64_t& q, int64_t& r) {
  if (x <= INT32_MAX && d <= INT32_MAX) {
    const uint32_t ux = static_cast<uint32_t>(x), ud = static_cast<uint32_t>(d), uq = ux / ud;
    q = uq, r = ux - uq * ud;
  } else {
    q = x / d, r = x - q * d;
  }
}

// token_row_offset without 64-bit divisions where the row index fits in 32 bits.
__device__ __forceinline__ int64_t row_offset(const TokenTensor& x, int64_t row, int64_t T,
                                              int64_t head) {
  int64_t b, t;
  split_index(row, T, b, t);
  return b * x.stride[0] + t * x.stride[1] + head * x.stride[2];
}

// The raw gate pre-activations of `valid` channels from channel c0 (at most 8; 1 for a
// scalar gate), dt_bias added when the gate is activated here.
__device__ __forceinline__ void raw_gates(const RecurrentParams& p, int64_t row, int64_t hv,
                                          int c0, int valid, float (&x)[8]) {
  load_token8(p.g, row_offset(p.g, row, p.T, hv) + c0 * p.g.stride[3], valid, x);
  if (p.gate_in_kernel && p.dt_bias)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < valid) x[e] += gate_bias(p, hv, c0 + e);
}

// q or k of key head h at token row `row`, normalised (and scaled for q).
__device__ void transform_key_row(const RecurrentParams& p, const RowLanes& rl, bool active,
                                  const TokenTensor& x, float scale, int64_t row, int64_t h,
                                  float* out) {
  const int c0 = rl.c0, valid = active ? clamp_run(p.K - c0) : 0;
  float v[8], ss = 0.f;
  load_token8(x, row_offset(x, row, p.T, h) + c0 * x.stride[3], valid, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
  ss = rl.sum(ss);
  const float f = p.qk_l2norm ? scale * rsqrtf(ss + kL2NormEps) : scale;
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] *= f;
  if (valid > 0) store_floats8(out + c0, valid, v);
}

__global__ void __launch_bounds__(kBackwardThreads) inputs_kernel(const BackwardParams b) {
  const RecurrentParams& p = b.p;
  const RowLanes rl(p);
  const int c0 = rl.c0;
  over_rows<false>(b, rl, [&](bool is_key, int64_t item, bool active) {
    if (is_key) {
      int64_t row, h;
      split_index(item, b.H, row, h);
      transform_key_row(p, rl, active, p.q, p.scale, row, h, b.ws.qn + item * p.K);
      transform_key_row(p, rl, active, p.k, 1.f, row, h, b.ws.kn + item * p.K);
      return;
    }
    if (!active) return;  // nothing below sums over lanes
    const int64_t vi = item;
    int64_t row, hv;
    split_index(vi, p.HV, row, hv);
    const int kvalid = clamp_run(p.K - c0);
    float gate[8];
    const float a = p.gate_in_kernel ? gate_scale(p, hv) : 1.f;
    if (p.gate == GateForm::scalar) {
      float g[8];
      raw_gates(p, row, hv, 0, 1, g);  // every lane: one channel of the shared scalar
      const float x = fmaxf(activated_gate(p, g[0], a), kMinGate);
#pragma unroll
      for (int e = 0; e < 8; ++e) gate[e] = x;
    } else if (p.gate == GateForm::vector) {
      raw_gates(p, row, hv, c0, kvalid, gate);
#pragma unroll
      for (int e = 0; e < 8; ++e) gate[e] = fmaxf(activated_gate(p, gate[e], a), kMinGate);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) gate[e] = 0.f;
    }
    if (kvalid > 0) store_floats8(b.ws.gate + vi * p.K + c0, kvalid, gate);
    const int vvalid = clamp_run(p.V - c0);
    if (vvalid > 0) {
      float d[8];
      load_token8(b.d_o, row_offset(b.d_o, row, p.T, hv) + c0 * b.d_o.stride[3], vvalid, d);
      store_floats8(b.ws.dout + vi * p.V + c0, vvalid, d);
    }
    if (rl.leader())
      b.ws.beta[vi] = p.delta ? activate_beta(p, load_float(p.beta.data, p.beta.dtype,
                                                            row_offset(p.beta, row, p.T, hv)))
                              : 1.f;
  });
}

// The float32 workspace runs a lane reads (two of 8 floats per row), staged in shared memory
// by cp.async: copies hold no registers while in flight, so a lane has all of a row's loads
// out at once. Before, a row's second gradient waited for the first one's stores (a load
// cannot move above a store that may alias it): two memory latencies per row; holding every
// load in registers instead took the kernel past 100 registers and halved its warps.
struct RunStage {
  float4 quads[4][kBackwardThreads];  // run r's half e at quads[2 r + e][thread]: no conflicts

  // Channels [0, valid) of 8 floats at src (zeros for the rest); lands at wait_async.
  __device__ void copy_async_run(int r, const float* src, int valid) {
    float4* dst[2] = {&quads[2 * r][threadIdx.x], &quads[2 * r + 1][threadIdx.x]};
    if (valid == 8 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      copy_async<16>(dst[0], src, 16);
      copy_async<16>(dst[1], src + 4, 16);
      return;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float* d = reinterpret_cast<float*>(dst[e / 4]) + e % 4;
      if (e < valid)
        copy_async<4>(d, src + e, 4);
      else
        *d = 0.f;
    }
  }
  __device__ void read(int r, float (&v)[8]) const {
    const float4 a = quads[2 * r][threadIdx.x], b = quads[2 * r + 1][threadIdx.x];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
};

// dq and dk of key head h at one token row: the sums over the key head's value heads, then
// finish_key_grad. q, k and the first value head's rows of both are all in flight at once.
__device__ void key_grads_row(const BackwardParams& b, const RowLanes& rl, bool active,
                              int64_t row, int64_t h, RunStage& st) {
  const RecurrentParams& p = b.p;
  const int c0 = rl.c0, valid = active ? clamp_run(p.K - c0) : 0;
  const bool want_q = b.dq.data && valid > 0, want_k = b.dk.data && valid > 0;
  Run8 rq{}, rk{};
  if (p.qk_l2norm && want_q) rq = load_run8(p.q, row_offset(p.q, row, p.T, h) + c0 * p.q.stride[3], valid);
  if (p.qk_l2norm && want_k) rk = load_run8(p.k, row_offset(p.k, row, p.T, h) + c0 * p.k.stride[3], valid);
  float yq[8] = {}, yk[8] = {};
  for (int64_t gi = 0; gi < p.group; ++gi) {
    const int64_t at = (row * p.HV + h * p.group + gi) * p.K + c0;
    st.copy_async_run(0, b.ws.dq + at, want_q ? valid : 0);
    st.copy_async_run(1, b.ws.dk + at, want_k ? valid : 0);
    commit_async();
    wait_async<0>();
    float g[8];
    st.read(0, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) yq[e] += g[e];
    st.read(1, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) yk[e] += g[e];
  }
  finish_key_grad(p, rl, rq, p.q.dtype, b.dq, row_offset(b.dq, row, p.T, h) + c0 * b.dq.stride[3],
                  p.scale, valid, want_q, yq);
  finish_key_grad(p, rl, rk, p.k.dtype, b.dk, row_offset(b.dk, row, p.T, h) + c0 * b.dk.stride[3],
                  1.f, valid, want_k, yk);
}

// dv, dbeta and the gate gradient (unless grads took it) of value head hv at one token row,
// with every load of the row out before anything is stored (RunStage). The workspace holds
// d(beta v): dv is beta times it, and d beta gains its product with v, summed over the row
// here (with the delta rule; the linear rules' beta is 1). ws.dg keeps the raw gate's
// gradient only for ddt_bias (params), the one stage that reads it again.
// An inactive row (padding) reads and writes nothing but joins its warp's lane sums.
__device__ void value_grads_row(const BackwardParams& b, const RowLanes& rl, bool active,
                                int64_t row, int64_t hv, RunStage& st) {
  const RecurrentParams& p = b.p;
  const int c0 = rl.c0;
  const int64_t vi = row * p.HV + hv;
  // dv and d beta, unless grads finished them (BackwardParams::rows_in_grads).
  const bool rows_left = !b.rows_in_grads;
  const bool v_dot = rows_left && p.delta && b.dbeta.data;  // the same in every lane
  const int vvalid = active && rows_left && (b.dv.data || v_dot) ? clamp_run(p.V - c0) : 0;
  // The gate's gradient, unless grads finished it (BackwardParams::gate_in_grads); a scalar
  // gate's short form left the row's whole in channel 0 (scalar_pairs), the general form's
  // channels are summed here.
  const bool scalar = p.gate == GateForm::scalar;
  const bool gated = p.gate != GateForm::none && !b.gate_in_grads;
  const bool summed = scalar && b.scalar_pairs;
  const int kvalid = !active || !gated ? 0 : summed ? (rl.leader() ? 1 : 0) : clamp_run(p.K - c0);
  // A scalar gate feeds every channel: its gradient is the sum of theirs, taken by lane 0.
  const int valid = scalar ? (rl.leader() && active ? 1 : 0) : kvalid;
  const bool beta_lane = rows_left && b.dbeta.data && rl.leader() && active;
  float* const dgate = b.ws.dg + vi * p.K;
  st.copy_async_run(0, b.ws.dv + vi * p.V + c0, vvalid);
  st.copy_async_run(1, dgate + c0, kvalid);
  commit_async();
  Run8 vraw{};
  if (v_dot && vvalid > 0)
    vraw = load_run8(p.v, row_offset(p.v, row, p.T, hv) + c0 * p.v.stride[3], vvalid);
  const float beta = active && rows_left ? b.ws.beta[vi] : 0.f;
  float x[8] = {}, dbeta = 0.f, raw_beta = 0.f;
  if (gated) raw_gates(p, row, hv, scalar ? 0 : c0, valid, x);
  if (beta_lane) {
    dbeta = b.ws.dbeta[vi];
    if (p.beta_sigmoid)
      raw_beta = load_float(p.beta.data, p.beta.dtype, row_offset(p.beta, row, p.T, hv));
  }
  wait_async<0>();

  if (rows_left) {
    float d[8];
    st.read(0, d);
    finish_value_row(b, rl, d, vraw, vvalid, beta,
                     row_offset(b.dv, row, p.T, hv) + c0 * b.dv.stride[3], v_dot, beta_lane,
                     dbeta, raw_beta, beta_lane ? row_offset(b.dbeta, row, p.T, hv) : 0);
  }
  if (!gated) return;
  float d[8];
  st.read(1, d);
  if (scalar) {
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += d[e];
    d[0] = rl.sum(sum);
  }
  const float a = gate_scale(p, hv);
  float dA = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const GateGrad gg = gate_grad(p, x[e], a, e < valid ? d[e] : 0.f);
    dA += gg.A_log;
    d[e] = gg.raw;
  }
  if (valid > 0) {
    if (b.ddt_bias.data) store_floats8(dgate + (scalar ? 0 : c0), valid, d);
    if (b.dg.data)
      store_run8(b.dg, row_offset(b.dg, row, p.T, hv) + (scalar ? 0 : c0 * b.dg.stride[3]),
                 valid, d);
  }
  dA = rl.sum(dA);
  if (rl.leader() && active) b.ws.dA_log_part[vi] = dA;
}

// Four blocks per SM (64 registers): left alone, ptxas takes 128 registers to hoist the
// address arithmetic, and two blocks per SM have fewer loads in flight.
__global__ void __launch_bounds__(kBackwardThreads, 4) outputs_kernel(const BackwardParams b) {
  const RecurrentParams& p = b.p;
  const RowLanes rl(p);
  __shared__ RunStage stage;
  over_rows<true>(b, rl, [&](bool is_key, int64_t item, bool active) {
    if (is_key) {
      int64_t row, h;
      split_index(item, b.H, row, h);
      key_grads_row(b, rl, active, row, h, stage);
    } else {
      int64_t row, hv;
      split_index(item, p.HV, row, hv);
      value_grads_row(b, rl, active, row, hv, stage);
    }
  });
}

// One block per output element: ddt_bias (hv, i) for i < width, then dA_log (hv). Threads
// sum strided rows in order and a fixed tree adds their sums.
__global__ void __launch_bounds__(kBackwardThreads) params_kernel(const BackwardParams b,
                                                                  int width) {
  const RecurrentParams& p = b.p;
  const int64_t hv = blockIdx.x / (width + 1);
  const int i = static_cast<int>(blockIdx.x % (width + 1));
  const bool is_A = i == width;
  const HeadParam& out = is_A ? b.dA_log : b.ddt_bias;
  if (!out.data) return;
  const int64_t rows = b.B * p.T;
  float sum = 0.f;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    sum += is_A ? b.ws.dA_log_part[r * p.HV + hv] : b.ws.dg[(r * p.HV + hv) * p.K + i];
  __shared__ float partial[kBackwardThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kBackwardThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    store_float(out.data, out.dtype, hv * out.head_stride + (is_A ? 0 : i) * out.key_stride,
                partial[0]);
}

int item_blocks(const BackwardParams& b, bool outputs) {
  const int rows = rows_per_warp(b.p);
  const int64_t warps = RowSlots(b, rows, outputs).slots / rows;
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  return static_cast<int>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

}  // namespace

void launch_backward_inputs(const BackwardParams& b, void* stream) {
  if (b.B * b.p.T == 0) return;
  inputs_kernel<<<item_blocks(b, false), kBackwardThreads, 0,
                  static_cast<cudaStream_t>(stream)>>>(b);
}

void launch_backward_outputs(const BackwardParams& b, void* stream) {
  const int blocks = item_blocks(b, true);
  if (blocks == 0) return;  // no tokens, or grads finished every gradient
  outputs_kernel<<<blocks, kBackwardThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
}

void launch_backward_params(const BackwardParams& b, void* stream) {
  if (b.p.gate == GateForm::none || (!b.dA_log.data && !b.ddt_bias.data)) return;
  const int width = b.p.gate == GateForm::vector ? static_cast<int>(b.p.K) : 1;
  params_kernel<<<static_cast<unsigned>(b.p.HV * (width + 1)), kBackwardThreads, 0,
                  static_cast<cudaStream_t>(stream)>>>(b, width);
}

}  // namespace flashdelta::detail::cuda
