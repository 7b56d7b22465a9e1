// The CUDA recurrent kernel's per-token inputs: loading one token's q, k, v, g and beta
// with all loads in flight at once, and staging them in shared memory with the fused
// transforms (L2 norms, beta sigmoid, gate activation). Internal to cuda/recurrent_kernel.cu.
#pragma once

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
#include "cuda/recurrent_task.cuh"
#include "cuda/recurrent_tile.cuh"
#include "cuda/transforms.cuh"

namespace flashdelta::detail::cuda {
namespace {

struct alignas(16) Shared {
  float q[256], k[256], decay[256];
  float partial[kWarps][3];  // |q|^2, |k|^2, q.k per warp
  float columns[kWarps][2][32];  // per warp, k^T S' and q^T S' of each column (Tile::KW > 1)
  float beta, scalar_decay;
};

// One token's inputs as this thread loads them: the raw bits, all issued before any is
// used (see load_raw). Thread i holds key channel i (and i + kThreads for K > kThreads);
// thread 0 also the scalar gate and beta; every thread the values of its 4 columns.
template <int KB>
struct TokenRaw {
  static constexpr int kPerThread = (KB + kThreads - 1) / kThreads;
  uint32_t q[kPerThread], k[kPerThread], g[kPerThread], bias[kPerThread];
  uint32_t v[4];
  uint32_t scalar_g, scalar_bias, beta;
};

// T: the token tensors' types (TokenTypes).
template <int KB, class T>
__device__ void fetch_token(const RecurrentParams& p, const RowOffsets& row, int64_t t,
                            int64_t hv, int column0, TokenRaw<KB>& raw) {
  const int tid = threadIdx.x;
  const int64_t ov = row.v + t * p.v.stride[1];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    raw.v[e] = column0 + e < p.V
                   ? load_raw(p.v.data, T::of(p.v), ov + (column0 + e) * p.v.stride[3])
                   : 0u;
  const int64_t oq = row.q + t * p.q.stride[1], ok = row.k + t * p.k.stride[1];
  const int64_t og = row.g + t * p.g.stride[1];
#pragma unroll
  for (int x = 0; x < TokenRaw<KB>::kPerThread; ++x) {
    const int i = tid + x * kThreads;
    if (i >= p.K) continue;
    raw.q[x] = load_raw(p.q.data, T::of(p.q), oq + i * p.q.stride[3]);
    raw.k[x] = load_raw(p.k.data, T::of(p.k), ok + i * p.k.stride[3]);
    if (p.gate == GateForm::vector) {
      raw.g[x] = load_raw(p.g.data, T::of(p.g), og + i * p.g.stride[3]);
      if (p.dt_bias)
        raw.bias[x] = load_raw(p.dt_bias, p.dt_bias_dtype,
                               hv * p.dt_bias_head_stride + i * p.dt_bias_key_stride);
    }
  }
  if (tid == 0) {
    if (p.gate == GateForm::scalar) {
      raw.scalar_g = load_raw(p.g.data, T::of(p.g), og);
      if (p.dt_bias)
        raw.scalar_bias = load_raw(p.dt_bias, p.dt_bias_dtype, hv * p.dt_bias_head_stride);
    }
    if (p.delta) raw.beta = load_raw(p.beta.data, T::of(p.beta), row.beta + t * p.beta.stride[1]);
  }
}

// Converts a fetched token into shared memory (raw q and k, the decays exp(g), beta) and
// leaves the per-warp |q|^2, |k|^2, q.k partials; ends with a barrier.
template <int KB, class T>
__device__ void stage_token(const RecurrentParams& p, Shared& sh, const TokenRaw<KB>& raw,
                            float a) {
  const int tid = threadIdx.x;
  float pq = 0.f, pk = 0.f, pqk = 0.f;
#pragma unroll
  for (int x = 0; x < TokenRaw<KB>::kPerThread; ++x) {
    const int i = tid + x * kThreads;
    if (i >= KB) continue;
    float qi = 0.f, ki = 0.f, di = 1.f;
    if (i < p.K) {
      qi = raw_to_float(raw.q[x], T::of(p.q));
      ki = raw_to_float(raw.k[x], T::of(p.k));
      if (p.gate == GateForm::vector) {
        float gx = raw_to_float(raw.g[x], T::of(p.g));
        if (p.gate_in_kernel) {
          if (p.dt_bias) gx += raw_to_float(raw.bias[x], p.dt_bias_dtype);
          gx = activate_gate(p, gx, a);
        }
        di = expf(gx);
      }
    }
    sh.q[i] = qi;
    sh.k[i] = ki;
    sh.decay[i] = di;
    pq += qi * qi;
    pk += ki * ki;
    pqk += qi * ki;
  }
  if (tid == 0) {
    sh.scalar_decay = 1.f;
    if (p.gate == GateForm::scalar) {
      float gx = raw_to_float(raw.scalar_g, T::of(p.g));
      if (p.gate_in_kernel) {
        if (p.dt_bias) gx += raw_to_float(raw.scalar_bias, p.dt_bias_dtype);
        gx = activate_gate(p, gx, a);
      }
      sh.scalar_decay = expf(gx);
    }
    if (p.delta) {
      const float b = raw_to_float(raw.beta, T::of(p.beta));
      sh.beta = activate_beta(p, b);
    }
  }
  pq = lane_sum<1, 16>(pq);
  pk = lane_sum<1, 16>(pk);
  pqk = lane_sum<1, 16>(pqk);
  if (tid % 32 == 0) {
    sh.partial[tid / 32][0] = pq;
    sh.partial[tid / 32][1] = pk;
    sh.partial[tid / 32][2] = pqk;
  }
  __syncthreads();
}

// The staged q, k and decays of 4 adjacent keys (key0..key0+3), read as conflict-free
// 16-byte loads.
struct KeyRun4 {
  float q[4], k[4], d[4];
};

__device__ __forceinline__ KeyRun4 key_run(const RecurrentParams& p, const Shared& sh, int key0) {
  const float4 q4 = *reinterpret_cast<const float4*>(&sh.q[key0]);
  const float4 k4 = *reinterpret_cast<const float4*>(&sh.k[key0]);
  const float4 d4 = p.gate == GateForm::vector
                        ? *reinterpret_cast<const float4*>(&sh.decay[key0])
                        : make_float4(sh.scalar_decay, sh.scalar_decay, sh.scalar_decay,
                                      sh.scalar_decay);
  return {{q4.x, q4.y, q4.z, q4.w}, {k4.x, k4.y, k4.z, k4.w}, {d4.x, d4.y, d4.z, d4.w}};
}

}  // namespace
}  // namespace flashdelta::detail::cuda
