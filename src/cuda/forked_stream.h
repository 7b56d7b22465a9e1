// A second stream beside the caller's, for kernels that may run at the same time as the
// caller's next ones (the chunkwise forward's pieces, cuda/chunk.cpp). It is forked from and
// joined to the caller's stream by events: no host synchronisation, and a CUDA graph
// capture of the caller's stream takes the side stream's work in with its dependencies.
#pragma once

namespace flashdelta::detail {

class ForkedStream {
 public:
  // The side stream is one per host thread, device and caller stream (so that forks from
  // different streams, or a graph capture of one of them, never meet on it), created on
  // first use, non-blocking and of the device's greatest priority (its blocks go first onto
  // SMs that free up), and ordered after nothing yet: follow_caller orders it. Where one
  // cannot be had (creation fails, or a cached one is no longer valid and cannot be made
  // again) side() is the caller's stream itself: the same work, one kernel after another.
  // `what` names the caller in errors.
  ForkedStream(void* caller, const char* what);
  // The join: the caller's stream waits for everything queued on the side stream since the
  // first follow_caller, also when a launch between threw (if the join cannot be queued, the
  // host waits for the side stream instead).
  ~ForkedStream();
  ForkedStream(const ForkedStream&) = delete;
  ForkedStream& operator=(const ForkedStream&) = delete;

  void* side() const { return side_; }
  // The side stream waits for everything queued on the caller's stream so far.
  void follow_caller();

 private:
  void* caller_;
  const char* what_;
  void* side_ = nullptr;
  void* fork_ = nullptr;  // events, reused: a wait takes the event's latest record
  void* join_ = nullptr;
  bool forked_ = false;  // follow_caller ran: the join has work to wait for
};

}  // namespace flashdelta::detail
