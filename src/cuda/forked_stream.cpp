#include "cuda/forked_stream.h"

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "flashdelta/types.h"

namespace flashdelta::detail {
namespace {

// One host thread's side stream and events for one caller stream on one device, destroyed
// with the thread (errors ignored: the context may be gone).
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;

  SideStream() = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    if (fork) cudaEventDestroy(fork);
    if (join) cudaEventDestroy(join);
    if (stream) cudaStreamDestroy(stream);
  }
  // A fresh one, or null (the error cleared) where the device gives none.
  static std::unique_ptr<SideStream> create() {
    auto s = std::make_unique<SideStream>();
    int least = 0, greatest = 0;
    if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
        cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking, greatest) != cudaSuccess ||
        cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&s->join, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return s;
  }
  // Still a stream of the current context (not after cudaDeviceReset, say): a query that is
  // legal while the stream is being captured.
  bool valid() const {
    int priority = 0;
    if (cudaStreamGetPriority(stream, &priority) == cudaSuccess) return true;
    cudaGetLastError();
    return false;
  }
};

// The side stream for (device, caller), or null.
SideStream* side_stream(cudaStream_t caller) {
  thread_local std::map<std::pair<int, cudaStream_t>, std::unique_ptr<SideStream>> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  std::unique_ptr<SideStream>& s = cache[{device, caller}];
  if (s && !s->valid()) {  // its handles belong to a context that is gone: not destroyed
    s->stream = nullptr;
    s->fork = s->join = nullptr;
    s.reset();
  }
  if (!s) s = SideStream::create();
  return s.get();
}

void check(cudaError_t err, const char* what, const char* call) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // not sticky: clear it for the caller's next check
  throw Error(ErrorCode::runtime, std::string(what) + ": " + call + " on its second stream: " +
                                      cudaGetErrorString(err));
}

}  // namespace

ForkedStream::ForkedStream(void* caller, const char* what) : caller_(caller), what_(what) {
  SideStream* s = side_stream(static_cast<cudaStream_t>(caller));
  side_ = s ? s->stream : caller;
  fork_ = s ? s->fork : nullptr;
  join_ = s ? s->join : nullptr;
}

ForkedStream::~ForkedStream() {
  if (!forked_) return;  // nothing queued on the side stream by this fork
  const auto side = static_cast<cudaStream_t>(side_);
  const auto join = static_cast<cudaEvent_t>(join_);
  if (cudaEventRecord(join, side) != cudaSuccess ||
      cudaStreamWaitEvent(static_cast<cudaStream_t>(caller_), join, 0) != cudaSuccess)
    cudaStreamSynchronize(side);  // the caller's workspace must outlive the side's kernels
}

void ForkedStream::follow_caller() {
  if (side_ == caller_) return;  // no side stream: stream order is enough
  const auto fork = static_cast<cudaEvent_t>(fork_);
  check(cudaEventRecord(fork, static_cast<cudaStream_t>(caller_)), what_, "cudaEventRecord");
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(side_), fork, 0), what_,
        "cudaStreamWaitEvent");
  forked_ = true;
}

}  // namespace flashdelta::detail
