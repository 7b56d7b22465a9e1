// Temporary device memory of the CUDA chunk schedules: the caller's (checked first, so a bad
// one fails before anything runs) or the stream-ordered allocator's (cudaMallocAsync, no
// synchronisation, capturable in CUDA graphs), returned in stream order however the
// launches end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace flashdelta::detail {

// Workspace alignment the schedules carve their regions to.
inline constexpr int64_t kWorkspaceAlign = 256;

// The regions of a workspace: pointers to set and their sizes, carved in order from one
// allocation, each aligned to kWorkspaceAlign; an empty region's pointer is null.
class Carver {
 public:
  template <class T>
  void add(T*& ptr, int64_t elements) {
    slots_.push_back({reinterpret_cast<void**>(&ptr), elements * static_cast<int64_t>(sizeof(T))});
  }
  int64_t total() const { return prefix(slots_.size()); }
  // Bytes of the first `count` regions, alignment included.
  int64_t prefix(size_t count) const {
    int64_t t = 0;
    for (size_t i = 0; i < count && i < slots_.size(); ++i) t += aligned(slots_[i].bytes);
    return t;
  }
  void carve(char* base) const {
    for (const Slot& s : slots_) {
      *s.ptr = s.bytes > 0 ? base : nullptr;
      base += aligned(s.bytes);
    }
  }

 private:
  struct Slot {
    void** ptr;
    int64_t bytes;
  };
  static int64_t aligned(int64_t b) {
    return (b + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  }
  std::vector<Slot> slots_;
};

class StreamWorkspace {
 public:
  // `what` names the schedule in errors. caller / caller_bytes: ForwardArgs::workspace /
  // BackwardArgs::workspace and their sizes (nullptr and 0: allocate), already checked with
  // check_caller_workspace.
  StreamWorkspace(const char* what, int64_t needed, void* caller, size_t caller_bytes,
                  void* stream);
  ~StreamWorkspace();
  StreamWorkspace(const StreamWorkspace&) = delete;
  StreamWorkspace& operator=(const StreamWorkspace&) = delete;

  char* data() const { return data_; }

 private:
  char* data_ = nullptr;
  void* owned_ = nullptr;
  void* stream_ = nullptr;
};

// Throws Error(invalid_argument) unless the caller's workspace is large enough and aligned
// (no GPU needed).
void check_caller_workspace(void* workspace, size_t bytes, int64_t needed);

}  // namespace flashdelta::detail
