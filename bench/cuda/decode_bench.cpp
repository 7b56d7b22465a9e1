// C++ timing of the CUDA decode kernel alone (no Python): KDA serving steps, K = V = 128,
// bf16 inputs, fp32 (or bf16) state pool updated in place, against the device's copy
// bandwidth measured in the same process. Several pools are rotated so the state is read
// from HBM, not L2; CUDA events around each call; medians. Every case is also timed as a
// CUDA graph of 100 steps, which removes launch overhead (the kernel's own time), and small
// batches (N <= 4) by the host's time per call (validation and launch, no Python).
//
//   flashdelta_cuda_decode_bench [--json FILE] [--only SUBSTRING] [--sweep 1]
//
// --sweep 1 adds KDA K-first and V-first steps for N = 40 ... 256: a line fitted to the graph
// time against N splits a step into a per-launch cost (intercept: ramp and drain) and the
// streaming rate (slope).
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

void* device_alloc(size_t bytes, float fill_scale) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  // Small non-zero values: bf16 0x3c00..., fp32 patterns alike are finite.
  check(cudaMemset(p, fill_scale > 0 ? 0x3c : 0, bytes), "memset");
  return p;
}

struct Case {
  std::string name;
  int64_t N, H, HV, K, V, T;
  fd::StateLayout layout;
  fd::DType state;
  fd::Mechanism mechanism;
  bool out_of_place = false;  // forward from one pool into another instead of in place
};

struct Result {
  double ms, graph_us, state_gbs;
  double host_us;  // host time of one call (validation + launch); 0 where not measured
};

Result run_case(const Case& c) {
  const int pools = std::max<int64_t>(2, std::min<int64_t>(16, (256ll << 20) /
                                                                   (c.N * c.HV * c.K * c.V * 4) + 1));
  const size_t sbytes = fd::dtype_size(c.state);
  const int64_t slot = c.HV * c.K * c.V;
  const bool kda = c.mechanism == fd::Mechanism::kda;
  std::vector<fd::DecodeArgs> args(pools);
  for (int i = 0; i < pools; ++i) {
    fd::DecodeArgs& a = args[i];
    const fd::DType bf = fd::DType::bf16;
    a.q = fd::make_view(device_alloc(c.N * c.T * c.H * c.K * 2, 1), bf, {c.N, c.T, c.H, c.K}, fd::Device::cuda);
    a.k = fd::make_view(device_alloc(c.N * c.T * c.H * c.K * 2, 1), bf, {c.N, c.T, c.H, c.K}, fd::Device::cuda);
    a.v = fd::make_view(device_alloc(c.N * c.T * c.HV * c.V * 2, 1), bf, {c.N, c.T, c.HV, c.V}, fd::Device::cuda);
    a.g = kda ? fd::make_view(device_alloc(c.N * c.T * c.HV * c.K * 2, 1), bf, {c.N, c.T, c.HV, c.K}, fd::Device::cuda)
              : fd::make_view(device_alloc(c.N * c.T * c.HV * 2, 1), bf, {c.N, c.T, c.HV}, fd::Device::cuda);
    a.beta = fd::make_view(device_alloc(c.N * c.T * c.HV * 2, 1), bf, {c.N, c.T, c.HV}, fd::Device::cuda);
    a.A_log = fd::make_view(device_alloc(c.HV * 4, 0), fd::DType::f32, {c.HV}, fd::Device::cuda);
    a.dt_bias = kda ? fd::make_view(device_alloc(c.HV * c.K * 4, 0), fd::DType::f32, {c.HV * c.K}, fd::Device::cuda)
                    : fd::make_view(device_alloc(c.HV * 4, 0), fd::DType::f32, {c.HV}, fd::Device::cuda);
    void* pool = device_alloc(c.N * slot * sbytes, 0);
    a.state_pool = c.layout == fd::StateLayout::k_first
                       ? fd::make_view(pool, c.state, {c.N, c.HV, c.K, c.V}, fd::Device::cuda)
                       : fd::make_view(pool, c.state, {c.N, c.HV, c.V, c.K}, fd::Device::cuda);
    std::vector<int32_t> idx(c.N * c.T);
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t t = 0; t < c.T; ++t) idx[n * c.T + t] = c.T == 1 ? n : (n + t * c.N) % c.N;
    void* d_idx = device_alloc(idx.size() * 4, 0);
    check(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice), "idx");
    a.state_indices = c.T == 1 ? fd::make_view(d_idx, fd::DType::i32, {c.N}, fd::Device::cuda)
                               : fd::make_view(d_idx, fd::DType::i32, {c.N, c.T}, fd::Device::cuda);
    a.o = fd::make_view(device_alloc(c.N * c.T * c.HV * c.V * 2, 0), bf, {c.N, c.T, c.HV, c.V}, fd::Device::cuda);
  }
  fd::Options o;
  o.mechanism = c.mechanism;
  o.qk_l2norm = true;
  o.beta_sigmoid = true;
  o.gate_in_kernel = true;
  o.state_layout = c.layout;
  if (c.T > 1) {  // per-token slots: each row's tokens write distinct slots (a permutation)
    for (auto& a : args) a.state_indices = fd::make_view(a.state_indices.data, fd::DType::i32, {c.N, c.T}, fd::Device::cuda);
  }

  cudaStream_t s;
  check(cudaStreamCreate(&s), "stream");
  for (auto& a : args) a.stream = s;
  // One step: a serving call in place, or a forward reading pool i and writing pool i + 1.
  const auto step = [&](int i) {
    const fd::DecodeArgs& a = args[i % pools];
    if (!c.out_of_place) return fd::decode(a, o);
    fd::ForwardArgs f;
    f.q = a.q, f.k = a.k, f.v = a.v, f.g = a.g, f.beta = a.beta, f.A_log = a.A_log;
    f.dt_bias = a.dt_bias, f.o = a.o, f.stream = a.stream;
    f.initial_state = a.state_pool;
    f.final_state = args[(i + 1) % pools].state_pool;
    fd::forward(f, o, fd::Schedule::recurrent);
  };
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 3 * pools; ++i) step(i);
  std::vector<double> ms;
  for (int i = 0; i < 200; ++i) {
    cudaEventRecord(e0, s);
    step(i);
    cudaEventRecord(e1, s);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  // 100 steps in a graph, rotating pools: the kernel's own time per step.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < 100; ++i) step(i);
  check(cudaStreamEndCapture(s, &graph), "capture end");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  std::vector<double> graph_us;
  for (int r = 0; r < 20; ++r) {
    cudaEventRecord(e0, s);
    cudaGraphLaunch(exec, s);
    cudaEventRecord(e1, s);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    graph_us.push_back(t * 1000.0 / 100);
  }
  check(cudaGetLastError(), "run");
  const double med = median(ms);
  const double bytes = 2.0 * c.N * slot * sbytes;
  // The host's time per call where the GPU's steps are short (N <= 4: the launch queue
  // holds the calls), median of 5 loops.
  const double host_us = c.N <= 4 ? flashdelta::bench::host_us_per_call(step, s, 5) : 0.0;
  Result r{med, median(graph_us), bytes / (med * 1e-3) / 1e9, host_us};
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (auto& a : args)
    for (void* p : {a.q.data, a.k.data, a.v.data, a.g.data, a.beta.data, a.A_log.data, a.dt_bias.data,
                    a.state_pool.data, a.state_indices.data, a.o.data})
      cudaFree(p);
  cudaStreamDestroy(s);
  return r;
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t{1} << 30;
  void *a = device_alloc(bytes, 0), *b = device_alloc(bytes, 0);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> gbs;
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 3) gbs.push_back(2.0 * bytes / (t * 1e-3) / 1e9);  // read + write
  }
  cudaFree(a);
  cudaFree(b);
  return median(gbs);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  std::string only;  // --only SUBSTRING: run the matching cases only (for profilers)
  bool sweep = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--json") json_path = argv[i + 1];
    if (std::string(argv[i]) == "--only") only = argv[i + 1];
    if (std::string(argv[i]) == "--sweep") sweep = std::string(argv[i + 1]) != "0";
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  const double copy = copy_bandwidth_gbs();
  const fd::StateLayout kf = fd::StateLayout::k_first, vf = fd::StateLayout::v_first;
  const fd::DType f32 = fd::DType::f32, bf16 = fd::DType::bf16;
  std::vector<Case> cases = {
      {"kda N=256 HV=32 k_first", 256, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda N=256 HV=32 v_first", 256, 32, 32, 128, 128, 1, vf, f32, fd::Mechanism::kda},
      {"kda N=64 HV=32 k_first", 64, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda N=64 HV=32 v_first", 64, 32, 32, 128, 128, 1, vf, f32, fd::Mechanism::kda},
      {"kda N=1 HV=32 k_first", 1, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda N=1 HV=32 v_first", 1, 32, 32, 128, 128, 1, vf, f32, fd::Mechanism::kda},
      {"kda N=2 HV=32 k_first", 2, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda N=2 HV=32 v_first", 2, 32, 32, 128, 128, 1, vf, f32, fd::Mechanism::kda},
      {"kda N=4 HV=32 k_first", 4, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda N=4 HV=32 v_first", 4, 32, 32, 128, 128, 1, vf, f32, fd::Mechanism::kda},
      {"kda N=8 HV=32 k_first", 8, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda N=16 HV=32 k_first", 16, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda gva H=16 HV=32 N=256", 256, 16, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda},
      {"kda K=V=256 N=64", 64, 32, 32, 256, 256, 1, kf, f32, fd::Mechanism::kda},
      {"kda T=4 N=64 per-token", 64, 32, 32, 128, 128, 4, kf, f32, fd::Mechanism::kda},
      {"kda bf16 state N=256", 256, 32, 32, 128, 128, 1, kf, bf16, fd::Mechanism::kda},
      {"gdn N=256 HV=32", 256, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::gated_deltanet},
      {"kda N=256 out-of-place k_first", 256, 32, 32, 128, 128, 1, kf, f32, fd::Mechanism::kda, true},
      {"kda N=256 out-of-place v_first", 256, 32, 32, 128, 128, 1, vf, f32, fd::Mechanism::kda, true},
  };
  if (sweep)
    for (const fd::StateLayout layout : {kf, vf})
      for (int64_t n : {40, 44, 48, 50, 52, 56, 60, 61, 62, 63, 64, 66, 68, 72, 74, 75, 76, 80, 88, 96,
                        112, 128, 160, 192, 224, 256})
        cases.push_back({"sweep kda N=" + std::to_string(n) + (layout == kf ? " k_first" : " v_first"),
                         n, 32, 32, 128, 128, 1, layout, f32, fd::Mechanism::kda});
  std::printf("device: %s, copy bandwidth %.0f GB/s (read + write)\n", prop.name, copy);
  std::printf("%-28s %10s %12s %10s %8s %8s\n", "case", "ms", "graph us", "GB/s", "% copy",
              "host us");
  std::string json = "{\"device\": \"" + std::string(prop.name) +
                     "\", \"copy_gbs\": " + std::to_string(copy) + ", \"cases\": [";
  bool first = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!only.empty() && cases[i].name.find(only) == std::string::npos) continue;
    const Result r = run_case(cases[i]);
    std::printf("%-28s %10.4f %12.2f %10.0f %7.1f%% %8.2f\n", cases[i].name.c_str(), r.ms,
                r.graph_us, r.state_gbs, 100.0 * r.state_gbs / copy, r.host_us);
    json += std::string(first ? "" : ", ") + "{\"case\": \"" + cases[i].name + "\", \"ms\": " +
            std::to_string(r.ms) + ", \"graph_us\": " + std::to_string(r.graph_us) +
            ", \"state_gbs\": " + std::to_string(r.state_gbs) +
            ", \"host_us\": " + std::to_string(r.host_us) + "}";
    first = false;
  }
  json += "]}\n";
  if (json_path) {
    FILE* f = std::fopen(json_path, "w");
    if (f) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
