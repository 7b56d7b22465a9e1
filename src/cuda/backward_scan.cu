// The sequential stages of the CUDA backward (cuda/backward_params.h): one block per
// (sequence, value head, tile of kCols value columns) walks the sequence's chunks with a
// K x kCols tile in shared memory. `states` goes forward and keeps the state entering every
// chunk and v_new = u - w S; `dstates` goes backward with the state gradient:
//   dv_new = A_qk^T dO + kg dS'        dS = (q e^Gamma)^T dO + e^(Gamma_end) dS' - w^T dv_new
// keeping dS' (the gradient of the state leaving each chunk) and dv_new.
// The chunk's K-wide rows (w, kg, q e^Gamma) pass through shared memory kSlab channels at a
// time, loaded by the whole block in coalesced rows with cp.async, the next slab in flight
// while the block works on the current one; thread (warp, lane) owns column `lane` and rows
// (or channels) warp, warp + 8, ...
#include <cuda_runtime.h>

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kCols = 32;
constexpr int kSlab = 32;
constexpr int kWarps = kBackwardThreads / 32;
constexpr int kRowsPerThread = kC / kWarps;
constexpr int kSlabChannelsPerThread = kSlab / kWarps;

struct alignas(16) ScanShared {
  float s[kMaxCols][kCols];      // the state or its gradient, columns j0 ..
  float a[kC][kCols];            // v_new (states) or dO (dstates)
  float d[kC][kCols];            // dv_new (dstates)
  float aqk[kC][kC + 1];         // A_qk of the chunk (dstates)
  float slab[2][2][kC][kSlab + 1];  // [buffer][operand]: K-wide rows, channels c0 ..
};

using Slab = float[2][kC][kSlab + 1];  // the two operands of one buffer

// The block's sequence, value head and columns, and the chunk geometry of the sequence.
struct ScanTile {
  int64_t n, hv, j0;
  int cols;
  Sequence seq;
  ChunkRange chunks;

  __device__ explicit ScanTile(const BackwardParams& b) {
    const int64_t tiles = (b.p.V + kCols - 1) / kCols;
    n = blockIdx.x / (b.p.HV * tiles);
    hv = blockIdx.x / tiles % b.p.HV;
    j0 = blockIdx.x % tiles * kCols;
    cols = static_cast<int>(b.p.V - j0 < kCols ? b.p.V - j0 : kCols);
    seq = sequence_of(b.p, n);
    chunks = chunks_of(b, n);
  }
  __device__ int64_t record(const BackwardParams& b, int64_t ci) const {
    return (chunks.first + ci) * b.p.HV + hv;
  }
  __device__ int64_t row0(const BackwardParams& b, int64_t ci) const {
    return seq.batch * b.p.T + seq.t0 + ci * kC;
  }
  // Tokens of chunk ci (0 past the sequence).
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

// Queues rows [0, len) of columns j0 .. j0 + 31 of a V-wide buffer into dst (cp.async; zeros
// past len or V): row i at rows + i * row_stride (token-major or record-major buffers).
__device__ void stage_columns(const ScanTile& t, const float* rows, int64_t row_stride, int len,
                              float (*dst)[kCols]) {
  for (int idx = threadIdx.x; idx < kC * kCols; idx += blockDim.x) {
    const int i = idx / kCols, j = idx % kCols;
    if (i < len && j < t.cols)
      copy_async<4>(&dst[i][j], rows + i * row_stride + t.j0 + j, 4);
    else
      dst[i][j] = 0.f;
  }
}

// Queues channels [c0, c0 + kSlab) of rows [0, len) of record rec of a K-wide buffer.
__device__ void stage_slab(const BackwardParams& b, const float* buf, int64_t rec, int len,
                           int c0, float (*dst)[kSlab + 1]) {
  const int64_t K = b.p.K;
  for (int idx = threadIdx.x; idx < kC * kSlab; idx += blockDim.x) {
    const int i = idx / kSlab, cc = idx % kSlab;
    if (i < len && c0 + cc < K)
      copy_async<4>(&dst[i][cc], buf + (rec * kC + i) * K + c0 + cc, 4);
    else
      dst[i][cc] = 0.f;
  }
}

// Walks the K channels kSlab at a time: body(c0, slab) sees channels c0 .. of `first` in
// slab[0] (and of `second` in slab[1], when given) while the next slab is in flight. Copies
// queued before the call land with the first slab. Ends with a block barrier.
template <class Body>
__device__ void over_slabs(const BackwardParams& b, const float* first, const float* second,
                           int64_t rec, int len, ScanShared& sh, const Body& body) {
  const int K = static_cast<int>(b.p.K), slabs = (K + kSlab - 1) / kSlab;
  auto issue = [&](int s) {
    stage_slab(b, first, rec, len, s * kSlab, sh.slab[s & 1][0]);
    if (second) stage_slab(b, second, rec, len, s * kSlab, sh.slab[s & 1][1]);
  };
  issue(0);
  commit_async();
  for (int s = 0; s < slabs; ++s) {
    if (s + 1 < slabs) issue(s + 1);
    commit_async();
    wait_async<1>();
    __syncthreads();
    body(s * kSlab, sh.slab[s & 1]);
    __syncthreads();
  }
}

// Loads the block's tile of a state given by the caller (any layout and float dtype; zeros
// when absent). Rows K .. up to the next multiple of kSlab are zeroed too: the slab products
// read them (times zero-filled slab entries, which leftover NaN bits would still poison),
// and no update ever writes them.
__device__ void load_tile(const BackwardParams& b, const ScanTile& t, const StateTensor& s,
                          DType dtype, ScanShared& sh) {
  const int64_t K = b.p.K, rows = (K + kSlab - 1) / kSlab * kSlab;
  for (int idx = threadIdx.x; idx < rows * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    sh.s[c][j] = s.data && c < K && j < t.cols
                     ? load_float(s.data, dtype, state_offset(s, t.n, t.hv, c, t.j0 + j))
                     : 0.f;
  }
}

__global__ void __launch_bounds__(kBackwardThreads) states_kernel(const BackwardParams b) {
  const ScanTile t(b);
  const int K = static_cast<int>(b.p.K);
  const int64_t V = b.p.V;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  extern __shared__ __align__(16) unsigned char smem[];
  ScanShared& sh = *reinterpret_cast<ScanShared*>(smem);
  load_tile(b, t, b.p.state_in, b.state_in_dtype, sh);
  for (int64_t ci = 0; ci < t.chunks.count; ++ci) {
    const int len = t.len(ci);
    if (len == 0) continue;  // defensive: the table counts chunks from the same lengths
    const int64_t rec = t.record(b, ci);
    __syncthreads();
    store_tile(sh, t, K, V, b.ws.states + rec * K * V);
    // v_new = u - w S.
    stage_columns(t, b.ws.u + rec * kC * V, V, len, sh.a);
    float acc[kRowsPerThread] = {};
    if (b.p.delta) {
      over_slabs(b, b.ws.w, nullptr, rec, len, sh, [&](int c0, const Slab& slab) {
#pragma unroll
        for (int e = 0; e < kRowsPerThread; ++e) {
          const int i = warp + e * kWarps;
#pragma unroll 8
          for (int cc = 0; cc < kSlab; ++cc)
            acc[e] = fmaf(slab[0][i][cc], sh.s[c0 + cc][lane], acc[e]);
        }
      });
    } else {
      commit_async();
      wait_async<0>();
      __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < kRowsPerThread; ++e) {
      const int i = warp + e * kWarps;
      sh.a[i][lane] -= acc[e];
      if (i < len && lane < t.cols) b.ws.vn[(rec * kC + i) * V + t.j0 + lane] = sh.a[i][lane];
    }
    // S' = e^(Gamma_end) S + kg^T v_new (over_slabs' first barrier publishes v_new).
    const float* decay = b.ws.decay + rec * K;
    over_slabs(b, b.ws.kg, nullptr, rec, len, sh, [&](int c0, const Slab& slab) {
#pragma unroll
      for (int e = 0; e < kSlabChannelsPerThread; ++e) {
        const int cc = warp + e * kWarps, c = c0 + cc;
        if (c >= K) continue;
        float v = decay[c] * sh.s[c][lane];
        for (int i = 0; i < len; ++i) v = fmaf(slab[0][i][cc], sh.a[i][lane], v);
        sh.s[c][lane] = v;
      }
    });
  }
}

__global__ void __launch_bounds__(kBackwardThreads) dstates_kernel(const BackwardParams b) {
  const ScanTile t(b);
  const int K = static_cast<int>(b.p.K);
  const int64_t V = b.p.V;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  extern __shared__ __align__(16) unsigned char smem[];
  ScanShared& sh = *reinterpret_cast<ScanShared*>(smem);
  load_tile(b, t, b.d_final, b.d_final_dtype, sh);
  for (int64_t ci = t.chunks.count - 1; ci >= 0; --ci) {
    const int len = t.len(ci);
    if (len == 0) continue;  // defensive, as in states_kernel
    const int64_t rec = t.record(b, ci), r0 = t.row0(b, ci);
    __syncthreads();
    store_tile(sh, t, K, V, b.ws.dstates + rec * K * V);
    stage_columns(t, b.ws.dout + (r0 * b.p.HV + t.hv) * V, b.p.HV * V, len, sh.a);
    const float* aqk = b.ws.aqk + rec * kC * kC;
    for (int idx = threadIdx.x; idx < kC * kC; idx += blockDim.x)
      copy_async<4>(&sh.aqk[idx / kC][idx % kC], aqk + idx, 4);
    // dv_new = A_qk^T dO + kg dS' (dO and A_qk land with the first kg slab).
    float acc[kRowsPerThread] = {};
    over_slabs(b, b.ws.kg, nullptr, rec, len, sh, [&](int c0, const Slab& slab) {
      if (c0 == 0) {
#pragma unroll
        for (int e = 0; e < kRowsPerThread; ++e) {
          const int i = warp + e * kWarps;
          for (int r = i; r < len; ++r) acc[e] = fmaf(sh.aqk[r][i], sh.a[r][lane], acc[e]);
        }
      }
#pragma unroll
      for (int e = 0; e < kRowsPerThread; ++e) {
        const int i = warp + e * kWarps;
#pragma unroll 8
        for (int cc = 0; cc < kSlab; ++cc)
          acc[e] = fmaf(slab[0][i][cc], sh.s[c0 + cc][lane], acc[e]);
      }
    });
#pragma unroll
    for (int e = 0; e < kRowsPerThread; ++e) {
      const int i = warp + e * kWarps;
      sh.d[i][lane] = i < len ? acc[e] : 0.f;
      if (i < len && lane < t.cols) b.ws.dvn[(rec * kC + i) * V + t.j0 + lane] = acc[e];
    }
    // dS = (q e^Gamma)^T dO + e^(Gamma_end) dS' - w^T dv_new (over_slabs' first barrier
    // publishes dv_new).
    const float* decay = b.ws.decay + rec * K;
    over_slabs(b, b.ws.qg, b.p.delta ? b.ws.w : nullptr, rec, len, sh,
               [&](int c0, const Slab& slab) {
#pragma unroll
                 for (int e = 0; e < kSlabChannelsPerThread; ++e) {
                   const int cc = warp + e * kWarps, c = c0 + cc;
                   if (c >= K) continue;
                   float v = decay[c] * sh.s[c][lane];
                   for (int i = 0; i < len; ++i) {
                     v = fmaf(slab[0][i][cc], sh.a[i][lane], v);
                     if (b.p.delta) v = fmaf(-slab[1][i][cc], sh.d[i][lane], v);
                   }
                   sh.s[c][lane] = v;
                 }
               });
  }
  __syncthreads();
  if (!b.d_initial.data) return;
  const StateTensor& o = b.d_initial;
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    if (j < t.cols)
      store_float(o.data, b.d_initial_dtype, state_offset(o, t.n, t.hv, c, t.j0 + j), sh.s[c][j]);
  }
}

void launch_scan(void (*kernel)(BackwardParams), const BackwardParams& b, void* stream) {
  const unsigned blocks = static_cast<unsigned>(b.p.N * b.p.HV * ((b.p.V + kCols - 1) / kCols));
  if (blocks == 0) return;
  set_shared_bytes(kernel, sizeof(ScanShared));
  kernel<<<blocks, kBackwardThreads, sizeof(ScanShared), static_cast<cudaStream_t>(stream)>>>(b);
}

}  // namespace

int64_t backward_scan_shared_bytes() { return sizeof(ScanShared); }

void launch_backward_states(const BackwardParams& b, void* stream) {
  launch_scan(states_kernel, b, stream);
}

void launch_backward_dstates(const BackwardParams& b, void* stream) {
  launch_scan(dstates_kernel, b, stream);
}

}  // namespace flashdelta::detail::cuda
