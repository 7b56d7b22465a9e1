// The CUDA recurrent kernel's thread geometry and its access to the state: which keys and
// columns of a state tile each thread holds, and the loads, stores and asynchronous
// prefetches of those values (cuda/recurrent_kernel.cu). Internal to that file.
#pragma once

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// Geometry for key bucket KB (K <= KB): a thread holds RK keys x 4 columns, KL key lanes x
// CL column lanes make a warp, which holds all keys of CL x 4 columns.
template <int KB, bool KeyContig>
struct Tile {
  static constexpr int RK = KB <= 64 ? KB / 8 : 16;  // keys per thread
  static constexpr int KL = KB / RK;                 // key lanes per warp
  static constexpr int CL = 32 / KL;                 // column lanes per warp (4 columns each)
  static constexpr int VT = kWarps * CL * 4;         // columns per block (any layout)
  // Lane bits that select the key lane: low bits when keys are contiguous in memory.
  static constexpr int kKeyLaneFirst = KeyContig ? 1 : CL;
  static constexpr int kKeyLaneLast = KeyContig ? KL / 2 : 16;
  // Blocks per SM the register budget is sized for: the values plus ~60 registers of
  // addresses and sums, without spills. Three blocks of 64 values per thread still keep
  // ~100 KB of state loads in flight per SM.
  static constexpr int kMinBlocks = RK * 4 >= 64 ? 3 : RK * 4 >= 32 ? 4 : 6;

  // The thread's keys: RK / 4 runs of 4, the key lanes' runs adjacent, so that a warp reads
  // a contiguous span of a key-contiguous state per load instruction, and q, k and the
  // decays from shared memory as conflict-free 16-byte reads.
  int key0;
  int column;  // first of this thread's 4 columns, within the block's tile
  bool writes_o;
  __device__ Tile() {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int kl = KeyContig ? lane % KL : lane / CL;
    const int cl = KeyContig ? lane / KL : lane % CL;
    key0 = kl * 4;
    column = (warp * CL + cl) * 4;
    writes_o = kl == 0;
  }
  __device__ int key(int r) const { return (r / 4) * (KL * 4) + key0 + r % 4; }
};

// The thread's RK x 4 state values as RK chunks of 4 elements along the state's contiguous
// axis: key-contiguous, chunk c = 4 g + e holds keys key(4 g)..+3 of column e; otherwise
// chunk c holds columns 0..3 of key row key(c). Out-of-range elements read 0 and are never
// written (`valid` counts the in-range ones).
struct Chunk {
  int64_t offset;  // from the thread's tile base
  int64_t step;    // between the chunk's elements
  int valid;
};

template <int KB, bool KeyContig>
__device__ __forceinline__ Chunk chunk_of(const RecurrentParams& p,
                                                         const StateTensor& st,
                                                         const Tile<KB, KeyContig>& tile,
                                                         int j0, int c) {
  using T = Tile<KB, KeyContig>;
  const int col = j0 + tile.column;
  if constexpr (KeyContig) {
    const int g = c / 4, e = c % 4;
    const int valid = col + e < p.V ? max(0, min(4, static_cast<int>(p.K) - tile.key(4 * g))) : 0;
    return {(col + e) * st.value_stride + tile.key(4 * g) * st.key_stride, st.key_stride, valid};
  } else {
    const int valid = tile.key(c) < p.K ? max(0, min(4, static_cast<int>(p.V) - col)) : 0;
    return {col * st.value_stride + tile.key(c) * st.key_stride, st.value_stride, valid};
  }
}

template <int RK, bool KeyContig>
__device__ __forceinline__ void set_chunk(float (&x)[RK][4], int c, const float (&run)[4]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (KeyContig) x[4 * (c / 4) + w][c % 4] = run[w];
    else x[c][w] = run[w];
  }
}

template <int RK, bool KeyContig>
__device__ __forceinline__ void get_chunk(const float (&x)[RK][4], int c, float (&run)[4]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) run[w] = KeyContig ? x[4 * (c / 4) + w][c % 4] : x[c][w];
}

template <int KB, bool KeyContig, class S>
__device__ void load_tile(const RecurrentParams& p, const StateTensor& st, const S* base,
                          const Tile<KB, KeyContig>& tile, int j0,
                          float (&x)[Tile<KB, KeyContig>::RK][4]) {
#pragma unroll
  for (int c = 0; c < Tile<KB, KeyContig>::RK; ++c) {
    const Chunk ch = chunk_of(p, st, tile, j0, c);
    float run[4];
    load_run<4>(base + ch.offset, ch.step, ch.valid, p.vector_ok, run);
    set_chunk<Tile<KB, KeyContig>::RK, KeyContig>(x, c, run);
  }
}

template <int KB, bool KeyContig, class S>
__device__ void store_tile(const RecurrentParams& p, const StateTensor& st, S* base,
                           const Tile<KB, KeyContig>& tile, int j0,
                           const float (&x)[Tile<KB, KeyContig>::RK][4]) {
#pragma unroll
  for (int c = 0; c < Tile<KB, KeyContig>::RK; ++c) {
    const Chunk ch = chunk_of(p, st, tile, j0, c);
    float run[4];
    get_chunk<Tile<KB, KeyContig>::RK, KeyContig>(x, c, run);
    store_run<4>(base + ch.offset, ch.step, ch.valid, p.vector_ok, run);
  }
}

// Asynchronous copies of the thread's chunks into its slots of a shared-memory buffer
// (chunk c of thread t at slot c * kThreads + t: a warp's reads are conflict-free); missing
// elements are zero-filled. Needs aligned chunks (vector_ok).
template <int KB, bool KeyContig, class S>
__device__ void prefetch_tile(const RecurrentParams& p, const StateTensor& st, const S* base,
                              const Tile<KB, KeyContig>& tile, int j0, S* buffer) {
  constexpr int kBytes = 4 * sizeof(S);
#pragma unroll
  for (int c = 0; c < Tile<KB, KeyContig>::RK; ++c) {
    const Chunk ch = chunk_of(p, st, tile, j0, c);
    copy_async<kBytes>(buffer + 4 * (c * kThreads + threadIdx.x), base + ch.offset,
                       ch.valid * static_cast<int>(sizeof(S)));
  }
}

template <int KB, bool KeyContig, class S>
__device__ void read_prefetched(const S* buffer, float (&x)[Tile<KB, KeyContig>::RK][4]) {
  using WordT = typename Word<4 * sizeof(S)>::type;
#pragma unroll
  for (int c = 0; c < Tile<KB, KeyContig>::RK; ++c) {
    const WordT w = *reinterpret_cast<const WordT*>(buffer + 4 * (c * kThreads + threadIdx.x));
    const S* e = reinterpret_cast<const S*>(&w);
    float run[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) run[i] = to_float(e[i]);
    set_chunk<Tile<KB, KeyContig>::RK, KeyContig>(x, c, run);
  }
}

// The state of (slot, hv) in a state tensor.
template <class S>
__device__ __forceinline__ S* tile_base(const StateTensor& st, int64_t slot, int64_t hv) {
  return static_cast<S*>(st.data) + slot * st.slot_stride + hv * st.head_stride;
}

}  // namespace
}  // namespace flashdelta::detail::cuda
