#include "cuda/workspace.h"

#include <cuda_runtime.h>

#include <string>

#include "flashdelta/types.h"

namespace flashdelta::detail {

void check_caller_workspace(void* workspace, size_t bytes, int64_t needed) {
  if (bytes < static_cast<size_t>(needed))
    throw Error(ErrorCode::invalid_argument,
                "argument 'workspace_bytes': the CUDA chunk schedule needs " +
                    std::to_string(needed) + " bytes for this call, got " + std::to_string(bytes));
  if (needed > 0 && !workspace)
    throw Error(ErrorCode::invalid_argument,
                "argument 'workspace': null, with workspace_bytes " + std::to_string(bytes));
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign != 0)
    throw Error(ErrorCode::invalid_argument,
                "argument 'workspace': expected an address aligned to " +
                    std::to_string(kWorkspaceAlign) + " bytes, got one " +
                    std::to_string(reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign) +
                    " bytes past");
}

StreamWorkspace::StreamWorkspace(const char* what, int64_t needed, void* caller,
                                 size_t caller_bytes, void* stream)
    : stream_(stream) {
  if (caller != nullptr || caller_bytes > 0) {
    data_ = static_cast<char*>(caller);
    return;
  }
  if (needed == 0) return;
  const cudaError_t err = cudaMallocAsync(&owned_, static_cast<size_t>(needed),
                                          static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: nothing was launched
    throw Error(ErrorCode::runtime, std::string(what) + ": cannot allocate its workspace of " +
                                        std::to_string(needed) + " bytes: " +
                                        cudaGetErrorString(err));
  }
  data_ = static_cast<char*>(owned_);
}

StreamWorkspace::~StreamWorkspace() {
  if (owned_) cudaFreeAsync(owned_, static_cast<cudaStream_t>(stream_));
}

}  // namespace flashdelta::detail
