// Strided, dtype-converting reads and writes of TensorView rows. Every schedule reads its
// inputs through these, so strided views and all float dtypes behave the same everywhere.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "flashdelta/types.h"

namespace flashdelta::detail {

inline char* element_address(const TensorView& t, int64_t offset) {
  return static_cast<char*>(t.data) + offset * dtype_size(t.dtype);
}

// Element offset of index (i0, i1, ...) in t, in elements.
inline int64_t offset_of(const TensorView& t, int64_t i0) { return i0 * t.stride[0]; }
inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1) {
  return i0 * t.stride[0] + i1 * t.stride[1];
}
inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
}
inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2] + i3 * t.stride[3];
}

// Reads n elements starting at element `offset`, `step` elements apart, as T (float or double).
template <class T>
void load_row(const TensorView& t, int64_t offset, int64_t n, int64_t step, T* dst) {
  const char* base = element_address(t, offset);
  switch (t.dtype) {
    case DType::f32: {
      const float* p = reinterpret_cast<const float*>(base);
      if (step == 1)  // contiguous rows: a loop the compiler vectorises
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i]);
      else
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i * step]);
      break;
    }
    case DType::f64: {
      const double* p = reinterpret_cast<const double*>(base);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i * step]);
      break;
    }
    case DType::bf16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(bf16_to_float(p[i * step]));
      break;
    }
    case DType::f16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(f16_to_float(p[i * step]));
      break;
    }
    case DType::i32: {
      const int32_t* p = reinterpret_cast<const int32_t*>(base);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i * step]);
      break;
    }
    case DType::i64: {
      const int64_t* p = reinterpret_cast<const int64_t*>(base);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(p[i * step]);
      break;
    }
  }
}

template <class T>
T load_scalar(const TensorView& t, int64_t offset) {
  T v;
  load_row(t, offset, 1, 1, &v);
  return v;
}

// Writes n values to a float tensor (float32, float64, bfloat16 or float16; rounded to
// nearest even). Validation guarantees outputs are floating.
template <class T>
void store_row(const TensorView& t, int64_t offset, int64_t n, int64_t step, const T* src) {
  char* base = element_address(t, offset);
  switch (t.dtype) {
    case DType::f32: {
      float* p = reinterpret_cast<float*>(base);
      if (step == 1)
        for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(src[i]);
      else
        for (int64_t i = 0; i < n; ++i) p[i * step] = static_cast<float>(src[i]);
      break;
    }
    case DType::f64: {
      double* p = reinterpret_cast<double*>(base);
      for (int64_t i = 0; i < n; ++i) p[i * step] = static_cast<double>(src[i]);
      break;
    }
    case DType::bf16: {
      uint16_t* p = reinterpret_cast<uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) p[i * step] = float_to_bf16(static_cast<float>(src[i]));
      break;
    }
    case DType::f16: {
      uint16_t* p = reinterpret_cast<uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) p[i * step] = float_to_f16(static_cast<float>(src[i]));
      break;
    }
    case DType::i32:
    case DType::i64:
      break;
  }
}

// Reads an integer (int32 or int64) element.
inline int64_t load_index(const TensorView& t, int64_t offset) {
  const char* p = element_address(t, offset);
  if (t.dtype == DType::i32) return *reinterpret_cast<const int32_t*>(p);
  return *reinterpret_cast<const int64_t*>(p);
}

}  // namespace flashdelta::detail
