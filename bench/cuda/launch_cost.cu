// The host's time per kernel launch on this machine, the floor under any decode call's host
// time: an empty kernel with no arguments, with a 656-byte __grid_constant__ argument (the
// size of the recurrent kernels' RecurrentParams), and the same with the runtime calls a
// FlashDelta decode makes around its launch (cudaGetDevice, getenv, cudaGetLastError).
// Each: 200 launches queued without waiting, median of 7 loops.
//
//   flashdelta_cuda_launch_cost
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_util.h"

namespace {

struct Arguments {
  char bytes[656];
};

__global__ void empty_kernel() {}
__global__ void empty_kernel_with(const __grid_constant__ Arguments a) {
  if (a.bytes[0] == 1 && threadIdx.x > blockDim.x) printf("unreachable\n");  // keeps `a`
}

template <class F>
double host_us_per_call(F launch, cudaStream_t s) {
  std::vector<double> us;
  for (int r = 0; r < 7; ++r) {
    flashdelta::bench::check(cudaStreamSynchronize(s), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) launch();
    const auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 200);
  }
  flashdelta::bench::check(cudaStreamSynchronize(s), "sync");
  return flashdelta::bench::median(us);
}

}  // namespace

int main() {
  cudaStream_t s;
  flashdelta::bench::check(cudaStreamCreate(&s), "stream");
  const Arguments a{};
  for (int i = 0; i < 100; ++i) {  // module loading and first-launch costs
    empty_kernel<<<256, 128, 0, s>>>();
    empty_kernel_with<<<256, 128, 0, s>>>(a);
  }
  flashdelta::bench::check(cudaGetLastError(), "launch");
  std::printf("host time per call, us (200 calls queued, median of 7)\n");
  std::printf("  empty kernel, no arguments              %6.2f\n",
              host_us_per_call([&] { empty_kernel<<<256, 128, 0, s>>>(); }, s));
  std::printf("  empty kernel, 656-byte argument         %6.2f\n",
              host_us_per_call([&] { empty_kernel_with<<<256, 128, 0, s>>>(a); }, s));
  std::printf("  + cudaGetDevice, getenv, cudaGetLastError %4.2f\n", host_us_per_call([&] {
                int device = 0;
                cudaGetDevice(&device);
                volatile const char* e = std::getenv("FLASHDELTA_RECURRENT_TILE");
                (void)e;
                empty_kernel_with<<<256, 128, 0, s>>>(a);
                cudaGetLastError();
              }, s));
  std::printf("  cudaGetDevice alone                     %6.2f\n",
              host_us_per_call([&] { int d = 0; cudaGetDevice(&d); }, s));
  flashdelta::bench::check(cudaGetLastError(), "run");
  return 0;
}
