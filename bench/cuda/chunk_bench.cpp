// C++ timing of the CUDA chunkwise forward alone (no Python, no fla: seconds, not the
// minutes fla's autotuning takes per shape), for iterating on the kernels. The cases are
// issue 5's: KDA with fla's headline options (bf16 inputs, gate computed in the kernel with
// A_log, dt_bias and lower bound -5, q/k L2 norm and beta sigmoid in the kernel, V-first fp32
// states in and out), the training shape with a precomputed gate, and Gated DeltaNet.
// Inputs are random (uniform); two input sets are rotated; CUDA events around each call; medians.
// Each case is timed twice: with a workspace the caller allocated once (ForwardArgs::workspace,
// what an engine does) and without one, when every call takes its workspace from the
// stream-ordered allocator (whose default pool may return the memory to the driver at
// every synchronisation, and then maps it again on the next call).
// The side-by-side ratios against fla come from bench/device/bench_chunk.py.
//
//   flashdelta_cuda_chunk_bench [--only SUBSTRING] [--reps N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"
#include "flashdelta/flashdelta.h"

namespace fd = flashdelta;
using flashdelta::bench::check;
using flashdelta::bench::median;

namespace {

// A device tensor of n values uniform in mean +- sqrt(3) sd (variance sd^2), bf16 or fp32.
// A xorshift generator: the largest cases need 10^8 values, too many for std:: distributions.
void* random_device(int64_t n, fd::DType dtype, double mean, double sd, uint64_t& state) {
  const size_t bytes = static_cast<size_t>(n) * fd::dtype_size(dtype);
  std::vector<unsigned char> host(bytes);
  const float lo = static_cast<float>(mean - 1.7320508 * sd);
  const float width = static_cast<float>(2 * 1.7320508 * sd);
  for (int64_t i = 0; i < n; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float x = lo + width * static_cast<float>(state >> 40) * (1.f / 16777216.f);
    if (dtype == fd::DType::bf16)
      reinterpret_cast<__nv_bfloat16*>(host.data())[i] = __float2bfloat16(x);
    else
      reinterpret_cast<float*>(host.data())[i] = x;
  }
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  check(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice), "upload");
  return p;
}

fd::TensorView view(void* data, fd::DType dtype, std::initializer_list<int64_t> shape) {
  return fd::make_view(data, dtype, shape, fd::Device::cuda);
}

struct Case {
  std::string name;
  fd::Mechanism mechanism;
  int64_t B, H;
  std::vector<int64_t> lens;  // one entry: B rows of that length; several: varlen (B = 1)
  bool gate_in_kernel;
};

struct Inputs {
  fd::ForwardArgs args;
  std::vector<void*> owned;
};

Inputs make_inputs(const Case& c, int64_t K, int64_t V, uint64_t& rng) {
  Inputs in;
  const bool varlen = c.lens.size() > 1;
  int64_t T = 0;
  for (const int64_t n : c.lens) T += n;
  if (!varlen) T = c.lens[0];
  const int64_t N = varlen ? static_cast<int64_t>(c.lens.size()) : c.B, B = c.B, H = c.H;
  const bool kda = c.mechanism == fd::Mechanism::kda;
  auto add = [&](int64_t n, fd::DType t, double mean, double sd) {
    in.owned.push_back(random_device(n, t, mean, sd, rng));
    return in.owned.back();
  };
  fd::ForwardArgs& a = in.args;
  const fd::DType bf = fd::DType::bf16, f32 = fd::DType::f32;
  a.q = view(add(B * T * H * K, bf, 0, 1), bf, {B, T, H, K});
  a.k = view(add(B * T * H * K, bf, 0, 1), bf, {B, T, H, K});
  a.v = view(add(B * T * H * V, bf, 0, 1), bf, {B, T, H, V});
  a.o = view(add(B * T * H * V, bf, 0, 0), bf, {B, T, H, V});
  // A raw gate (in-kernel activation) or a log gate around -0.02 per step.
  if (kda)
    a.g = view(add(B * T * H * K, bf, c.gate_in_kernel ? 0 : -0.02, c.gate_in_kernel ? 1 : 0.01),
               bf, {B, T, H, K});
  else
    a.g = view(add(B * T * H, bf, -0.02, 0.01), bf, {B, T, H});
  a.beta = view(add(B * T * H, bf, 0, 1), bf, {B, T, H});
  a.initial_state = view(add(N * H * K * V, f32, 0, 0.1), f32, {N, H, V, K});
  a.final_state = view(add(N * H * K * V, f32, 0, 0), f32, {N, H, V, K});
  if (c.gate_in_kernel) {
    a.A_log = view(add(H, f32, 1, 0.5), f32, {H});
    a.dt_bias = view(add(H * K, f32, 0, 0.5), f32, {H * K});
  }
  if (varlen) {
    std::vector<int64_t> offsets{0};
    for (const int64_t n : c.lens) offsets.push_back(offsets.back() + n);
    void* p = nullptr;
    check(cudaMalloc(&p, offsets.size() * 8), "cudaMalloc");
    check(cudaMemcpy(p, offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice), "upload");
    in.owned.push_back(p);
    a.cu_seqlens = view(p, fd::DType::i64, {static_cast<int64_t>(offsets.size())});
  }
  return in;
}

fd::Options options_of(const Case& c) {
  fd::Options o;
  o.mechanism = c.mechanism;
  o.qk_l2norm = true;
  o.beta_sigmoid = c.mechanism == fd::Mechanism::kda;
  o.state_layout = fd::StateLayout::v_first;
  o.gate_in_kernel = c.gate_in_kernel;
  if (c.gate_in_kernel) o.lower_bound = -5.0;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  int reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--only") only = argv[i + 1];
    else if (flag == "--reps") reps = std::max(1, std::atoi(argv[i + 1]));
  }
  const std::vector<Case> cases = {
      {"kda_T8192_H64", fd::Mechanism::kda, 1, 64, {8192}, true},
      {"kda_T8192_H96", fd::Mechanism::kda, 1, 96, {8192}, true},
      {"kda_varlen_H64", fd::Mechanism::kda, 1, 64, {1300, 547, 2048, 963, 271, 3063}, true},
      {"kda_T32768_H32", fd::Mechanism::kda, 1, 32, {32768}, true},
      {"kda_train_B8_T4096_H16", fd::Mechanism::kda, 8, 16, {4096}, false},
      {"gdn_T8192_H64", fd::Mechanism::gated_deltanet, 1, 64, {8192}, false},
  };
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("# CUDA chunkwise forward alone, %s; K = V = 128, bf16 inputs; median of %d\n",
              prop.name, reps);
  std::printf("%-26s %12s %12s\n", "case", "ms", "ms (alloc)");
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  for (const Case& c : cases) {
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    Inputs sets[2] = {make_inputs(c, 128, 128, rng), make_inputs(c, 128, 128, rng)};
    const fd::Options opt = options_of(c);
    const size_t bytes = fd::forward_workspace_bytes(sets[0].args, opt, fd::Schedule::chunk);
    void* workspace = nullptr;
    check(cudaMalloc(&workspace, bytes), "cudaMalloc workspace");
    auto time = [&](bool caller_workspace) {
      for (Inputs& s : sets) {
        s.args.workspace = caller_workspace ? workspace : nullptr;
        s.args.workspace_bytes = caller_workspace ? bytes : 0;
      }
      for (int i = 0; i < 3; ++i) fd::forward(sets[i % 2].args, opt, fd::Schedule::chunk);
      std::vector<double> ms;
      for (int i = 0; i < reps; ++i) {
        check(cudaEventRecord(start), "record");
        fd::forward(sets[i % 2].args, opt, fd::Schedule::chunk);
        check(cudaEventRecord(stop), "record");
        check(cudaEventSynchronize(stop), "sync");
        float t = 0;
        check(cudaEventElapsedTime(&t, start, stop), "elapsed");
        ms.push_back(t);
      }
      return median(ms);
    };
    const double with_workspace = time(true), allocating = time(false);
    std::printf("%-26s %12.3f %12.3f\n", c.name.c_str(), with_workspace, allocating);
    cudaFree(workspace);
    for (Inputs& s : sets)
      for (void* p : s.owned) cudaFree(p);
  }
  return 0;
}
