// Memory movement of the recurrent schedule. State tiles: a K x W block of one (sequence,
// head) state, row-major by key, fp32, W a multiple of the vector width, copied in from and
// out to a StateView (any layout, strides and state dtype), so the hot loop sees one dense
// layout that stays in L1 for a whole block of tokens. Also: output rows and the per-thread
// workspace.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/problem.h"
#include "core/tensor_io.h"
#include "hwy/aligned_allocator.h"

namespace flashdelta::detail {

// Columns [col0, col0 + cols) of state (n, hv) into `tile` (row stride w); the columns
// from cols to w are zeroed so the padding stays zero through the recurrence.
inline void load_state_tile(const StateView& s, int64_t n, int64_t hv, int64_t K, int64_t col0,
                            int64_t cols, int64_t w, float* tile) {
  const bool f32 = s.t.dtype == DType::f32;
  if (f32 && s.value_step() == 1) {  // K-first, dense rows
    for (int64_t i = 0; i < K; ++i) {
      const float* src = static_cast<const float*>(s.t.data) + s.offset(n, hv, i, col0);
      std::memcpy(tile + i * w, src, static_cast<size_t>(cols) * sizeof(float));
    }
  } else if (f32 && s.key_step() == 1) {  // V-first, dense columns: transpose
    for (int64_t j = 0; j < cols; ++j) {
      const float* src = static_cast<const float*>(s.t.data) + s.offset(n, hv, 0, col0 + j);
      for (int64_t i = 0; i < K; ++i) tile[i * w + j] = src[i];
    }
  } else {
    for (int64_t i = 0; i < K; ++i)
      load_row(s.t, s.offset(n, hv, i, col0), cols, s.value_step(), tile + i * w);
  }
  for (int64_t i = 0; i < K; ++i)
    std::memset(tile + i * w + cols, 0, static_cast<size_t>(w - cols) * sizeof(float));
}

// The inverse of load_state_tile (the padding columns are not written).
inline void store_state_tile(const StateView& s, int64_t n, int64_t hv, int64_t K, int64_t col0,
                             int64_t cols, int64_t w, const float* tile) {
  const bool f32 = s.t.dtype == DType::f32;
  if (f32 && s.value_step() == 1) {
    for (int64_t i = 0; i < K; ++i) {
      float* dst = static_cast<float*>(s.t.data) + s.offset(n, hv, i, col0);
      std::memcpy(dst, tile + i * w, static_cast<size_t>(cols) * sizeof(float));
    }
  } else if (f32 && s.key_step() == 1) {
    for (int64_t j = 0; j < cols; ++j) {
      float* dst = static_cast<float*>(s.t.data) + s.offset(n, hv, 0, col0 + j);
      for (int64_t i = 0; i < K; ++i) dst[i] = tile[i * w + j];
    }
  } else {
    for (int64_t i = 0; i < K; ++i)
      store_row(s.t, s.offset(n, hv, i, col0), cols, s.value_step(), tile + i * w);
  }
}

// Writes n values of one output row (value step o.stride[3]); dense float32 rows are copied.
inline void store_output_row(const TensorView& o, int64_t offset, int64_t n, const float* src) {
  if (o.dtype == DType::f32 && o.stride[3] == 1)
    std::memcpy(static_cast<float*>(o.data) + offset, src, static_cast<size_t>(n) * sizeof(float));
  else
    store_row(o, offset, n, o.stride[3], src);
}

// Scratch memory of the calling thread, at least n floats, vector-aligned. Reused across
// work items so the token loop never allocates.
inline float* thread_workspace(size_t n) {
  thread_local hwy::AlignedFreeUniquePtr<float[]> buffer;
  thread_local size_t size = 0;
  if (size < n) {
    buffer = hwy::AllocateAligned<float>(n);
    size = n;
  }
  return buffer.get();
}

}  // namespace flashdelta::detail
