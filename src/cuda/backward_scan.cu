// The sequential stages of the CUDA backward (cuda/backward_params.h): one block per
// (sequence, value head, tile of kCols value columns) walks the sequence's chunks with a
// K x kCols tile in shared memory. kCols is BackwardParams::scan_cols (32, 16 or 8): narrower
// tiles give a few long sequences more blocks (each block's per-chunk rounds take about as
// long at any width, so the scans' time falls with the blocks in parallel). `states` goes
// forward and keeps the state entering every chunk and v_new = u - w S; `dstates` goes
// backward with the state gradient:
//   dv_new = A_qk^T dO + kg dS'        dS = (q e^Gamma)^T dO + e^(Gamma_end) dS' - w^T dv_new
// keeping dS' (the gradient of the state leaving each chunk) and dv_new. With the forward's
// states kept (BackwardArgs::chunk_states), `given_states` replaces `states`: one block per
// (chunk, value head) copies the given state and forms v_new, all chunks in parallel.
// (cuda/backward_scans_mma.cu has both scans with the state in registers, K <= 128.)
// Every product is a staged_product on the tensor cores (tf32 operands, float32 sums): the
// chunk's K-wide record rows stream through its double-buffered stage; the tile updates in
// its epilogue. Updates of the tile are written transposed (rows = the tile's columns,
// columns = keys), so that the products have at most kC rows.
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

template <int kCols>
struct alignas(16) ScanShared {
  float s[kMaxCols][kCols];  // the state or its gradient, columns j0 ..
  float a[kC][kCols];        // v_new (states) or dO (dstates)
  float d[kC][kCols];        // dv_new (dstates)
  ProductStage<32> stage;  // a deeper stage: fewer rounds per chunk on the sequential path
};

__host__ __device__ inline int64_t column_tiles(int64_t V, int cols) {
  return (V + cols - 1) / cols;
}

// The block's value columns j0 .. j0 + cols - 1: tile blockIdx.x % column_tiles(V).
template <int kCols>
struct ColumnTile {
  int64_t j0;
  int cols;

  __device__ explicit ColumnTile(int64_t V) {
    j0 = blockIdx.x % column_tiles(V, kCols) * kCols;
    cols = static_cast<int>(V - j0 < kCols ? V - j0 : kCols);
  }
};

// The scans' block: its columns, sequence and value head, and the sequence's chunks.
template <int kCols>
struct ScanTile : ColumnTile<kCols>, ScanChunks {
  __device__ explicit ScanTile(const BackwardParams& b)
      : ColumnTile<kCols>(b.p.V), ScanChunks(b, column_tiles(b.p.V, kCols)) {}
};

// Copies the block's tile of a K x V state (row-major, K-first) out of shared memory.
template <int kCols>
__device__ void store_tile(const ScanShared<kCols>& sh, const ColumnTile<kCols>& t, int64_t K,
                           int64_t V, const StateSlab& out) {
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    if (j < t.cols) out.store(c * V + t.j0 + j, sh.s[c][j]);
  }
}

// Queues rows [0, len) of the block's columns of a V-wide buffer into dst (cp.async; zeros
// past len or V): row i at rows + i * row_stride (token-major or record-major buffers).
template <int kCols>
__device__ void stage_columns(const ColumnTile<kCols>& t, const float* rows, int64_t row_stride,
                              int len, float (*dst)[kCols]) {
  for (int idx = threadIdx.x; idx < kC * kCols; idx += blockDim.x) {
    const int i = idx / kCols, j = idx % kCols;
    if (i < len && j < t.cols)
      copy_async<4>(&dst[i][j], rows + i * row_stride + t.j0 + j, 4);
    else
      dst[i][j] = 0.f;
  }
}

// Loads the block's tile of entry (n, hv) of a state given by the caller (any layout and
// float dtype; zeros when absent).
template <int kCols>
__device__ void load_tile(const BackwardParams& b, const ColumnTile<kCols>& t,
                          const StateTensor& s, DType dtype, int64_t n, int64_t hv,
                          ScanShared<kCols>& sh) {
  const int64_t K = b.p.K;
  for (int idx = threadIdx.x; idx < K * kCols; idx += blockDim.x) {
    const int c = idx / kCols, j = idx % kCols;
    sh.s[c][j] = s.data && j < t.cols
                     ? load_float(s.data, dtype, state_offset(s, n, hv, c, t.j0 + j))
                     : 0.f;
  }
}

// The tile and the chunk's rows as product operands: the tile [key][column], a [token][column]
// stage or its transpose, a record's K-wide rows [token][key].
template <int kCols>
__device__ Rows tile_rows(const ScanShared<kCols>& sh) {
  return {&sh.s[0][0], kCols};
}
template <int kCols>
__device__ Rows token_rows(const float (*x)[kCols]) {
  return {&x[0][0], kCols};
}
template <int kCols>
__device__ Cols token_cols(const float (*x)[kCols]) {
  return {&x[0][0], kCols};
}
__device__ Rows key_rows(const BackwardParams& b, const float* buf, int64_t rec) {
  return {buf + rec * kC * b.p.K, b.p.K};
}

// The tile of the state entering record rec (len tokens), in sh.s and read by every thread
// only after a barrier: to the workspace's states, and v_new = u - w S to vn and to sh.a
// (for the state update that follows in states_kernel).
template <int kCols>
__device__ void chunk_entry(const BackwardParams& b, const ColumnTile<kCols>& t, int64_t rec,
                            int len, ScanShared<kCols>& sh) {
  const int K = static_cast<int>(b.p.K);
  const int64_t V = b.p.V;
  store_tile(sh, t, K, V, states_slab(b, rec));
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
}

template <int kCols>
__global__ void __launch_bounds__(kBackwardThreads, 2) states_kernel(const BackwardParams b) {
  const ScanTile<kCols> t(b);
  const int K = static_cast<int>(b.p.K);
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sh = *reinterpret_cast<ScanShared<kCols>*>(smem);
  load_tile(b, t, b.p.state_in, b.state_in_dtype, t.n, t.hv, sh);
  for (int64_t ci = 0; ci < t.chunks.count; ++ci) {
    const int len = t.len(ci);
    if (len == 0) continue;  // defensive: the table counts chunks from the same lengths
    const int64_t rec = t.record(b, ci);
    __syncthreads();
    chunk_entry(b, t, rec, len, sh);
    // S'^T = S^T e^(Gamma_end) + v_new^T kg.
    const float* decay = b.ws.decay + rec * K;
    staged_product(t.cols, K, len, token_cols(sh.a), key_rows(b, b.ws.kg, rec), sh.stage,
                   [&](int j, int c, float acc) { sh.s[c][j] = decay[c] * sh.s[c][j] + acc; });
  }
}

// Copies entry `chunk` of the kept states (any float dtype and layout) to `S`, the
// workspace's K x V float32 K-first state of one record, zeros where `given` is absent. Every
// thread has kBatch loads in flight before it stores (16-byte loads for contiguous float32
// rows): the copy is bound by memory, not by the latency of one load after another.
__device__ void copy_given_state(const BackwardParams& b, const StateTensor& given,
                                 int64_t chunk, int64_t hv, float* S) {
  constexpr int kBatch = 4;
  const int K = static_cast<int>(b.p.K), V = static_cast<int>(b.p.V), KV = K * V;
  const bool f32_rows = given.data && b.chunk_states_dtype == DType::f32 &&
                        given.value_stride == 1 && V % 4 == 0 && given.key_stride % 4 == 0;
  const float* src = f32_rows ? static_cast<const float*>(given.data) +
                                    state_offset(given, chunk, hv, 0, 0)
                              : nullptr;
  if (f32_rows && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const int quads = KV / 4, row_quads = V / 4;
    for (int base = threadIdx.x; base < quads; base += kBatch * blockDim.x) {
      float4 x[kBatch];
#pragma unroll
      for (int e = 0; e < kBatch; ++e) {
        const int q = base + e * blockDim.x;
        if (q < quads)
          x[e] = *reinterpret_cast<const float4*>(src + q / row_quads * given.key_stride +
                                                  4 * (q % row_quads));
      }
#pragma unroll
      for (int e = 0; e < kBatch; ++e)
        if (base + e * blockDim.x < quads)
          reinterpret_cast<float4*>(S)[base + e * blockDim.x] = x[e];
    }
    return;
  }
  for (int base = threadIdx.x; base < KV; base += 4 * kBatch * blockDim.x) {
    float x[4 * kBatch];
#pragma unroll
    for (int e = 0; e < 4 * kBatch; ++e) {
      const int idx = base + e * blockDim.x;
      x[e] = given.data && idx < KV ? load_float(given.data, b.chunk_states_dtype,
                                                 state_offset(given, chunk, hv, idx / V, idx % V))
                                    : 0.f;
    }
#pragma unroll
    for (int e = 0; e < 4 * kBatch; ++e)
      if (base + e * blockDim.x < KV) S[base + e * blockDim.x] = x[e];
  }
}

// One block per record: the kept state entering the record's chunk (entry `chunk` of
// BackwardArgs::chunk_states) to the workspace's states, then v_new = u - w S over all V
// columns (w read once per record), all records in parallel.
__global__ void __launch_bounds__(kBackwardThreads, 2) given_states_kernel(const BackwardParams b) {
  const int64_t rec = blockIdx.x, chunk = rec / b.p.HV, hv = rec % b.p.HV;
  ChunkRef ref;
  int64_t r0 = 0;
  if (!chunk_at(b, chunk, ref, r0)) return;
  const int K = static_cast<int>(b.p.K), V = static_cast<int>(b.p.V);
  StateTensor given = b.chunk_states;
  if (chunk >= b.chunk_states_count) given.data = nullptr;  // a malformed device table's
  float* S = b.ws.states + rec * K * V;
  copy_given_state(b, given, chunk, hv, S);
  // The block reads back what it wrote: __syncthreads orders its global writes before.
  __syncthreads();
  const float* u = b.ws.u + rec * kC * V;
  float* vn = b.ws.vn + rec * kC * V;
  if (!b.p.delta) {
    for (int idx = threadIdx.x; idx < ref.len * V; idx += blockDim.x) vn[idx] = u[idx];
    return;
  }
  extern __shared__ __align__(16) unsigned char smem[];
  auto& stage = *reinterpret_cast<ProductStage<32>*>(smem);
  staged_product(ref.len, V, K, key_rows(b, b.ws.w, rec), Rows{S, V}, stage,
                 [&](int i, int j, float acc) { vn[i * V + j] = u[i * V + j] - acc; });
}

template <int kCols>
__global__ void __launch_bounds__(kBackwardThreads, 2) dstates_kernel(const BackwardParams b) {
  const ScanTile<kCols> t(b);
  const int K = static_cast<int>(b.p.K);
  const int64_t V = b.p.V;
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sh = *reinterpret_cast<ScanShared<kCols>*>(smem);
  load_tile(b, t, b.d_final, b.d_final_dtype, t.n, t.hv, sh);
  for (int64_t ci = t.chunks.count - 1; ci >= 0; --ci) {
    const int len = t.len(ci);
    if (len == 0) continue;  // defensive, as in states_kernel
    const int64_t rec = t.record(b, ci), r0 = t.row0(b, ci);
    __syncthreads();
    store_tile(sh, t, K, V, dstates_slab(b, rec));
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

// One block per (sequence, value head, column tile) of a scan kernel<kCols>.
template <int kCols>
void launch_scan(void (*kernel)(BackwardParams), const BackwardParams& b, void* stream) {
  const unsigned blocks = static_cast<unsigned>(b.p.N * b.p.HV * column_tiles(b.p.V, kCols));
  if (blocks == 0) return;
  set_shared_bytes(kernel, sizeof(ScanShared<kCols>));
  kernel<<<blocks, kBackwardThreads, sizeof(ScanShared<kCols>),
           static_cast<cudaStream_t>(stream)>>>(b);
}

// Calls launch with std::integral_constant<int, BackwardParams::scan_cols> (the host checked
// it is one of kScanColumnWidths).
template <class Launch>
void at_scan_width(const BackwardParams& b, const Launch& launch) {
  switch (b.scan_cols) {
    case 8: return launch(std::integral_constant<int, 8>{});
    case 16: return launch(std::integral_constant<int, 16>{});
    default: return launch(std::integral_constant<int, 32>{});
  }
}

}  // namespace

// The widest tile takes the most shared memory.
int64_t backward_scan_shared_bytes() { return sizeof(ScanShared<kScanColumnWidths[0]>); }

void launch_backward_states(const BackwardParams& b, void* stream) {
  at_scan_width(b, [&](auto cols) {
    constexpr int w = decltype(cols)::value;
    launch_scan<w>(states_kernel<w>, b, stream);
  });
}

void launch_backward_given_states(const BackwardParams& b, void* stream) {
  const int64_t blocks = b.max_chunks * b.p.HV;
  if (blocks == 0) return;
  constexpr size_t kShared = sizeof(ProductStage<32>);
  set_shared_bytes(given_states_kernel, kShared);
  given_states_kernel<<<static_cast<unsigned>(blocks), kBackwardThreads, kShared,
                        static_cast<cudaStream_t>(stream)>>>(b);
}

void launch_backward_dstates(const BackwardParams& b, void* stream) {
  at_scan_width(b, [&](auto cols) {
    constexpr int w = decltype(cols)::value;
    launch_scan<w>(dstates_kernel<w>, b, stream);
  });
}

}  // namespace flashdelta::detail::cuda
