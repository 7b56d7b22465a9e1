// The CUDA recurrent kernels' units of work and the state slots they read and write: a
// task is (sequence, value head, tile of value columns); serving rows start from a pool slot
// and write after the tokens the caller names. Internal to cuda/recurrent_kernel.cu and
// cuda/recurrent_warp_kernel.cu.
#pragma once

#include <climits>

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"
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

// The token tensors' element type (q, k, v, g, beta, o): bfloat16 fixed at compile time for
// the serving common case, or read from the arguments. Fixed, the dtype branches go: the
// warp kernel's K <= 128 instantiations fit 80 registers (24 warps per SM instead of 21;
// N = 256 1% faster than the block kernel instead of 2% slower, bench/NOTES.md (ag)), and
// the block kernel's narrow tile, whose one-token step is one thread's instruction chain,
// is shorter (bench/NOTES.md (bo)).
template <bool AllBf16>
struct TokenTypes {
  static constexpr bool kAllBf16 = AllBf16;
  __device__ static DType of(const TokenTensor& x) { return AllBf16 ? DType::bf16 : x.dtype; }
};

// Whether every token tensor the kernels read or write is bfloat16 (g and beta count only
// where they are read): TokenTypes<true> then applies.
inline bool all_bf16_tokens(const RecurrentParams& p) {
  const auto bf16 = [](const TokenTensor& x) { return x.dtype == DType::bf16; };
  return bf16(p.q) && bf16(p.k) && bf16(p.v) && bf16(p.o) &&
         (p.gate == GateForm::none || bf16(p.g)) && (!p.delta || bf16(p.beta));
}

// The task of a block on the task grid (value tiles, HV, N): its index, no division.
template <int VT>
__device__ Task task_of_grid(const RecurrentParams& p) {
  Task w;
  w.j0 = static_cast<int>(blockIdx.x) * VT;
  w.hv = static_cast<int>(blockIdx.y);
  w.n = blockIdx.z;
  w.start = start_slot(p, w.n);
  return w;
}

// Element offsets of token 0 of one row for each token tensor; token t adds t * stride[1].
struct RowOffsets {
  int64_t q, k, v, g, beta, o;
};

// The row of sequence `seq` for key head h and value head hv.
__device__ __forceinline__ RowOffsets row_offsets(const RecurrentParams& p, const Sequence& seq,
                                                  int64_t h, int64_t hv) {
  return {token_offset(p.q, seq, h),     token_offset(p.k, seq, h),
          token_offset(p.v, seq, hv),    token_offset(p.g, seq, hv),
          token_offset(p.beta, seq, hv), token_offset(p.o, seq, hv)};
}

// The state of (slot, hv) in a state tensor.
template <class S>
__device__ __forceinline__ S* tile_base(const StateTensor& st, int64_t slot, int64_t hv) {
  return static_cast<S*>(st.data) + slot * st.slot_stride + hv * st.head_stride;
}

}  // namespace
}  // namespace flashdelta::detail::cuda
