// FlashDelta public types: element types, devices, non-owning tensor views, errors.
// Framework-free: a tensor is a raw pointer with a shape and element strides.
#pragma once

#include <array>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace flashdelta {

enum class DType : uint8_t { f32, bf16, f16, f64, i32, i64 };
enum class Device : uint8_t { cpu, cuda };

inline constexpr int kMaxRank = 4;

constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::f64: return "float64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16 || t == DType::f64;
}

// A non-owning view of a tensor. Strides are in elements (not bytes) and may be any
// value, so transposed and sliced views are read correctly. An absent optional tensor
// is a default-constructed view (rank == -1).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int rank = -1;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> stride{};

  bool present() const { return rank >= 0; }
  // Element count; 0 if any size is 0 (or negative), INT64_MAX if the product overflows.
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i)
      if (shape[i] <= 0) return 0;
    for (int i = 0; i < rank; ++i)
      if (__builtin_mul_overflow(n, shape[i], &n)) return INT64_MAX;
    return n;
  }
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expect = 1;
    for (int i = rank - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
};

// Builds a view of a dense row-major tensor.
inline TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            Device device = Device::cpu) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  // Strides as PyTorch computes them (a size-0 dimension counts as 1), saturating.
  int64_t st = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.stride[d] = st;
    if (__builtin_mul_overflow(st, t.shape[d] > 1 ? t.shape[d] : 1, &st)) st = INT64_MAX;
  }
  return t;
}

enum class ErrorCode : uint8_t {
  invalid_argument,  // a shape, dtype, value or combination of arguments is wrong
  unsupported,       // valid, but not available in this build or on this device
  runtime,           // a device or system failure
};

// Every error FlashDelta raises. The message names the argument, what was expected and
// what was given, e.g. "argument 'v': expected HV a multiple of H = 4, got HV = 6".
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace flashdelta
