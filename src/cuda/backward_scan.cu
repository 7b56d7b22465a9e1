// The sequential stages of the CUDA backward (cuda/backward_params.h): one block per
// (sequence, value head, tile of kCols value columns) walks the sequence's chunks with a
// K x kCols tile in shared memory. `states` goes forward and keeps the state entering every
// chunk and v_new = u - w S; `dstates` goes backward with the state gradient:
//   dv_new = A_qk^T dO + kg dS'        dS = (q e^Gamma)^T dO + e^(Gamma_end) dS' - w^T dv_new
// keeping dS' (the gradient of the state leaving each chunk) and dv_new.
#include <cuda_runtime.h>

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kCols = 32;
constexpr int kMaxKeys = 256;

// 48 KB: the static limit. A warp touches one row of 32 consecutive columns: no conflicts.
struct ScanShared {
  float s[kMaxKeys][kCols];  // the state or its gradient, columns j0 ..
  float a[kC][kCols];        // v_new (states) or dO (dstates)
  float d[kC][kCols];        // dv_new (dstates)
};

// The block's sequence, value head and columns, and the chunk geometry of the sequence.
struct ScanTile {
  int64_t n, hv, j0;
  int cols;
  Sequence seq;
  BackwardChunks chunks;

  __device__ ScanTile(const BackwardParams& b) {
    const int64_t tiles = (b.p.V + kCols - 1) / kCols;
    n = blockIdx.x / (b.p.HV * tiles);
    hv = blockIdx.x / tiles % b.p.HV;
    j0 = blockIdx.x % tiles * kCols;
    cols = static_cast<int>(b.p.V - j0 < kCols ? b.p.V - j0 : kCols);
    seq = sequence_of(b.p, n);
    chunks = chunks_of(b, n);
  }
  // Record index and first token row of chunk ci, and its length (0 past the sequence).
  __device__ int64_t record(const BackwardParams& b, int64_t ci) const {
    return (chunks.first + ci) * b.p.HV + hv;
  }
  __device__ int64_t row0(const BackwardParams& b, int64_t ci) const {
    return seq.batch * b.p.T + seq.t0 + ci * kC;
  }
  __device__ int len(int64_t ci) const {
    const int64_t left = seq.len - ci * kC;
    return static_cast<int>(left <= 0 ? 0 : left < kC ? left : kC);
  }
};

// Copies the block's tile of a K x V state (row-major, K-first) out of shared memory.
__device__ void store_tile(const ScanShared& sh, const ScanTile& t, int64_t K, int64_t V,
                           float* out) {
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    if (j < t.cols) out[c * V + t.j0 + j] = sh.s[c][j];
  }
}

__global__ void __launch_bounds__(kBackwardThreads) states_kernel(const BackwardParams b) {
  const ScanTile t(b);
  const int64_t K = b.p.K, V = b.p.V, HV = b.p.HV;
  __shared__ ScanShared sh;
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    sh.s[c][j] = b.p.state_in.data && j < t.cols
                     ? load_state_elem(b.p.state_in, b.state_in_dtype, t.n, t.hv, c, t.j0 + j)
                     : 0.f;
  }
  __syncthreads();
  for (int64_t ci = 0; ci < t.chunks.count; ++ci) {
    const int len = t.len(ci);
    if (len == 0) break;  // a malformed device table promised more chunks than tokens
    const int64_t rec = t.record(b, ci), r0 = t.row0(b, ci);
    store_tile(sh, t, K, V, b.ws.states + rec * K * V);
    // v_new = u - w S.
    for (int idx = threadIdx.x; idx < kC * kCols; idx += blockDim.x) {
      const int i = idx / kCols, j = idx % kCols;
      float acc = 0.f;
      if (i < len && j < t.cols) {
        const int64_t row = (r0 + i) * HV + t.hv;
        acc = b.ws.u[row * V + t.j0 + j];
        if (b.p.delta) {
          const float* w = b.ws.w + row * K;
          for (int c = 0; c < K; ++c) acc = fmaf(-w[c], sh.s[c][j], acc);
        }
        b.ws.vn[row * V + t.j0 + j] = acc;
      }
      sh.a[i][j] = acc;
    }
    __syncthreads();
    // S' = e^(Gamma_end) S + kg^T v_new.
    const float* decay = b.ws.decay + rec * K;
    for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
      const int c = idx / kCols, j = idx % kCols;
      float acc = decay[c] * sh.s[c][j];
      for (int i = 0; i < len; ++i) acc = fmaf(b.ws.kg[((r0 + i) * HV + t.hv) * K + c], sh.a[i][j], acc);
      sh.s[c][j] = acc;
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kBackwardThreads) dstates_kernel(const BackwardParams b) {
  const ScanTile t(b);
  const int64_t K = b.p.K, V = b.p.V, HV = b.p.HV, T = b.p.T;
  __shared__ ScanShared sh;
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    sh.s[c][j] = b.d_final.data && j < t.cols
                     ? load_state_elem(b.d_final, b.d_final_dtype, t.n, t.hv, c, t.j0 + j)
                     : 0.f;
  }
  __syncthreads();
  for (int64_t ci = t.chunks.count - 1; ci >= 0; --ci) {
    const int len = t.len(ci);
    if (len == 0) continue;
    const int64_t rec = t.record(b, ci), r0 = t.row0(b, ci);
    store_tile(sh, t, K, V, b.ws.dstates + rec * K * V);
    for (int idx = threadIdx.x; idx < kC * kCols; idx += blockDim.x) {
      const int i = idx / kCols, j = idx % kCols;
      const int64_t row = r0 + i;
      const TokenTensor& d_o = b.d_o;
      sh.a[i][j] = i < len && j < t.cols
                       ? load_float(d_o.data, d_o.dtype, row / T * d_o.stride[0] +
                                                              row % T * d_o.stride[1] +
                                                              t.hv * d_o.stride[2] +
                                                              (t.j0 + j) * d_o.stride[3])
                       : 0.f;
    }
    __syncthreads();
    // dv_new = A_qk^T dO + kg dS'.
    const float* aqk = b.ws.aqk + rec * kC * kC;
    for (int idx = threadIdx.x; idx < kC * kCols; idx += blockDim.x) {
      const int i = idx / kCols, j = idx % kCols;
      float acc = 0.f;
      if (i < len) {
        for (int r = i; r < len; ++r) acc = fmaf(aqk[r * kC + i], sh.a[r][j], acc);
        const float* kg = b.ws.kg + ((r0 + i) * HV + t.hv) * K;
        for (int c = 0; c < K; ++c) acc = fmaf(kg[c], sh.s[c][j], acc);
        if (j < t.cols) b.ws.dvn[((r0 + i) * HV + t.hv) * V + t.j0 + j] = acc;
      }
      sh.d[i][j] = acc;
    }
    __syncthreads();
    // dS = (q e^Gamma)^T dO + e^(Gamma_end) dS' - w^T dv_new.
    const float* decay = b.ws.decay + rec * K;
    for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
      const int c = idx / kCols, j = idx % kCols;
      float acc = decay[c] * sh.s[c][j];
      for (int i = 0; i < len; ++i) {
        const int64_t row = (r0 + i) * HV + t.hv;
        acc = fmaf(b.ws.qg[row * K + c], sh.a[i][j], acc);
        if (b.p.delta) acc = fmaf(-b.ws.w[row * K + c], sh.d[i][j], acc);
      }
      sh.s[c][j] = acc;
    }
    __syncthreads();
  }
  if (!b.d_initial.data) return;
  const StateTensor& o = b.d_initial;
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    if (j < t.cols)
      store_float(o.data, b.d_initial_dtype,
                  t.n * o.slot_stride + t.hv * o.head_stride + c * o.key_stride +
                      (t.j0 + j) * o.value_stride,
                  sh.s[c][j]);
  }
}

unsigned scan_blocks(const BackwardParams& b) {
  return static_cast<unsigned>(b.p.N * b.p.HV * ((b.p.V + kCols - 1) / kCols));
}

}  // namespace

void launch_backward_states(const BackwardParams& b, void* stream) {
  if (scan_blocks(b) == 0) return;
  states_kernel<<<scan_blocks(b), kBackwardThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
}

void launch_backward_dstates(const BackwardParams& b, void* stream) {
  if (scan_blocks(b) == 0) return;
  dstates_kernel<<<scan_blocks(b), kBackwardThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
}

}  // namespace flashdelta::detail::cuda
