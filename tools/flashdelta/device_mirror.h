// Device copies of host tensor views, for the command line and the GPU tests: a forward on
// host views runs on the GPU by mirroring every input and output there, running, and
// copying the outputs back. Only in builds with CUDA (FLASHDELTA_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flashdelta/flashdelta.h"

namespace flashdelta::cli {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::runtime, std::string(what) + ": " + cudaGetErrorString(e));
}

// Bytes a view with non-negative strides spans from its base.
inline size_t span_bytes(const TensorView& v) {
  if (v.numel() == 0) return 0;
  int64_t last = 0;
  for (int i = 0; i < v.rank; ++i) last += (v.shape[i] - 1) * v.stride[i];
  return static_cast<size_t>((last + 1) * dtype_size(v.dtype));
}

// Owns the device allocations of one call; each mirrored view keeps its shape and strides.
class DeviceMirror {
 public:
  DeviceMirror() = default;
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  ~DeviceMirror() {
    for (void* p : allocations_) cudaFree(p);
  }

  TensorView upload(const TensorView& host) {
    if (!host.present()) return host;
    TensorView d = host;
    d.device = Device::cuda;
    const size_t bytes = span_bytes(host);
    d.data = allocate(bytes);
    if (bytes) check_cuda(cudaMemcpy(d.data, host.data, bytes, cudaMemcpyHostToDevice), "upload");
    return d;
  }
  void download(const TensorView& device, const TensorView& host) {
    if (!device.present()) return;
    const size_t bytes = span_bytes(host);
    if (bytes)
      check_cuda(cudaMemcpy(host.data, device.data, bytes, cudaMemcpyDeviceToHost), "download");
  }
  void* allocate(size_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    allocations_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> allocations_;
};

// Forward arguments on host memory, mirrored on the device (an in-place final state stays
// in place). Outputs are copied back by `download_outputs`.
struct DeviceForward {
  DeviceMirror mirror;
  ForwardArgs args;

  explicit DeviceForward(const ForwardArgs& host) : args(host) {
    for (auto [h, d] : {std::pair{&host.q, &args.q}, {&host.k, &args.k}, {&host.v, &args.v},
                        {&host.g, &args.g}, {&host.beta, &args.beta},
                        {&host.cu_seqlens, &args.cu_seqlens}, {&host.A_log, &args.A_log},
                        {&host.dt_bias, &args.dt_bias}, {&host.o, &args.o},
                        {&host.initial_state, &args.initial_state},
                        {&host.chunk_states, &args.chunk_states}})
      *d = mirror.upload(*h);
    const bool in_place =
        host.final_state.present() && host.final_state.data == host.initial_state.data;
    args.final_state = in_place ? args.initial_state : mirror.upload(host.final_state);
  }
  void download_outputs(const ForwardArgs& host) {
    check_cuda(cudaDeviceSynchronize(), "forward");
    mirror.download(args.o, host.o);
    mirror.download(args.final_state, host.final_state);
    mirror.download(args.chunk_states, host.chunk_states);
  }
};

// Backward arguments on host memory, mirrored on the device; the gradients are copied back
// by `download_outputs`.
struct DeviceBackward {
  DeviceMirror mirror;
  BackwardArgs args;

  explicit DeviceBackward(const BackwardArgs& host) : args(host) {
    for (auto [h, d] :
         {std::pair{&host.q, &args.q}, {&host.k, &args.k}, {&host.v, &args.v},
          {&host.g, &args.g}, {&host.beta, &args.beta}, {&host.initial_state, &args.initial_state},
          {&host.cu_seqlens, &args.cu_seqlens}, {&host.A_log, &args.A_log},
          {&host.dt_bias, &args.dt_bias}, {&host.d_o, &args.d_o},
          {&host.d_final_state, &args.d_final_state}, {&host.chunk_states, &args.chunk_states},
          {&host.dq, &args.dq}, {&host.dk, &args.dk}, {&host.dv, &args.dv}, {&host.dg, &args.dg},
          {&host.dbeta, &args.dbeta}, {&host.d_initial_state, &args.d_initial_state},
          {&host.dA_log, &args.dA_log}, {&host.ddt_bias, &args.ddt_bias}})
      *d = mirror.upload(*h);
  }
  void download_outputs(const BackwardArgs& host) {
    check_cuda(cudaDeviceSynchronize(), "backward");
    for (auto [h, d] : {std::pair{&host.dq, &args.dq}, {&host.dk, &args.dk}, {&host.dv, &args.dv},
                        {&host.dg, &args.dg}, {&host.dbeta, &args.dbeta},
                        {&host.d_initial_state, &args.d_initial_state},
                        {&host.dA_log, &args.dA_log}, {&host.ddt_bias, &args.ddt_bias}})
      mirror.download(*d, *h);
  }
};

// The same for a serving call; the pool is updated in place on the device and read back.
struct DeviceDecode {
  DeviceMirror mirror;
  DecodeArgs args;

  explicit DeviceDecode(const DecodeArgs& host) : args(host) {
    for (auto [h, d] : {std::pair{&host.q, &args.q}, {&host.k, &args.k}, {&host.v, &args.v},
                        {&host.g, &args.g}, {&host.beta, &args.beta},
                        {&host.cu_seqlens, &args.cu_seqlens}, {&host.A_log, &args.A_log},
                        {&host.dt_bias, &args.dt_bias}, {&host.o, &args.o},
                        {&host.state_pool, &args.state_pool},
                        {&host.state_indices, &args.state_indices},
                        {&host.num_accepted_tokens, &args.num_accepted_tokens}})
      *d = mirror.upload(*h);
  }
  void download_outputs(const DecodeArgs& host) {
    check_cuda(cudaDeviceSynchronize(), "decode");
    mirror.download(args.o, host.o);
    mirror.download(args.state_pool, host.state_pool);
  }
};

}  // namespace flashdelta::cli
