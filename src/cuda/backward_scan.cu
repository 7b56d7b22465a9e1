// The sequential stages of the CUDA backward (cuda/backward_params.h): one block per
// (sequence, value head, tile of kCols value columns) walks the sequence's chunks with a
// K x kCols tile in shared memory. `states` goes forward and keeps the state entering every
// chunk and v_new = u - w S; `dstates` goes backward with the state gradient:
//   dv_new = A_qk^T dO + kg dS'        dS = (q e^Gamma)^T dO + e^(Gamma_end) dS' - w^T dv_new
// keeping dS' (the gradient of the state leaving each chunk) and dv_new. Every product is a
// staged_product on the tensor cores (tf32 operands, float32 sums): the chunk's K-wide record
// rows stream through its double-buffered stage; the tile updates in its epilogue. Updates of
// the tile are written transposed (rows = the tile's columns, columns = keys), so that the
// products have at most kC rows.
#include <cuda_runtime.h>

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kCols = 32;

struct alignas(16) ScanShared {
  float s[kMaxCols][kCols];  // the state or its gradient, columns j0 ..
  float a[kC][kCols];        // v_new (states) or dO (dstates)
  float d[kC][kCols];        // dv_new (dstates)
  ProductStage<32> stage;  // a deeper stage: fewer rounds per chunk on the sequential path
};

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

// Loads the block's tile of a state given by the caller (any layout and float dtype; zeros
// when absent).
__device__ void load_tile(const BackwardParams& b, const ScanTile& t, const StateTensor& s,
                          DType dtype, ScanShared& sh) {
  const int64_t K = b.p.K;
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    sh.s[c][j] = s.data && j < t.cols
                     ? load_float(s.data, dtype, state_offset(s, t.n, t.hv, c, t.j0 + j))
                     : 0.f;
  }
}

// The tile and the chunk's rows as product operands: the tile [key][column], a [token][column]
// stage or its transpose, a record's K-wide rows [token][key].
__device__ Rows tile_rows(const ScanShared& sh) { return {&sh.s[0][0], kCols}; }
__device__ Rows token_rows(const float (*x)[kCols]) { return {&x[0][0], kCols}; }
__device__ Cols token_cols(const float (*x)[kCols]) { return {&x[0][0], kCols}; }
__device__ Rows key_rows(const BackwardParams& b, const float* buf, int64_t rec) {
  return {buf + rec * kC * b.p.K, b.p.K};
}

__global__ void __launch_bounds__(kBackwardThreads, 2) states_kernel(const BackwardParams b) {
  const ScanTile t(b);
  const int K = static_cast<int>(b.p.K);
  const int64_t V = b.p.V;
  extern __shared__ __align__(16) unsigned char smem[];
  ScanShared& sh = *reinterpret_cast<ScanShared*>(smem);
  load_tile(b, t, b.p.state_in, b.state_in_dtype, sh);
  for (int64_t ci = 0; ci < t.chunks.count; ++ci) {
    const int len = t.len(ci);
    if (len == 0) continue;  // defensive: the table counts chunks from the same lengths
    const int64_t rec = t.record(b, ci);
    __syncthreads();
    store_tile(sh, t, K, V, b.ws.states + rec * K * V);
    float* vn = b.ws.vn + rec * kC * V + t.j0;
    // v_new = u - w S (u lands before the product's first slice is used).
    stage_columns(t, b.ws.u + rec * kC * V, V, len, sh.a);
    if (b.p.delta) {
      staged_product(len, t.cols, K, key_rows(b, b.ws.w, rec), tile_rows(sh), sh.stage,
                     [&](int i, int j, float acc) {
                       const float v = sh.a[i][j] - acc;
                       sh.a[i][j] = v;
                       vn[i * V + j] = v;
                     });
    } else {
      commit_async();
      wait_async<0>();
      __syncthreads();
      for (int idx = threadIdx.x; idx < len * kCols; idx += blockDim.x) {
        const int i = idx / kCols, j = idx % kCols;
        if (j < t.cols) vn[i * V + j] = sh.a[i][j];
      }
    }
    // S'^T = S^T e^(Gamma_end) + v_new^T kg.
    const float* decay = b.ws.decay + rec * K;
    staged_product(t.cols, K, len, token_cols(sh.a), key_rows(b, b.ws.kg, rec), sh.stage,
                   [&](int j, int c, float acc) { sh.s[c][j] = decay[c] * sh.s[c][j] + acc; });
  }
}

__global__ void __launch_bounds__(kBackwardThreads, 2) dstates_kernel(const BackwardParams b) {
  const ScanTile t(b);
  const int K = static_cast<int>(b.p.K);
  const int64_t V = b.p.V;
  extern __shared__ __align__(16) unsigned char smem[];
  ScanShared& sh = *reinterpret_cast<ScanShared*>(smem);
  load_tile(b, t, b.d_final, b.d_final_dtype, sh);
  for (int64_t ci = t.chunks.count - 1; ci >= 0; --ci) {
    const int len = t.len(ci);
    if (len == 0) continue;  // defensive, as in states_kernel
    const int64_t rec = t.record(b, ci), r0 = t.row0(b, ci);
    __syncthreads();
    store_tile(sh, t, K, V, b.ws.dstates + rec * K * V);
    // dO is an operand staged from shared memory: it must have landed first.
    stage_columns(t, b.ws.dout + (r0 * b.p.HV + t.hv) * V, b.p.HV * V, len, sh.a);
    commit_async();
    wait_async<0>();
    // dv_new = A_qk^T dO + kg dS'.
    staged_product(len, t.cols, len, Cols{b.ws.aqk + rec * kC * kC, kC}, token_rows(sh.a),
                   sh.stage, [&](int i, int j, float acc) { sh.d[i][j] = acc; });
    float* dvn = b.ws.dvn + rec * kC * V + t.j0;
    staged_product(len, t.cols, K, key_rows(b, b.ws.kg, rec), tile_rows(sh), sh.stage,
                   [&](int i, int j, float acc) {
                     const float v = sh.d[i][j] + acc;
                     sh.d[i][j] = v;
                     dvn[i * V + j] = v;
                   });
    // dS^T = dS'^T e^(Gamma_end) + dO^T (q e^Gamma) - dv_new^T w.
    const float* decay = b.ws.decay + rec * K;
    staged_product(t.cols, K, len, token_cols(sh.a), key_rows(b, b.ws.qg, rec), sh.stage,
                   [&](int j, int c, float acc) { sh.s[c][j] = decay[c] * sh.s[c][j] + acc; });
    if (b.p.delta)
      staged_product(t.cols, K, len, token_cols(sh.d), key_rows(b, b.ws.w, rec), sh.stage,
                     [&](int j, int c, float acc) { sh.s[c][j] -= acc; });
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
