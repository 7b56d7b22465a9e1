// Fuzz target: parse_safetensors on arbitrary bytes. It must either return tensors that
// agree with their own shapes and fit in the file, or throw flashdelta::Error
// (invalid_argument). A crash, a sanitizer report or any other exception is a finding.
#include <cstdint>
#include <cstdlib>

#include "flashdelta/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashdelta;
  try {
    const io::TensorMap tensors = io::parse_safetensors(data, size, "fuzz input");
    size_t total = 0;
    for (const auto& [name, t] : tensors) {
      if (t.shape.size() > static_cast<size_t>(kMaxRank)) std::abort();
      if (t.bytes.size() != static_cast<size_t>(t.numel() * dtype_size(t.dtype))) std::abort();
      total += t.bytes.size();
    }
    if (total + 8 > size) std::abort();  // tensors cannot hold more bytes than the file
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) std::abort();
  }
  return 0;
}
