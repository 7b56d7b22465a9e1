// The CUDA recurrent schedule. The work is split into tasks, one per (sequence, value head,
// tile of VT value columns), walked by persistent blocks (as many as fit on the GPU). A
// task's K x VT state tile lives in registers while its tokens run, read once and written
// once with streaming accesses; while a block computes one task, the next task's state is
// copied into shared memory asynchronously, so the state loads stay in flight and decode
// runs near the memory bandwidth of the state.
//
// Per token the block stages q, k, the decays exp(g) and beta in shared memory (fusing the
// L2 norms, sigmoid and gate activation: one key channel per thread, so once per block),
// then every thread decays its values and forms its partial sums of k^T S and q^T S per
// column. With S' = Diag(exp g) S and r = beta (v - S'^T k):
//     S'' = S' + k r^T,    o = S''^T q = S'^T q + (q . k) r,
// so one reduction pass over S' yields both the prediction and the output.
//
// Thread mapping (cuda/recurrent_tile.cuh): a thread holds RK keys x 4 adjacent columns and
// a warp all the keys of its columns, so a column sum is an in-thread sum and a few
// shuffles, with no shared memory and no barrier. Per-thread work is large (up to 64
// values) so that the per-token fixed costs (staging, addressing) are spread thin.
#include <atomic>
#include <climits>
#include <string>

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
#include "cuda/recurrent_tile.cuh"
#include "cuda/recurrent_token.cuh"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

// Slot the row starts from; -1 = padding row (also for out-of-range device indices).
__device__ int64_t start_slot(const RecurrentParams& p, int64_t n) {
  if (!p.serving) return n;
  const int64_t col =
      p.per_token_slots && p.num_accepted.data ? load_index(p.num_accepted, n, 0) - 1 : 0;
  if (col < 0 || col >= p.state_indices.cols) return -1;
  const int64_t s = load_index(p.state_indices, n, col);
  return s >= 0 && s < p.pool_slots ? s : -1;
}

// Slot written after local token t of a row of `len` tokens (-1 = none).
__device__ int64_t slot_after(const RecurrentParams& p, int64_t n, int64_t t, int64_t len,
                              int64_t start) {
  if (!p.serving) return t + 1 == len && p.state_out.data ? n : -1;
  if (!p.per_token_slots) return t + 1 == len ? start : -1;
  if (t >= p.state_indices.cols) return -1;
  const int64_t s = load_index(p.state_indices, n, t);
  return s >= 0 && s < p.pool_slots ? s : -1;
}

// One unit of work: the value-column tile j0 of head hv of sequence n = blk / (tiles HV).
// Kept small (three are live at once); the sequence is looked up when the task runs.
struct Task {
  int64_t blk = -1, n = 0, start = -1;  // start: slot read first (-1 = padding row or none)
  int hv = 0, j0 = 0;
};

template <int VT>
__device__ Task task_of(const RecurrentParams& p, int64_t blk, int64_t blocks) {
  Task w;
  if (blk >= blocks) return w;
  w.blk = blk;
  // 32-bit index arithmetic where it fits (64-bit division is a long instruction sequence).
  if (blocks <= INT_MAX) {
    const unsigned b = static_cast<unsigned>(blk), tiles = static_cast<unsigned>(p.value_tiles);
    const unsigned heads = static_cast<unsigned>(p.HV);
    w.j0 = static_cast<int>(b % tiles) * VT;
    w.hv = static_cast<int>((b / tiles) % heads);
    w.n = b / (tiles * heads);
  } else {
    w.j0 = static_cast<int>(blk % p.value_tiles) * VT;
    w.hv = static_cast<int>((blk / p.value_tiles) % p.HV);
    w.n = blk / (p.value_tiles * p.HV);
  }
  w.start = start_slot(p, w.n);
  return w;
}

// Processes one task; its initial state is in `buffer` when prefetched, else loaded here.
template <int KB, bool KeyContig, class S>
__device__ void run_task(const RecurrentParams& p, Shared& sh, const Tile<KB, KeyContig>& tile,
                         const Task& w, bool prefetched, const S* buffer) {
  using T = Tile<KB, KeyContig>;
  const int64_t n = w.n, hv = w.hv, h = hv / p.group;
  const int j0 = w.j0;
  const Sequence seq = sequence_of(p, n);
  const RowOffsets row{token_offset(p.q, seq, h),    token_offset(p.k, seq, h),
                       token_offset(p.v, seq, hv),   token_offset(p.g, seq, hv),
                       token_offset(p.beta, seq, hv), token_offset(p.o, seq, hv)};
  const int col = j0 + tile.column;

  if (w.start < 0) {  // padding row: zeros out, no state touched
    for (int64_t e = threadIdx.x; e < seq.len * T::VT; e += kThreads) {
      const int j = j0 + static_cast<int>(e % T::VT);
      if (j < p.V)
        store_float(const_cast<void*>(p.o.data), p.o.dtype,
                    row.o + (e / T::VT) * p.o.stride[1] + j * p.o.stride[3], 0.f);
    }
    return;
  }
  if (p.serving && !p.per_token_slots && seq.len == 0) {  // nothing to update
    if (prefetched) wait_async<1>();
    return;
  }

  // Token 0's loads go out before the state is read: the latencies overlap.
  TokenRaw<KB> raw;
  if (seq.len > 0) fetch_token<KB>(p, row, 0, hv, col, raw);
  const uint32_t a_raw = p.A_log ? load_raw(p.A_log, p.A_log_dtype, hv * p.A_log_stride) : 0u;
  float x[T::RK][4];
  if (prefetched) {
    wait_async<1>();  // all but the newest group (the next task's) have landed
    read_prefetched<KB, KeyContig, S>(buffer, x);
  } else if (p.state_in.data) {
    load_tile<KB, KeyContig, S>(p, p.state_in, tile_base<const S>(p.state_in, w.start, hv),
                                tile, j0, x);
  } else {
#pragma unroll
    for (int r = 0; r < T::RK; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[r][e] = 0.f;
  }
  const float a = p.A_log ? expf(raw_to_float(a_raw, p.A_log_dtype)) : 1.f;

  for (int64_t t = 0; t < seq.len; ++t) {
    if (t > 0) fetch_token<KB>(p, row, t, hv, col, raw);
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = raw_to_float(raw.v[e], p.v.dtype);
    stage_token<KB>(p, sh, raw, a);

    float sq = 0.f, sk = 0.f, sqk = 0.f;
#pragma unroll
    for (int wp = 0; wp < kWarps; ++wp) {
      sq += sh.partial[wp][0];
      sk += sh.partial[wp][1];
      sqk += sh.partial[wp][2];
    }
    const float q_mul = p.scale * (p.qk_l2norm ? rsqrtf(sq + kL2NormEps) : 1.f);
    const float k_mul = p.qk_l2norm ? rsqrtf(sk + kL2NormEps) : 1.f;
    const float qk = sqk * q_mul * k_mul;
    const bool vector_gate = p.gate == GateForm::vector;

    // Decay, then the partial column sums k^T S' and q^T S' over this thread's keys.
    float pred[4] = {0.f, 0.f, 0.f, 0.f}, out[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int g = 0; g < T::RK / 4; ++g) {
      const int i = tile.key(4 * g);
      const float4 d4 = vector_gate ? *reinterpret_cast<const float4*>(&sh.decay[i])
                                    : make_float4(sh.scalar_decay, sh.scalar_decay,
                                                  sh.scalar_decay, sh.scalar_decay);
      const float4 k4 = *reinterpret_cast<const float4*>(&sh.k[i]);
      const float4 q4 = *reinterpret_cast<const float4*>(&sh.q[i]);
      const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kr[4] = {k4.x, k4.y, k4.z, k4.w};
      const float qr[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& xv = x[4 * g + u][e];
          xv *= d[u];
          pred[e] = fmaf(kr[u], xv, pred[e]);
          out[e] = fmaf(qr[u], xv, out[e]);
        }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pred[e] = lane_sum<T::kKeyLaneFirst, T::kKeyLaneLast>(pred[e]);
      out[e] = lane_sum<T::kKeyLaneFirst, T::kKeyLaneLast>(out[e]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pred[e] *= k_mul;
      out[e] *= q_mul;
    }

    // The delta-rule write and the output o = q^T S' + (q . k) r.
    float r_col[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) r_col[e] = p.delta ? sh.beta * (v[e] - pred[e]) : v[e];
#pragma unroll
    for (int g = 0; g < T::RK / 4; ++g) {
      const float4 k4 = *reinterpret_cast<const float4*>(&sh.k[tile.key(4 * g)]);
      const float kr[4] = {k4.x * k_mul, k4.y * k_mul, k4.z * k_mul, k4.w * k_mul};
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[4 * g + u][e] = fmaf(kr[u], r_col[e], x[4 * g + u][e]);
    }
    if (tile.writes_o) {
      const int64_t oo = row.o + t * p.o.stride[1];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (col + e < p.V)
          store_float(const_cast<void*>(p.o.data), p.o.dtype, oo + (col + e) * p.o.stride[3],
                      fmaf(qk, r_col[e], out[e]));
    }

    const int64_t slot = slot_after(p, n, t, seq.len, w.start);
    if (slot >= 0)
      store_tile<KB, KeyContig, S>(p, p.state_out, tile_base<S>(p.state_out, slot, hv),
                                   tile, j0, x);
    if (t + 1 < seq.len) __syncthreads();  // shared staging is rewritten next token
  }
  if (!p.serving && seq.len == 0 && p.state_out.data)  // empty sequence: state passes through
    store_tile<KB, KeyContig, S>(p, p.state_out, tile_base<S>(p.state_out, n, hv),
                                 tile, j0, x);
}

// Bytes of the two prefetch buffers one block uses.
template <int KB, bool KeyContig, class S>
constexpr int prefetch_bytes() {
  return 2 * Tile<KB, KeyContig>::RK * kThreads * 4 * static_cast<int>(sizeof(S));
}

// Persistent blocks: each walks tasks blockIdx.x, + gridDim.x, ... and, when the state
// allows aligned chunks, copies the next task's state into shared memory while it computes
// the current one, so the state loads stay in flight through the whole computation.
template <int KB, bool KeyContig, class S>
__global__ void __launch_bounds__(kThreads, Tile<KB, KeyContig>::kMinBlocks)
    recurrent_kernel(const __grid_constant__ RecurrentParams p) {
  using T = Tile<KB, KeyContig>;
  __shared__ Shared sh;
  extern __shared__ __align__(16) unsigned char prefetch_smem[];
  S* buffers[2] = {reinterpret_cast<S*>(prefetch_smem),
                   reinterpret_cast<S*>(prefetch_smem) + T::RK * kThreads * 4};
  const Tile<KB, KeyContig> tile;
  const int64_t blocks = p.N * p.HV * p.value_tiles;
  const bool pipelined = p.vector_ok && p.state_in.data != nullptr;

  auto prefetch = [&](const Task& w, int b) {
    if (pipelined && w.start >= 0)
      prefetch_tile<KB, KeyContig, S>(p, p.state_in,
                                      tile_base<const S>(p.state_in, w.start, w.hv),
                                      tile, w.j0, buffers[b]);
    commit_async();
  };

  int64_t blk = blockIdx.x;
  Task cur = task_of<T::VT>(p, blk, blocks);
  Task next = task_of<T::VT>(p, blk + gridDim.x, blocks);
  int b = 0;
  prefetch(cur, b);
  while (blk < blocks) {
    prefetch(next, b ^ 1);
    const Task after = task_of<T::VT>(p, blk + 2 * static_cast<int64_t>(gridDim.x), blocks);
    run_task<KB, KeyContig, S>(p, sh, tile, cur, pipelined && cur.start >= 0, buffers[b]);
    __syncthreads();  // the next task's staging reuses shared memory
    cur = next;
    next = after;
    blk += gridDim.x;
    b ^= 1;
  }
  wait_async<0>();
}

// Resident blocks per SM x SMs of the current device, computed once per kernel and device.
template <int KB, bool KeyContig, class S>
int64_t resident_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 = not yet known
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  if (cached[device].load(std::memory_order_relaxed) == 0) {
    const auto kernel = recurrent_kernel<KB, KeyContig, S>;
    constexpr int smem = prefetch_bytes<KB, KeyContig, S>();
    int sms = 0, per_sm = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) !=
            cudaSuccess)
      return 0;
    cached[device].store(sms * (per_sm > 0 ? per_sm : 1), std::memory_order_relaxed);
  }
  return cached[device].load(std::memory_order_relaxed);
}

template <int KB, bool KeyContig, class S>
void launch(const RecurrentParams& p, cudaStream_t stream) {
  const int64_t blocks = p.N * p.HV * p.value_tiles;
  if (blocks == 0) return;
  const int64_t resident = resident_blocks<KB, KeyContig, S>();
  if (resident == 0) {
    const cudaError_t err = cudaGetLastError();
    throw Error(ErrorCode::runtime,
                std::string("CUDA recurrent kernel setup failed on the current device: ") +
                    cudaGetErrorString(err));
  }
  const int64_t grid = blocks < resident ? blocks : resident;
  recurrent_kernel<KB, KeyContig, S>
      <<<static_cast<unsigned>(grid), kThreads, prefetch_bytes<KB, KeyContig, S>(), stream>>>(p);
}

template <bool KeyContig, class S>
void launch_for_k(const RecurrentParams& p, cudaStream_t stream) {
  if (p.K <= 32) return launch<32, KeyContig, S>(p, stream);
  if (p.K <= 64) return launch<64, KeyContig, S>(p, stream);
  if (p.K <= 128) return launch<128, KeyContig, S>(p, stream);
  return launch<256, KeyContig, S>(p, stream);
}

template <class S>
void launch_for_layout(const RecurrentParams& p, bool key_contiguous, cudaStream_t stream) {
  if (key_contiguous) return launch_for_k<true, S>(p, stream);
  return launch_for_k<false, S>(p, stream);
}

}  // namespace

// The tile width depends on the key bucket only, not on the layout.
int64_t recurrent_block_columns(int64_t K) {
  return K <= 32 ? Tile<32, true>::VT : K <= 64 ? Tile<64, true>::VT
       : K <= 128 ? Tile<128, true>::VT : Tile<256, true>::VT;
}

void launch_recurrent(const RecurrentParams& p, DType state_dtype, bool key_contiguous,
                      void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (state_dtype == DType::bf16)
    launch_for_layout<__nv_bfloat16>(p, key_contiguous, s);
  else
    launch_for_layout<float>(p, key_contiguous, s);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(ErrorCode::runtime,
                std::string("CUDA recurrent kernel launch failed: ") + cudaGetErrorString(err));
}

}  // namespace flashdelta::detail::cuda
