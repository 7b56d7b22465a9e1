// Reading and writing the safetensors format (an 8-byte little-endian header length, a
// JSON header mapping names to {dtype, shape, data_offsets}, then the raw data). Supported
// dtypes: F32, F64, BF16, F16, I64, I32. Every malformed file raises flashdelta::Error
// naming the file and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "flashdelta/types.h"

namespace flashdelta::io {

// A dense row-major tensor owning its bytes (little-endian, as stored in the file).
struct OwnedTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  OwnedTensor() = default;
  OwnedTensor(DType dtype, std::vector<int64_t> shape);  // zero-filled
  int64_t numel() const;
  // A contiguous view of the bytes (rank = shape.size(), at most 4).
  TensorView view();
};

using TensorMap = std::map<std::string, OwnedTensor>;

// Parses a whole file image; `origin` names it in error messages.
TensorMap parse_safetensors(const unsigned char* data, size_t size, const std::string& origin);
TensorMap read_safetensors(const std::string& path);

// Writes atomically: a temporary file beside `path`, renamed over it only once complete,
// so an existing file is never left half-written.
void write_safetensors(const std::string& path, const TensorMap& tensors);

// "F32", "BF16", ... <-> DType; parse throws Error for unsupported names.
const char* safetensors_dtype_name(DType dtype);
DType parse_safetensors_dtype(const std::string& name, const std::string& origin);

}  // namespace flashdelta::io
