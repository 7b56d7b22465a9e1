// The host's time per kernel launch on this machine, the floor under any decode call's host
// time: an empty kernel with no arguments, with a 656-byte __grid_constant__ argument (the
// size of the recurrent kernels' RecurrentParams), and the same with the runtime calls a
// FlashDelta decode makes around its launch (cudaGetDevice, getenv, cudaGetLastError).
// Each: 200 launches queued without waiting, median of 7 loops (bench_util.h).
//
//   flashdelta_cuda_launch_cost
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "bench_util.h"

namespace {

struct Arguments {
  char bytes[656];
};

__global__ void empty_kernel() {}
__global__ void empty_kernel_with(const __grid_constant__ Arguments a) {
  if (a.bytes[0] == 1 && threadIdx.x > blockDim.x) printf("unreachable\n");  // keeps `a`
}

}  // namespace

int main() {
  using flashdelta::bench::check;
  using flashdelta::bench::host_us_per_call;
  cudaStream_t s;
  check(cudaStreamCreate(&s), "stream");
  const Arguments a{};
  for (int i = 0; i < 100; ++i) {  // module loading and first-launch costs
    empty_kernel<<<256, 128, 0, s>>>();
    empty_kernel_with<<<256, 128, 0, s>>>(a);
  }
  check(cudaGetLastError(), "launch");
  const auto bare = [&](int) { empty_kernel<<<256, 128, 0, s>>>(); };
  const auto with_argument = [&](int) { empty_kernel_with<<<256, 128, 0, s>>>(a); };
  const auto as_decode = [&](int) {
    int device = 0;
    cudaGetDevice(&device);
    volatile const char* setting = std::getenv("FLASHDELTA_RECURRENT_TILE");
    (void)setting;
    empty_kernel_with<<<256, 128, 0, s>>>(a);
    cudaGetLastError();
  };
  const auto get_device = [&](int) {
    int device = 0;
    cudaGetDevice(&device);
  };
  std::printf("host time per call, us (200 calls queued, median of 7)\n");
  std::printf("  empty kernel, no arguments                  %6.2f\n", host_us_per_call(bare, s, 7));
  std::printf("  empty kernel, 656-byte argument             %6.2f\n",
              host_us_per_call(with_argument, s, 7));
  std::printf("  + cudaGetDevice, getenv, cudaGetLastError   %6.2f\n",
              host_us_per_call(as_decode, s, 7));
  std::printf("  cudaGetDevice alone                         %6.2f\n",
              host_us_per_call(get_device, s, 7));
  check(cudaGetLastError(), "run");
  return 0;
}
