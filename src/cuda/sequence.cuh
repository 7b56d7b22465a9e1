// Where sequence n of a forward lies in the token tensors: batch row n, or the slice of the
// packed row that the device-resident cu_seqlens gives (clamped, so a malformed table can
// never address outside [0, T)).
#pragma once

#include "cuda/device_io.cuh"
#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {
namespace {

struct Sequence {
  int64_t batch, t0, len;
};

__device__ Sequence sequence_of(const RecurrentParams& p, int64_t n) {
  if (!p.cu_seqlens.data) return {n, 0, p.T};
  int64_t lo = load_index(p.cu_seqlens, n, 0);
  int64_t hi = load_index(p.cu_seqlens, n + 1, 0);
  lo = lo < 0 ? 0 : (lo > p.T ? p.T : lo);
  hi = hi < lo ? lo : (hi > p.T ? p.T : hi);
  return {0, lo, hi - lo};
}

// Element offset of the sequence's first token in head h of a token tensor.
__device__ __forceinline__ int64_t token_offset(const TokenTensor& x, const Sequence& s,
                                                int64_t h) {
  return s.batch * x.stride[0] + s.t0 * x.stride[1] + h * x.stride[2];
}

}  // namespace
}  // namespace flashdelta::detail::cuda
