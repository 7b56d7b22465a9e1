// Temporary device memory of the CUDA chunk schedules: the caller's (checked first, so a bad
// one fails before anything runs) or the stream-ordered allocator's (cudaMallocAsync, no
// synchronisation, capturable in CUDA graphs), returned in stream order however the
// launches end.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashdelta::detail {

// Workspace alignment the schedules carve their regions to.
inline constexpr int64_t kWorkspaceAlign = 256;

class StreamWorkspace {
 public:
  // `what` names the schedule in errors. caller / caller_bytes: ForwardArgs::workspace /
  // BackwardArgs::workspace and their sizes (nullptr and 0: allocate).
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
