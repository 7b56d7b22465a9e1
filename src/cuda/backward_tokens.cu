// The per-token stages of the CUDA backward (cuda/backward_params.h): the fused input
// transforms forward and d_o in float32 (inputs), the transforms' derivatives with the GVA
// sums (outputs), and the fixed-order sums of the gate parameters' gradients over all tokens
// (params).
#include <cuda_runtime.h>

#include "cuda/backward_common.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Decays below e^-128 are 0 in float32 (its smallest denormal is e^-103.3); flooring the
// gate there keeps Gamma finite for gates of -inf, so differences of Gamma never give NaN.
constexpr float kMinGate = -128.f;
constexpr int kWarps = kBackwardThreads / 32;

__device__ __forceinline__ float sigmoid_exact(float x) { return 1.f / (1.f + expf(-x)); }

// exp(A_log[hv]) or 1 without A_log.
__device__ __forceinline__ float gate_scale(const RecurrentParams& p, int64_t hv) {
  return p.A_log ? expf(load_float(p.A_log, p.A_log_dtype, hv * p.A_log_stride)) : 1.f;
}

// The raw gate pre-activation of channel i (dt_bias added when the gate is activated here).
__device__ __forceinline__ float raw_gate(const RecurrentParams& p, int64_t row, int64_t hv,
                                          int i) {
  const int64_t off = token_row_offset(p.g, row, p.T, hv) +
                      (p.gate == GateForm::vector ? i * p.g.stride[3] : 0);
  float x = load_float(p.g.data, p.g.dtype, off);
  if (p.gate_in_kernel && p.dt_bias)
    x += load_float(p.dt_bias, p.dt_bias_dtype,
                    hv * p.dt_bias_head_stride + i * p.dt_bias_key_stride);
  return x;
}

__device__ __forceinline__ float activated_gate(const RecurrentParams& p, float x, float a) {
  return p.gate_in_kernel ? activate_gate(p, x, a) : x;
}

// q or k of key head h at token row `row`, normalised (and scaled for q).
__device__ void transform_key_row(const RecurrentParams& p, const TokenTensor& x, float scale,
                                  int64_t row, int64_t h, float* out) {
  const int lane = threadIdx.x % 32;
  const int64_t base = token_row_offset(x, row, p.T, h);
  float v[8], ss = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = lane + 32 * e;
    v[e] = c < p.K ? load_float(x.data, x.dtype, base + c * x.stride[3]) : 0.f;
    ss += v[e] * v[e];
  }
  ss = lane_sum<1, 16>(ss);
  const float f = p.qk_l2norm ? scale * rsqrtf(ss + kL2NormEps) : scale;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (lane + 32 * e < p.K) out[lane + 32 * e] = v[e] * f;
}

__global__ void __launch_bounds__(kBackwardThreads) inputs_kernel(const BackwardParams b) {
  const RecurrentParams& p = b.p;
  const int64_t rows = b.B * p.T, key_items = rows * b.H, items = key_items + rows * p.HV;
  const int lane = threadIdx.x % 32;
  for (int64_t item = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; item < items;
       item += int64_t{gridDim.x} * kWarps) {
    if (item < key_items) {
      const int64_t row = item / b.H, h = item % b.H;
      transform_key_row(p, p.q, p.scale, row, h, b.ws.qn + item * p.K);
      transform_key_row(p, p.k, 1.f, row, h, b.ws.kn + item * p.K);
      continue;
    }
    const int64_t vi = item - key_items, row = vi / p.HV, hv = vi % p.HV;
    float* gate = b.ws.gate + vi * p.K;
    const float a = p.gate_in_kernel ? gate_scale(p, hv) : 1.f;
    if (p.gate == GateForm::scalar) {
      const float g = fmaxf(activated_gate(p, raw_gate(p, row, hv, 0), a), kMinGate);
      for (int c = lane; c < p.K; c += 32) gate[c] = g;
    } else {
      for (int c = lane; c < p.K; c += 32)
        gate[c] = p.gate == GateForm::vector
                      ? fmaxf(activated_gate(p, raw_gate(p, row, hv, c), a), kMinGate)
                      : 0.f;
    }
    const int64_t d_o = token_row_offset(b.d_o, row, p.T, hv);
    for (int j = lane; j < p.V; j += 32)
      b.ws.dout[vi * p.V + j] = load_float(b.d_o.data, b.d_o.dtype, d_o + j * b.d_o.stride[3]);
    if (lane == 0)
      b.ws.beta[vi] = p.delta ? activate_beta(p, load_float(p.beta.data, p.beta.dtype,
                                                            token_row_offset(p.beta, row, p.T, hv)))
                              : 1.f;
  }
}

// dq or dk of key head h: the sum over its value heads, scaled, through the L2 norm.
__device__ void key_grad_row(const BackwardParams& b, const TokenTensor& x, const TokenTensor& dx,
                             const float* grads, float scale, int64_t row, int64_t h) {
  const RecurrentParams& p = b.p;
  const int lane = threadIdx.x % 32;
  float y[8], xs[8], ss = 0.f;
  const int64_t base = token_row_offset(x, row, p.T, h);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = lane + 32 * e;
    y[e] = 0.f;
    xs[e] = 0.f;
    if (c >= p.K) continue;
    for (int64_t gi = 0; gi < p.group; ++gi)
      y[e] += grads[(row * p.HV + h * p.group + gi) * p.K + c];
    y[e] *= scale;
    xs[e] = load_float(x.data, x.dtype, base + c * x.stride[3]);
    ss += xs[e] * xs[e];
  }
  if (p.qk_l2norm) {
    // y = x / n, n = sqrt(sum x^2 + eps): dx = (dy - y (y . dy)) / n.
    const float inv = rsqrtf(lane_sum<1, 16>(ss) + kL2NormEps);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += xs[e] * inv * y[e];
    dot = lane_sum<1, 16>(dot);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = (y[e] - xs[e] * inv * dot) * inv;
  }
  const int64_t out = token_row_offset(dx, row, p.T, h);
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (lane + 32 * e < p.K) store_float(const_cast<void*>(dx.data), dx.dtype,
                                         out + (lane + 32 * e) * dx.stride[3], y[e]);
}

// d gate / d raw and d gate / d A_log of one channel (the reference's gate_derivative).
struct GateSlopes {
  float raw, A_log;
};

__device__ GateSlopes gate_slopes(const RecurrentParams& p, float x, float a) {
  if (!p.gate_in_kernel) return {1.f, 0.f};
  const bool has_a = p.A_log != nullptr;
  if (p.has_lower_bound) {
    const float z = has_a ? a * x : x;
    const float dz = p.lower_bound * sigmoid_exact(z) * sigmoid_exact(-z);
    return has_a ? GateSlopes{dz * a, dz * z} : GateSlopes{dz, 0.f};
  }
  return {-a * sigmoid_exact(x), -a * softplusf(x)};
}

// dv, dbeta and the gate gradient of value head hv at one token row.
__device__ void value_grad_row(const BackwardParams& b, int64_t row, int64_t hv) {
  const RecurrentParams& p = b.p;
  const int lane = threadIdx.x % 32;
  const int64_t vi = row * p.HV + hv;
  if (b.dv.data) {
    const int64_t out = token_row_offset(b.dv, row, p.T, hv);
    for (int j = lane; j < p.V; j += 32)
      store_float(const_cast<void*>(b.dv.data), b.dv.dtype, out + j * b.dv.stride[3],
                  b.ws.dv[vi * p.V + j]);
  }
  if (b.dbeta.data && lane == 0) {
    float d = b.ws.dbeta[vi];
    if (p.beta_sigmoid) {
      const int64_t at = token_row_offset(p.beta, row, p.T, hv);
      const float raw = load_float(p.beta.data, p.beta.dtype, at);
      d *= p.beta_factor * sigmoid_exact(raw) * sigmoid_exact(-raw);
    }
    store_float(const_cast<void*>(b.dbeta.data), b.dbeta.dtype,
                token_row_offset(b.dbeta, row, p.T, hv), d);
  }
  if (p.gate == GateForm::none) return;
  float* dgate = b.ws.dg + vi * p.K;
  const float a = gate_scale(p, hv);
  const int width = p.gate == GateForm::vector ? static_cast<int>(p.K) : 1;
  // A scalar gate feeds every channel: its gradient is the sum of theirs.
  float scalar = 0.f;
  if (width == 1) {
    for (int c = lane; c < p.K; c += 32) scalar += dgate[c];
    scalar = lane_sum<1, 16>(scalar);
  }
  float dA = 0.f;
  for (int c = lane; c < width; c += 32) {
    const float x = raw_gate(p, row, hv, c);
    const float g = activated_gate(p, x, a);
    // The floor at kMinGate passes no gradient (the reference's is 0 there too: e^g S = 0).
    const float d = g < kMinGate ? 0.f : width == 1 ? scalar : dgate[c];
    const GateSlopes s = gate_slopes(p, x, a);
    dA += d * s.A_log;
    dgate[c] = d * s.raw;  // kept for ddt_bias (params)
    if (b.dg.data)
      store_float(const_cast<void*>(b.dg.data), b.dg.dtype,
                  token_row_offset(b.dg, row, p.T, hv) + (width == 1 ? 0 : c * b.dg.stride[3]),
                  d * s.raw);
  }
  dA = lane_sum<1, 16>(dA);
  if (lane == 0) b.ws.dA_log_part[vi] = dA;
}

__global__ void __launch_bounds__(kBackwardThreads) outputs_kernel(const BackwardParams b) {
  const RecurrentParams& p = b.p;
  const int64_t rows = b.B * p.T, key_items = rows * b.H, items = key_items + rows * p.HV;
  for (int64_t item = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; item < items;
       item += int64_t{gridDim.x} * kWarps) {
    if (item < key_items) {
      const int64_t row = item / b.H, h = item % b.H;
      if (b.dq.data) key_grad_row(b, p.q, b.dq, b.ws.dq, p.scale, row, h);
      if (b.dk.data) key_grad_row(b, p.k, b.dk, b.ws.dk, 1.f, row, h);
    } else {
      const int64_t vi = item - key_items;
      value_grad_row(b, vi / p.HV, vi % p.HV);
    }
  }
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

int item_blocks(const BackwardParams& b) {
  const int64_t items = b.B * b.p.T * (b.H + b.p.HV);
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  return static_cast<int>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

}  // namespace

void launch_backward_inputs(const BackwardParams& b, void* stream) {
  if (b.B * b.p.T == 0) return;
  inputs_kernel<<<item_blocks(b), kBackwardThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
}

void launch_backward_outputs(const BackwardParams& b, void* stream) {
  if (b.B * b.p.T == 0) return;
  outputs_kernel<<<item_blocks(b), kBackwardThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
}

void launch_backward_params(const BackwardParams& b, void* stream) {
  if (b.p.gate == GateForm::none || (!b.dA_log.data && !b.ddt_bias.data)) return;
  const int width = b.p.gate == GateForm::vector ? static_cast<int>(b.p.K) : 1;
  params_kernel<<<static_cast<unsigned>(b.p.HV * (width + 1)), kBackwardThreads, 0,
                  static_cast<cudaStream_t>(stream)>>>(b, width);
}

}  // namespace flashdelta::detail::cuda
