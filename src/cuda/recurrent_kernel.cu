// The CUDA recurrent schedule. The work is split into tasks, one per (sequence, value head,
// tile of VT value columns), one thread block each. A task's K x VT state tile is copied
// into shared memory asynchronously while the first token's inputs load, updated there for
// every token, and written once per written slot with streaming stores. Decode is bound by
// the bytes of state in flight per SM: with the tile in shared memory instead of registers
// six blocks share an SM, and the hardware starts a new block as soon as one ends.
//
// Per token the block stages q, k, the decays exp(g) and beta in shared memory (fusing the
// L2 norms, sigmoid and gate activation: one key channel per thread, so once per block),
// then every thread decays its values and forms its partial sums of k^T S and q^T S per
// column. With S' = Diag(exp g) S and r = beta (v - S'^T k):
//     S'' = S' + k r^T,    o = S''^T q = S'^T q + (q . k) r,
// so one reduction pass over S' yields both the prediction and the output, and a second
// pass writes S''.
//
// Thread mapping (cuda/recurrent_tile.cuh): a thread owns RK keys x 4 adjacent columns and
// a warp all the keys of its columns, so a column sum is an in-thread sum and a few
// shuffles, with no shared-memory reduction and no barrier. RK is 16 at K = 128 (the wide
// tile) for many sequences, 4 (the narrow tile, 4x the blocks) for few; the host picks. The
// narrow tile on a K-first state splits the keys over its warps instead, and their column
// sums meet in shared memory behind one barrier (sum_over_key_warps).
#include <climits>
#include <string>

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
#include "cuda/recurrent_task.cuh"
#include "cuda/recurrent_tile.cuh"
#include "cuda/recurrent_token.cuh"

namespace flashdelta::detail::cuda {
namespace {

// The column sums of a tile whose warps split the keys: each warp's sums (the same in all
// its key lanes) through shared memory, added in warp order.
template <class T>
__device__ void sum_over_key_warps(Shared& sh, const T& tile, float (&pred)[4], float (&out)[4]) {
  static_assert(T::VT <= 32, "columns of Shared::columns");
  const int warp = threadIdx.x / 32;
  if (tile.key_lane == 0)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sh.columns[warp][0][tile.column + e] = pred[e];
      sh.columns[warp][1][tile.column + e] = out[e];
    }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    pred[e] = out[e] = 0.f;
#pragma unroll
    for (int w = 0; w < T::KW; ++w) {
      pred[e] += sh.columns[w][0][tile.column + e];
      out[e] += sh.columns[w][1][tile.column + e];
    }
  }
}

// Processes one task with its state tile in `state` (this block's shared memory); Tk: the
// token tensors' types (TokenTypes).
template <int KB, int RK, bool KeyContig, class S, class Tk>
__device__ void run_task(const RecurrentParams& p, Shared& sh, const Tile<KB, RK, KeyContig>& tile,
                         const Task& w, S* state) {
  using T = Tile<KB, RK, KeyContig>;
  // The key head in 32-bit arithmetic (w.hv is an int): a 64-bit division is a long call on
  // the critical path of a one-token step. (The warp kernel's multiply-shift moved the wide
  // tile's registers at K = 64 into 48 bytes of spills.)
  const int64_t n = w.n, hv = w.hv,
                h = p.group <= INT_MAX ? w.hv / static_cast<int>(p.group) : hv / p.group;
  const int j0 = w.j0;
  const Sequence seq = sequence_of(p, n);
  const RowOffsets row = row_offsets(p, seq, h, hv);
  const int col = j0 + tile.column;

  // Token 0's loads. The narrow tile (few sequences) issues them before the slot index is
  // back (a padding row's are unused): at one token per task the index -> state chain is
  // then the step's only exposed latency, with the token's transform and barrier
  // (stage_token) under the state's loads. The wide tile issues them with the state copy:
  // held across the index wait they cost it 12-44 bytes of spills (ptxas).
  TokenRaw<KB> raw;
  uint32_t a_raw = 0u;
  const auto fetch_first_token = [&] {
    if (seq.len > 0) fetch_token<KB, Tk>(p, row, 0, hv, col, raw);
    if (p.A_log) a_raw = load_raw(p.A_log, p.A_log_dtype, hv * p.A_log_stride);
  };
  if constexpr (T::kNarrow) fetch_first_token();

  if (w.start < 0) {  // padding row: zeros out, no state touched
    for (int64_t e = threadIdx.x; e < seq.len * T::VT; e += kThreads) {
      const int j = j0 + static_cast<int>(e % T::VT);
      if (j < p.V)
        store_float(const_cast<void*>(p.o.data), Tk::of(p.o),
                    row.o + (e / T::VT) * p.o.stride[1] + j * p.o.stride[3], 0.f);
    }
    return;
  }
  if (p.serving && !p.per_token_slots && seq.len == 0) return;  // nothing to update

  if (p.state_in.data)
    stage_state(p, p.state_in, tile_base<const S>(p.state_in, w.start, hv), tile, j0, state);
  else
    zero_state<RK>(state);
  if constexpr (!T::kNarrow) fetch_first_token();
  const float a = p.A_log ? expf(raw_to_float(a_raw, p.A_log_dtype)) : 1.f;
  // Each thread reads only the slots it copied: no barrier. On K-first states the first
  // pass waits run by run instead (wait_state_run). The runs land about together, so this
  // overlaps nothing (measured), but the compiler then schedules the K = 128 wide loop
  // without spills: 2% faster at N = 256. On V-first states the same waits make that loop
  // spill (56 bytes) and 6% slower, so there it waits once, here (bench/NOTES.md (af)).
  if constexpr (KeyContig) wait_async<0>();

  for (int64_t t = 0; t < seq.len; ++t) {
    if (t > 0) fetch_token<KB, Tk>(p, row, t, hv, col, raw);
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = raw_to_float(raw.v[e], Tk::of(p.v));
    stage_token<KB, Tk>(p, sh, raw, a);

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

    // Pass 1: decay, then the partial column sums k^T S' and q^T S' over this thread's keys.
    float pred[4] = {0.f, 0.f, 0.f, 0.f}, out[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int g = 0; g < T::RK / 4; ++g) {
      if constexpr (!KeyContig) wait_state_run<T::RK / 4>(g);
      const KeyRun4 kr = key_run(p, sh, tile.key(4 * g));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float x[4];
        read_chunk(state, 4 * g + i, x);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int u = KeyContig ? m : i, e = KeyContig ? i : m;  // key u of the run, column e
          const float xd = x[m] * kr.d[u];
          pred[e] = fmaf(kr.k[u], xd, pred[e]);
          out[e] = fmaf(kr.q[u], xd, out[e]);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pred[e] = lane_sum<T::kKeyLaneFirst, T::kKeyLaneLast>(pred[e]);
      out[e] = lane_sum<T::kKeyLaneFirst, T::kKeyLaneLast>(out[e]);
    }
    if constexpr (T::KW > 1) sum_over_key_warps(sh, tile, pred, out);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pred[e] *= k_mul;
      out[e] *= q_mul;
    }

    // The delta-rule write r and the output o = q^T S' + (q . k) r.
    float r_col[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) r_col[e] = p.delta ? sh.beta * (v[e] - pred[e]) : v[e];
    if (tile.writes_o) {
      const int64_t oo = row.o + t * p.o.stride[1];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (col + e < p.V)
          store_float(const_cast<void*>(p.o.data), Tk::of(p.o), oo + (col + e) * p.o.stride[3],
                      fmaf(qk, r_col[e], out[e]));
    }

    // Pass 2: S'' = S' + k r^T, kept for the next token and written to its slot, if any.
    const int64_t slot = slot_after(p, n, t, seq.len, w.start);
    S* const dst = slot >= 0 ? tile_base<S>(p.state_out, slot, hv) : nullptr;
    const bool more = t + 1 < seq.len;
#pragma unroll
    for (int g = 0; g < T::RK / 4; ++g) {
      const KeyRun4 kr = key_run(p, sh, tile.key(4 * g));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float x[4];
        read_chunk(state, 4 * g + i, x);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int u = KeyContig ? m : i, e = KeyContig ? i : m;
          x[m] = fmaf(kr.k[u] * k_mul, r_col[e], x[m] * kr.d[u]);
        }
        if (more) write_chunk(state, 4 * g + i, x);
        if (dst) store_chunk(p, p.state_out, dst, tile, j0, 4 * g + i, x);
      }
    }
    if (more) __syncthreads();  // shared staging is rewritten next token
  }
  wait_async<0>();  // an empty sequence's copies (no pass waited for them)
  if (!p.serving && seq.len == 0 && p.state_out.data) {  // empty sequence: state passes through
    S* const dst = tile_base<S>(p.state_out, n, hv);
#pragma unroll
    for (int c = 0; c < T::RK; ++c) {
      float x[4];
      read_chunk(state, c, x);
      store_chunk(p, p.state_out, dst, tile, j0, c, x);
    }
  }
}

// One block per task: on the task grid (value tiles, HV, N) the block's index, else a
// grid-stride loop over task numbers (past 65,535 sequences or heads). Blocks are short and
// many, so the hardware balances them over the SMs and the tail is one block long. Only the
// narrow tile (32 < K <= 128: at other K it is the wide one) takes the task grid: it runs
// few sequences, where a one-token step is one thread's instruction chain and the grid
// saves its divisions; in the wide tile's 80-96 registers a second path costs spills
// (ptxas: up to 124 bytes) to save ~100 instructions beside its 64-element passes.
template <int KB, int RK, bool KeyContig, class S, class Tk>
__global__ void __launch_bounds__(kThreads, Tile<KB, RK, KeyContig>::kMinBlocks)
    recurrent_kernel(const __grid_constant__ RecurrentParams p) {
  using T = Tile<KB, RK, KeyContig>;
  __shared__ Shared sh;
  __shared__ __align__(16) S state[T::kTileElements];
  const T tile;
  if constexpr (T::kNarrow)
    if (p.task_grid)
      return run_task<KB, RK, KeyContig, S, Tk>(p, sh, tile, task_of_grid<T::VT>(p), state);
  const int64_t blocks = p.N * p.HV * p.value_tiles;
  for (int64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    run_task<KB, RK, KeyContig, S, Tk>(p, sh, tile, task_of<T::VT>(p, blk, blocks), state);
    if (blk + gridDim.x < blocks) __syncthreads();  // the next task reuses the staging
  }
}

template <int KB, int RK, bool KeyContig, class S, class Tk>
void launch_tile(const RecurrentParams& p, cudaStream_t stream) {
  const int64_t blocks = p.N * p.HV * p.value_tiles;
  const bool task_grid = p.task_grid && Tile<KB, RK, KeyContig>::kNarrow;
  const dim3 grid = task_grid ? dim3(static_cast<unsigned>(p.value_tiles),
                                       static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N))
                                : dim3(static_cast<unsigned>(blocks < INT_MAX ? blocks : INT_MAX));
  recurrent_kernel<KB, RK, KeyContig, S, Tk><<<grid, kThreads, 0, stream>>>(p);
}

// The narrow tile on a K-first state at K = 128 (few sequences: a one-token step is one
// thread's instruction chain) has a bfloat16-token instantiation; the rest read the dtypes.
// (At K = 64 that instantiation spills 24 bytes: not built until measured.)
template <int KB, bool KeyContig, class S>
void launch(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N * p.HV * p.value_tiles == 0) return;
  constexpr int wide = wide_keys_per_thread(KB), narrow = narrow_keys_per_thread(KB);
  if constexpr (narrow != wide)
    if (p.tile == RecurrentTile::narrow) {
      if constexpr (!KeyContig && KB == 128)
        if (all_bf16_tokens(p))
          return launch_tile<KB, narrow, KeyContig, S, TokenTypes<true>>(p, stream);
      return launch_tile<KB, narrow, KeyContig, S, TokenTypes<false>>(p, stream);
    }
  launch_tile<KB, wide, KeyContig, S, TokenTypes<false>>(p, stream);
}

template <bool KeyContig, class S>
void launch_for_k(const RecurrentParams& p, cudaStream_t stream) {
  if (p.K <= 32) return launch<32, KeyContig, S>(p, stream);
  if (p.K <= 64) return launch<64, KeyContig, S>(p, stream);
  if (p.K <= 128) return launch<128, KeyContig, S>(p, stream);
  return launch<256, KeyContig, S>(p, stream);
}

template <int KB>
int64_t block_columns(RecurrentTile t) {
  constexpr int narrow = narrow_keys_per_thread(KB);
  static_assert(Tile<KB, narrow, true>::VT == Tile<KB, narrow, false>::VT, "VT by layout");
  return t == RecurrentTile::narrow ? Tile<KB, narrow, true>::VT
                                    : Tile<KB, wide_keys_per_thread(KB), true>::VT;
}

template <class S>
void launch_for_layout(const RecurrentParams& p, bool key_contiguous, cudaStream_t stream) {
  if (key_contiguous) return launch_for_k<true, S>(p, stream);
  return launch_for_k<false, S>(p, stream);
}

}  // namespace

// The tile width depends on the key bucket and the tile, not on the layout.
int64_t recurrent_block_columns(int64_t K, RecurrentTile tile) {
  return K <= 32 ? block_columns<32>(tile) : K <= 64 ? block_columns<64>(tile)
       : K <= 128 ? block_columns<128>(tile) : block_columns<256>(tile);
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
