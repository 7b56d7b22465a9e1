// The CUDA recurrent kernel's thread geometry and its access to the state: which keys and
// columns of a state tile each thread owns, the tile's shared-memory slots, and the copies
// between those slots and the state tensors (cuda/recurrent_kernel.cu). Internal to that file.
#pragma once

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {
namespace {

// Blocks of 4 warps. The wide tile, 16 keys x 4 columns per thread (a 32 KB fp32 tile at
// K = 128), is for many sequences: measured against 1, 2 and 8 warps and 8 or 32 keys per
// thread (bench/NOTES.md), this size amortises the per-block staging while 6 blocks still
// share an SM. The narrow tile, 4 keys per thread (8 KB, 16 columns at K = 128), is for few
// sequences, where latency rules: four times the blocks over the SMs, and each thread's two
// passes over its state a quarter as long.
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

constexpr int wide_keys_per_thread(int KB) { return KB <= 64 ? KB / 8 : 16; }
constexpr int narrow_keys_per_thread(int KB) { return KB <= 128 ? 4 : wide_keys_per_thread(KB); }

// Geometry for key bucket KB (K <= KB) and RK keys per thread: a thread owns RK keys x 4
// columns, KL key lanes x CL column lanes make a warp, and KW warps split the keys of the
// block's columns. KW = 1 (a warp owns all keys of its CL x 4 columns: column sums without
// a barrier) except for the narrow tile on a state whose values are contiguous: there one
// warp over all keys would read 16 bytes per key row, so the 4 warps split the keys, each
// reading 64-byte row segments, and the column sums meet in shared memory.
template <int KB, int RK_, bool KeyContig>
struct Tile {
  static constexpr int RK = RK_;  // keys per thread
  static constexpr bool kNarrow = RK < wide_keys_per_thread(KB);
  static constexpr int KW = kNarrow && !KeyContig ? kWarps : 1;  // warps over the keys
  static_assert(RK % 4 == 0 && KB / (RK * KW) <= 32, "keys per thread: runs of 4");
  static constexpr int KL = KB / (RK * KW);           // key lanes per warp
  static constexpr int CL = 32 / KL;                  // column lanes per warp (4 columns each)
  static constexpr int VT = kWarps / KW * CL * 4;     // columns per block (any layout)
  // Lane bits that select the key lane: low bits when keys are contiguous in memory.
  static constexpr int kKeyLaneFirst = KeyContig ? 1 : CL;
  static constexpr int kKeyLaneLast = KeyContig ? KL / 2 : 16;
  // Blocks per SM the register budget is sized for, without spills (the state is in shared
  // memory: 32 KB per block at most, so 6 blocks keep ~190 KB of state loads in flight per
  // SM; K = 256 stages two key channels per thread and needs more registers). The narrow
  // tile runs where its blocks are too few to fill those slots: its budget is 4 blocks per
  // SM, which keeps its shorter passes free of spills.
  static constexpr int kMinBlocks = kNarrow ? 4 : KB >= 256 ? 5 : 6;
  // Elements of one block's state tile in shared memory (32 KB in fp32 at most, so that 6
  // blocks share an SM).
  static constexpr int kTileElements = RK * kThreads * 4;
  static_assert(kTileElements * 4 <= 32 * 1024, "state tile past 32 KB");

  // The thread's keys: RK / 4 runs of 4, the key lanes' runs adjacent, so that a warp reads
  // a contiguous span of a key-contiguous state per load instruction, and q, k and the
  // decays from shared memory as conflict-free 16-byte reads.
  int key0;
  int key_lane;
  int column;  // first of this thread's 4 columns, within the block's tile
  bool writes_o;
  __device__ Tile() {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int kl = KeyContig ? lane % KL : lane / CL;
    const int cl = KeyContig ? lane / KL : lane % CL;
    key_lane = kl;
    key0 = (KW > 1 ? warp * KL * RK : 0) + kl * 4;
    column = ((KW > 1 ? 0 : warp) * CL + cl) * 4;
    writes_o = kl == 0 && (KW == 1 || warp == 0);
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

template <int KB, int RK, bool KeyContig>
__device__ __forceinline__ Chunk chunk_of(const RecurrentParams& p,
                                                         const StateTensor& st,
                                                         const Tile<KB, RK, KeyContig>& tile,
                                                         int j0, int c) {
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

// The thread's state tile lives in shared memory, chunk c of thread t at slot
// c * kThreads + t (4 elements): a warp's accesses are conflict-free, and no thread reads a
// slot another thread writes, so the state needs no barrier. Keeping it out of registers
// lets 6 blocks share an SM, whose state loads are all in flight at once: decode is bound
// by the bytes in flight per SM, not by arithmetic.
template <class S>
__device__ __forceinline__ S* slot_of(S* state, int c) {
  return state + 4 * (c * kThreads + threadIdx.x);
}

// Copies the thread's chunks of one state tile into its shared-memory slots: asynchronous
// 16-byte (8 for bfloat16) copies when the tensor allows aligned runs (vector_ok),
// otherwise element by element. Missing elements read as 0. Commits one group per run of 4
// chunks (RK / 4 groups, in order); the caller waits for them (wait_state_run, or
// wait_async<0> for all) before reading.
template <int KB, int RK, bool KeyContig, class S>
__device__ void stage_state(const RecurrentParams& p, const StateTensor& st, const S* base,
                            const Tile<KB, RK, KeyContig>& tile, int j0, S* state) {
  constexpr int kBytes = 4 * sizeof(S);
#pragma unroll
  for (int c = 0; c < RK; ++c) {
    const Chunk ch = chunk_of(p, st, tile, j0, c);
    if (p.vector_ok) {
      copy_async<kBytes>(slot_of(state, c), base + ch.offset,
                         ch.valid * static_cast<int>(sizeof(S)));
    } else {
      S* slot = slot_of(state, c);
#pragma unroll
      for (int w = 0; w < 4; ++w) slot[w] = w < ch.valid ? base[ch.offset + w * ch.step] : S{};
    }
    if (c % 4 == 3) commit_async();
  }
}

// Waits until run g of the thread's RK / 4 = G state copy groups has landed (runs land in
// order; a no-op once all have). cp.async.wait_group takes an immediate: unrolled callers
// fold the switch to one instruction.
template <int G>
__device__ __forceinline__ void wait_state_run(int g) {
  static_assert(G >= 1 && G <= 4, "runs of 4 chunks per thread: 1 to 4");
  switch (G - 1 - g) {
    case 3: wait_async<3>(); break;
    case 2: wait_async<2>(); break;
    case 1: wait_async<1>(); break;
    default: wait_async<0>(); break;
  }
}

template <int RK, class S>
__device__ void zero_state(S* state) {
#pragma unroll
  for (int c = 0; c < RK; ++c) {
    S* slot = slot_of(state, c);
#pragma unroll
    for (int w = 0; w < 4; ++w) slot[w] = S{};
  }
}

// Chunk c of the thread's slots as floats. The volatile load is re-issued on every pass
// over the state, so the compiler cannot keep the tile in registers between passes (which
// would bring back the register footprint the shared tile exists to avoid).
__device__ __forceinline__ void read_chunk(const float* state, int c, float (&run)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(slot_of(state, c)));
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(run[0]), "=f"(run[1]), "=f"(run[2]), "=f"(run[3])
               : "r"(a));
}
__device__ __forceinline__ void read_chunk(const __nv_bfloat16* state, int c, float (&run)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(slot_of(state, c)));
  unsigned lo, hi;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(lo), "=r"(hi) : "r"(a));
  run[0] = __uint_as_float(lo << 16);
  run[1] = __uint_as_float(lo & 0xffff0000u);
  run[2] = __uint_as_float(hi << 16);
  run[3] = __uint_as_float(hi & 0xffff0000u);
}

// Writes chunk c of the thread's slots; volatile like read_chunk, so the two stay in order.
__device__ __forceinline__ void write_chunk(float* state, int c, const float (&run)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(slot_of(state, c)));
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "f"(run[0]), "f"(run[1]),
               "f"(run[2]), "f"(run[3]));
}
__device__ __forceinline__ void write_chunk(__nv_bfloat16* state, int c, const float (&run)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(slot_of(state, c)));
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(a), "r"(pack_bf16(run[0], run[1])),
               "r"(pack_bf16(run[2], run[3])));
}

// Writes chunk c (as floats) to its place in a state tensor.
template <int KB, int RK, bool KeyContig, class S>
__device__ __forceinline__ void store_chunk(const RecurrentParams& p, const StateTensor& st,
                                            S* base, const Tile<KB, RK, KeyContig>& tile, int j0,
                                            int c, const float (&run)[4]) {
  const Chunk ch = chunk_of(p, st, tile, j0, c);
  store_run<4>(base + ch.offset, ch.step, ch.valid, p.vector_ok, run);
}

}  // namespace
}  // namespace flashdelta::detail::cuda
