// Arguments of the CUDA recurrent kernel: plain data, built on the host from a validated
// problem (cuda/recurrent.cpp) and passed by value to the kernel (cuda/recurrent_kernel.cu).
// Every offset is 64-bit; strides are in elements.
#pragma once

#include <cstdint>

#include "flashdelta/types.h"

namespace flashdelta::detail::cuda {

// A token input or output [B, T, heads, D] (or [B, T, heads] for g/beta of scalar form).
struct TokenTensor {
  const void* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  DType dtype = DType::f32;
};

// A state tensor addressed by (slot, hv, key i, value j): the layout is resolved on the
// host, so the kernel never branches on K-first / V-first beyond its thread mapping.
struct StateTensor {
  void* data = nullptr;
  int64_t slot_stride = 0, head_stride = 0, key_stride = 0, value_stride = 0;
};

#if defined(__CUDACC__)
#define FLASHDELTA_HOST_DEVICE __host__ __device__
#else
#define FLASHDELTA_HOST_DEVICE
#endif

// Division of n < 2^31 by a constant d >= 1 as a high multiply, an add and a shift (the
// round-up method of Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994): q = (mulhi(n, m) + n) >> s with s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1. A kernel's integer division is ~20 instructions.
struct FastDivisor {
  uint32_t d = 1, m = 1, s = 0;
};
inline FastDivisor make_fast_divisor(uint32_t d) {
  FastDivisor f;
  f.d = d;
  while ((uint64_t{1} << f.s) < d) ++f.s;
  f.m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.s) - d)) / d + 1);
  return f;
}
FLASHDELTA_HOST_DEVICE inline uint32_t fast_divide(uint32_t n, const FastDivisor& f) {
  const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * f.m) >> 32);
  return (hi + n) >> f.s;
}

// The warp kernel's prefetch distance in rows (cuda/recurrent_warp_kernel.cu): `eighths` of
// a resident wave (sms x blocks_per_sm one-warp blocks) over a row's row_tasks tasks,
// rounded, at least one; 0 (no prefetch blocks) for eighths = 0 or where no row of the N is
// that far ahead.
inline int64_t recurrent_prefetch_rows(int eighths, int sms, int blocks_per_sm, int64_t row_tasks,
                                       int64_t N) {
  const int64_t ahead = int64_t{eighths} * sms * blocks_per_sm / 8;
  if (ahead <= 0 || row_tasks <= 0) return 0;
  int64_t rows = (ahead + row_tasks / 2) / row_tasks;
  if (rows < 1) rows = 1;
  return rows < N ? rows : 0;
}

// An int32/int64 index tensor of rank 1 or 2.
struct IndexTensor {
  const void* data = nullptr;
  int64_t stride[2] = {0, 0};
  int64_t cols = 0;  // S for [N, S]; 1 for [N]
  bool is_i64 = false;
};

enum class GateForm : uint8_t { none, scalar, vector };

// The block kernel's thread tile (cuda/recurrent_tile.cuh): `wide` (16 keys per thread at K = 128,
// 64 columns per block) for many sequences, `narrow` (4 keys per thread, 16 columns per
// block at K = 128) for few, where four times the blocks spread the latency over more SMs.
enum class RecurrentTile : uint8_t { wide, narrow };

struct RecurrentParams {
  // Sizes.
  int64_t N = 0;      // sequences (batch rows, or cu_seqlens entries)
  int64_t T = 0;      // tokens per batch row (total tokens with cu_seqlens)
  int64_t HV = 0, group = 1, K = 0, V = 0;
  FastDivisor group_divisor;  // of group, where group < 2^31
  int64_t value_tiles = 0;  // ceil(V / columns per block)
  RecurrentTile tile = RecurrentTile::wide;
  // The grid is (value tiles, HV, N) and a task is its block's index (no division), else a
  // grid-stride loop over task numbers (cuda_recurrent_task_grid); the wide tile always
  // loops.
  bool task_grid = false;
  int warp_keys = 4;  // warp kernel: keys per lane, 4 or 8 (cuda_recurrent_warp_keys)

  // The recurrence.
  GateForm gate = GateForm::none;
  bool delta = false;
  float scale = 1.f;
  bool qk_l2norm = false;
  bool beta_sigmoid = false;
  float beta_factor = 1.f;  // 2 for negative eigenvalues
  bool gate_in_kernel = false;
  bool has_lower_bound = false;
  float lower_bound = 0.f;

  // Inputs and output.
  TokenTensor q, k, v, g, beta, o;
  const void* A_log = nullptr;  // [HV]
  DType A_log_dtype = DType::f32;
  int64_t A_log_stride = 0;
  const void* dt_bias = nullptr;  // element (hv, i) at hv * head_stride + i * key_stride
  DType dt_bias_dtype = DType::f32;
  int64_t dt_bias_head_stride = 0, dt_bias_key_stride = 0;
  IndexTensor cu_seqlens;  // data == nullptr: batch rows of T tokens

  // States. Forward: read initial (absent = zeros) at slot n, write final at slot n.
  // Serving: pool read and written in place at the slots of state_indices.
  StateTensor state_in, state_out;
  bool vector_ok = false;  // both state tensors allow aligned vector access
  bool serving = false;
  int64_t pool_slots = 0;  // P
  IndexTensor state_indices, num_accepted;
  bool per_token_slots = false;

  // Warp kernel on the task grid: how far ahead, in eighths of a resident wave, a row's
  // prefetch block queues a later row's states into L2 (cuda_recurrent_warp_prefetch_eighths;
  // 0 = none) and the SMs that makes a wave of; set by the launch, that distance in rows
  // (0: no prefetch blocks). Last, so that the other members' offsets stay those of the
  // kernels built without prefetch blocks.
  int prefetch_eighths = 0, sms = 0;
  int64_t prefetch_rows = 0;
};

// Launches the kernel on `stream` (a cudaStream_t); the state dtype is float32 or bfloat16.
// Throws flashdelta::Error on a launch failure.
void launch_recurrent(const RecurrentParams& p, DType state_dtype, bool key_contiguous,
                      void* stream);

// The warp kernel (cuda/recurrent_warp_kernel.cu) on a key-contiguous (V-first) state, for
// K in {32, 64, 128, 256}, V a multiple of recurrent_warp_columns(K, p.warp_keys),
// p.vector_ok and a head's tile addressable in 32 bits ((V - 1) |value_stride| + K <=
// INT32_MAX); p.value_tiles = V / that.
void launch_recurrent_warp(const RecurrentParams& p, DType state_dtype, void* stream);
// Value columns of one warp kernel task for head size K and keys_per_lane keys per lane (8
// at K = 256; 4 or 8 at K = 128; 4 below); 0 where the kernel does not run.
int64_t recurrent_warp_columns(int64_t K, int keys_per_lane);

// Columns of V one thread block covers for head size K and a tile (the kernel's tile width).
int64_t recurrent_block_columns(int64_t K, RecurrentTile tile);
// Elements of one thread's contiguous run of state values (the vector access width).
inline constexpr int64_t kStateRunLength = 4;

}  // namespace flashdelta::detail::cuda
