// What the validation fuzz targets share (fuzz_validation.cpp, fuzz_backward.cpp): the
// choice reader over the input bytes, the sizes and options they choose from, and tensor
// plans: a view's dtype, shape, strides, device and pointer chosen (choice 0 always the
// ordinary one), measured, and backed by a heap buffer exactly as large as the elements it
// reaches, filled with deterministic values.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "core/half.h"
#include "flashdelta/flashdelta.h"

namespace flashdelta::fuzz {

// Keep one case small: elements a view may reach, and the multiply-adds of the reference
// run (B * T * HV * K * V for the tokens, N * HV * K * V for the states).
constexpr int64_t kMaxSpan = int64_t{1} << 16;
constexpr int64_t kMaxWork = int64_t{1} << 18;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Sizes: ordinary ones first, then the edges validation must catch (zero, negative, above
// the K/V limit, large enough to overflow products).
constexpr int64_t kPow31 = int64_t{1} << 31, kPow32 = int64_t{1} << 32, kPow62 = int64_t{1} << 62;
constexpr int64_t kDims[] = {2,  1,   3,   4,  5,  0,      7,          8,      16,
                             64, 256, 257, -1, -5, kPow31, kPow32 + 1, kPow62, kInt64Max};
constexpr int64_t kGroups[] = {1, 2, 4};
constexpr int64_t kSequenceLengths[] = {1, 2, 0, 3, 5};
constexpr Mechanism kMechanisms[] = {Mechanism::kda,        Mechanism::linear_attention,
                                     Mechanism::simple_gla, Mechanism::gla,
                                     Mechanism::deltanet,   Mechanism::gated_deltanet};
const std::optional<double> kLowerBounds[] = {std::nullopt, -5.0, -1.0,  -0.25,  0.0,
                                              1.0,          kNaN, -kInf, -1e-300};
const std::optional<double> kScales[] = {std::nullopt, 1.0, 0.125, 0.0, -2.0, kNaN, kInf, 1e300};
constexpr int kChunkSizes[] = {64, 16, 32, 128, 0, -64, 48, 256};
constexpr int kThreadCounts[] = {1, 0, 2, -1};

class ChoiceReader {
 public:
  ChoiceReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  int pick(int n) { return byte() % n; }
  bool flag() { return byte() & 1; }
  template <class T, size_t N>
  T choose(const T (&options)[N]) {
    return options[pick(static_cast<int>(N))];
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// a * b and a + b, clamped to int64 max on overflow (sizes here are never negative).
inline int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? kInt64Max : out;
}
inline int64_t saturating_add(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kInt64Max : out;
}

// ---------------------------------------------------------------------------------------
// Tensors

// Stride layouts. dense_by_product is what flashdelta::make_view builds (a size-0
// dimension makes the strides before it 0); contiguous is PyTorch's (sizes count as >= 1).
enum class Layout {
  contiguous,
  permuted,
  padded,
  negative,
  broadcast,
  arbitrary,
  dense_by_product
};

// One tensor argument as the input asked for it, and where its memory comes from.
struct Plan {
  TensorView view;  // rank -1: absent
  Layout layout = Layout::contiguous;
  bool null_data = false;
  int group = -1;           // plans of one group share a buffer
  int64_t lo = 0, hi = -1;  // element offsets reached, relative to data; hi < lo: none

  bool reaches_memory() const { return hi >= lo; }
  std::vector<int64_t> shape() const {
    return std::vector<int64_t>(view.shape.begin(), view.shape.begin() + view.rank);
  }
};

inline void choose_strides(ChoiceReader& r, Plan& p) {
  TensorView& v = p.view;
  p.layout = static_cast<Layout>(r.pick(7));
  std::array<int, kMaxRank> order = {0, 1, 2, 3};  // memory order, outermost first
  if (p.layout == Layout::permuted)
    for (int i = v.rank - 1; i > 0; --i) std::swap(order[i], order[r.pick(i + 1)]);
  int64_t step = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    const int d = order[i];
    v.stride[d] = step;
    const int64_t padding = p.layout == Layout::padded ? r.pick(3) : 0;
    const int64_t size = p.layout == Layout::dense_by_product ? std::max<int64_t>(v.shape[d], 0)
                                                              : std::max<int64_t>(v.shape[d], 1);
    step = saturating_mul(step, saturating_add(size, padding));
  }
  if (v.rank == 0) return;
  if (p.layout == Layout::negative) v.stride[r.pick(v.rank)] *= -1;
  if (p.layout == Layout::broadcast) v.stride[r.pick(v.rank)] = 0;
  if (p.layout == Layout::arbitrary)
    for (int d = 0; d < v.rank; ++d) v.stride[d] = r.pick(7) - 3;
}

// A tensor that the problem expects (usually present) or does not (rarely present), with
// its dtype, shape, strides, device and pointer possibly changed from the ordinary.
inline Plan plan_tensor(ChoiceReader& r, bool expected, DType dtype, std::vector<int64_t> shape) {
  Plan p;
  const bool present = expected ? r.pick(16) != 15 : r.pick(16) == 15;
  if (!present) return p;
  constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16,
                               DType::f64, DType::i32,  DType::i64};
  const int dtype_choice = r.pick(8);  // 0 and 7: the ordinary dtype
  p.view.dtype = dtype_choice >= 1 && dtype_choice <= 6 ? kDTypes[dtype_choice - 1] : dtype;
  switch (r.pick(8)) {
    case 6:  // one dimension changed
      if (!shape.empty()) shape[r.pick(static_cast<int>(shape.size()))] = r.choose(kDims);
      break;
    case 7:  // one dimension dropped or added
      if (r.flag() && !shape.empty())
        shape.pop_back();
      else if (shape.size() < static_cast<size_t>(kMaxRank))
        shape.push_back(r.choose(kDims));
      break;
    default: break;
  }
  p.view.rank = static_cast<int>(shape.size());
  for (int d = 0; d < p.view.rank; ++d) p.view.shape[d] = shape[d];
  choose_strides(r, p);
  p.view.device = r.pick(32) == 31 ? Device::cuda : Device::cpu;
  p.null_data = r.pick(32) == 31;
  return p;
}

// Number of elements of a view; 0 when a size is 0 or negative (no memory), saturating.
inline int64_t element_count(const TensorView& v) {
  int64_t n = 1;
  for (int d = 0; d < v.rank; ++d) n = v.shape[d] <= 0 ? 0 : saturating_mul(n, v.shape[d]);
  return v.present() ? n : 0;
}

// Finds the element offsets a view reaches; false when the view is too large for a case.
inline bool measure(Plan& p) {
  const TensorView& v = p.view;
  p.lo = 0;
  p.hi = -1;
  if (element_count(v) == 0) return true;
  // Many elements over little memory (broadcast strides) still cost time to walk.
  if (element_count(v) > kMaxSpan) return false;
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < v.rank; ++d) {
    int64_t extent = 0;
    if (__builtin_mul_overflow(v.shape[d] - 1, v.stride[d], &extent)) return false;
    if (__builtin_add_overflow(extent < 0 ? lo : hi, extent, extent < 0 ? &lo : &hi)) return false;
  }
  int64_t span = 0;
  if (__builtin_sub_overflow(hi, lo, &span) || span >= kMaxSpan) return false;
  p.lo = lo;
  p.hi = hi;
  return true;
}

// Deterministic values for the buffers, seeded from the input.
struct ValueSource {
  uint64_t state;
  int mode;          // 0 small, 1 wide, 2 special values, 3 raw bit patterns
  uint64_t next() {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53;
  }
  double value() {
    constexpr double kSpecial[] = {kNaN, kInf, -kInf, 0.0, 1e30, -1e-40, 65504.0, -1.0};
    switch (mode) {
      case 1: return uniform(-30, 30);
      case 2: return kSpecial[next() % 8];
      default: return uniform(-1, 1);
    }
  }
  void fill(unsigned char* p, size_t bytes, DType dtype) {
    const size_t size = static_cast<size_t>(dtype_size(dtype));
    for (size_t at = 0; at + size <= bytes; at += size) {
      const uint64_t raw = next();
      const double x = value();
      const float f = static_cast<float>(x);
      uint32_t f_bits = 0;
      std::memcpy(&f_bits, &f, 4);
      uint16_t half = 0;
      switch (dtype) {
        case DType::f32:
          std::memcpy(p + at, mode == 3 ? &raw : static_cast<const void*>(&f), 4);
          break;
        case DType::f64:
          std::memcpy(p + at, mode == 3 ? &raw : static_cast<const void*>(&x), 8);
          break;
        case DType::bf16:
          half = mode == 3 ? static_cast<uint16_t>(raw) : static_cast<uint16_t>(f_bits >> 16);
          std::memcpy(p + at, &half, 2);
          break;
        case DType::f16:
          half = mode == 3 ? static_cast<uint16_t>(raw) : detail::float_to_f16(f);
          std::memcpy(p + at, &half, 2);
          break;
        case DType::i32:
        case DType::i64: std::memcpy(p + at, &raw, size); break;
      }
    }
  }
};

inline unsigned char* index_address(const TensorView& v, int64_t i) {
  return static_cast<unsigned char*>(v.data) + i * v.stride[0] * dtype_size(v.dtype);
}

inline void store_index(const TensorView& v, int64_t i, int64_t value) {
  if (v.dtype == DType::i32) {
    const auto x = static_cast<int32_t>(value);
    std::memcpy(index_address(v, i), &x, 4);
  } else {
    std::memcpy(index_address(v, i), &value, 8);
  }
}

inline int64_t load_index(const TensorView& v, int64_t i) {
  if (v.dtype == DType::i32) {
    int32_t x = 0;
    std::memcpy(&x, index_address(v, i), 4);
    return x;
  }
  int64_t x = 0;
  std::memcpy(&x, index_address(v, i), 8);
  return x;
}

// Backs each group of measured plans (plans[i].group) with one heap buffer as large as the
// largest reach among them, filled from `values`, and points every present, non-null view
// at its buffer. Returns the buffers' sizes in bytes.
template <size_t N>
std::array<size_t, N> back_with_memory(std::array<Plan, N>& plans,
                                       std::array<std::unique_ptr<unsigned char[]>, N>& buffers,
                                       ValueSource& values) {
  std::array<size_t, N> sizes{};
  for (size_t group = 0; group < N; ++group) {
    int64_t bytes = 0;
    DType dtype = DType::f32;
    for (const Plan& p : plans)
      if (p.group == static_cast<int>(group) && p.reaches_memory()) {
        bytes = std::max(bytes, (p.hi - p.lo + 1) * dtype_size(p.view.dtype));
        dtype = p.view.dtype;
      }
    // Zero bytes still get a distinct allocation: any access to it is reported.
    buffers[group].reset(new unsigned char[static_cast<size_t>(bytes)]);
    sizes[group] = static_cast<size_t>(bytes);
    values.fill(buffers[group].get(), static_cast<size_t>(bytes), dtype);
  }
  for (Plan& p : plans) {
    if (!p.view.present() || p.null_data) continue;
    p.view.data =
        buffers[p.group].get() + (p.reaches_memory() ? -p.lo * dtype_size(p.view.dtype) : 0);
  }
  return sizes;
}

// Writes the offsets `cu` into a cu_seqlens plan that reaches memory with an index dtype
// (the last repeated past its end) and, one time in four, one of `spoiled` at a chosen entry.
template <size_t M>
void write_offsets(ChoiceReader& r, const Plan& cp, const std::vector<int64_t>& cu,
                   const int64_t (&spoiled)[M]) {
  if (!(cp.view.data && cp.view.rank == 1 && cp.reaches_memory() &&
        (cp.view.dtype == DType::i32 || cp.view.dtype == DType::i64)))
    return;
  for (int64_t i = 0; i < cp.view.shape[0]; ++i)
    store_index(cp.view, i, i < static_cast<int64_t>(cu.size()) ? cu[i] : cu.back());
  if (r.pick(4) == 3)
    store_index(cp.view, r.pick(static_cast<int>(std::min<int64_t>(cp.view.shape[0], 256))),
                r.choose(spoiled));
}

}  // namespace flashdelta::fuzz
