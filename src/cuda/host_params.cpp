// Host-side translation of validated problems into the CUDA kernels' plain-data arguments.
#include "cuda/host_params.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/chunk_params.h"

namespace flashdelta::detail {

cuda::TokenTensor token_tensor(const TensorView& t) {
  cuda::TokenTensor x;
  if (!t.present()) return x;
  x.data = t.data;
  x.dtype = t.dtype;
  for (int i = 0; i < t.rank && i < 4; ++i) x.stride[i] = t.stride[i];
  return x;
}

bool bf16_dense_runs(const cuda::TokenTensor& x, int64_t channels) {
  constexpr int64_t kRun = 8;  // bfloat16 elements in 16 bytes
  return x.dtype == DType::bf16 && x.stride[3] == 1 && channels % kRun == 0 &&
         reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride[0] % kRun == 0 &&
         x.stride[1] % kRun == 0 && x.stride[2] % kRun == 0;
}

cuda::StateTensor state_tensor(const StateView& s) {
  cuda::StateTensor x;
  if (!s.t.present()) return x;
  x.data = s.t.data;
  x.slot_stride = s.t.stride[0];
  x.head_stride = s.t.stride[1];
  x.key_stride = s.key_step();
  x.value_stride = s.value_step();
  return x;
}

cuda::IndexTensor index_tensor(const TensorView& t) {
  cuda::IndexTensor x;
  if (!t.present()) return x;
  x.data = t.data;
  x.is_i64 = t.dtype == DType::i64;
  x.stride[0] = t.stride[0];
  x.stride[1] = t.rank == 2 ? t.stride[1] : 0;
  x.cols = t.rank == 2 ? t.shape[1] : 1;
  return x;
}

cuda::RecurrentParams problem_params(const Problem& p) {
  cuda::RecurrentParams r;
  const TokenViews& in = p.in;
  r.N = p.N;
  r.T = p.T;
  r.HV = p.HV;
  r.group = p.group;
  if (p.group <= INT32_MAX)
    r.group_divisor = cuda::make_fast_divisor(static_cast<uint32_t>(p.group));
  r.K = p.K;
  r.V = p.V;
  r.gate = p.gate == GateKind::vector   ? cuda::GateForm::vector
           : p.gate == GateKind::scalar ? cuda::GateForm::scalar
                                        : cuda::GateForm::none;
  r.delta = p.delta;
  r.scale = static_cast<float>(p.scale);
  const Options& o = p.options;
  r.qk_l2norm = o.qk_l2norm;
  r.beta_sigmoid = o.beta_sigmoid;
  r.beta_factor = o.allow_neg_eigval ? 2.f : 1.f;
  r.gate_in_kernel = o.gate_in_kernel;
  r.has_lower_bound = o.lower_bound.has_value();
  r.lower_bound = o.lower_bound ? static_cast<float>(*o.lower_bound) : 0.f;
  r.q = token_tensor(in.q);
  r.k = token_tensor(in.k);
  r.v = token_tensor(in.v);
  r.g = token_tensor(in.g);
  r.beta = token_tensor(in.beta);
  r.cu_seqlens = index_tensor(p.cu_seqlens);  // device-resident: read by the kernel
  if (o.gate_in_kernel && in.A_log.present()) {
    r.A_log = in.A_log.data;
    r.A_log_dtype = in.A_log.dtype;
    r.A_log_stride = in.A_log.stride[0];
  }
  if (o.gate_in_kernel && in.dt_bias.present()) {
    const TensorView& b = in.dt_bias;
    r.dt_bias = b.data;
    r.dt_bias_dtype = b.dtype;
    const int64_t per_head = p.gate == GateKind::vector ? p.K : 1;
    r.dt_bias_head_stride = b.rank == 2 ? b.stride[0] : per_head * b.stride[0];
    r.dt_bias_key_stride = b.rank == 2 ? b.stride[1] : b.stride[0];
  }
  return r;
}

void require_f32_state(const TensorView& s, const char* name) {
  if (s.present() && s.dtype != DType::f32)
    throw Error(ErrorCode::unsupported, std::string("argument '") + name +
                                            "': the CUDA schedules keep float32 states, got " +
                                            dtype_name(s.dtype));
}

void check_kernel_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(ErrorCode::runtime,
                std::string(what) + " kernel launch failed: " + cudaGetErrorString(err));
}

void require_sm80(const char* what) {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    throw Error(ErrorCode::runtime, std::string(what) + ": no usable CUDA device");
  if (major < 8)
    throw Error(ErrorCode::unsupported,
                std::string(what) + " needs a GPU of compute capability 8.0 or later, got " +
                    std::to_string(major) + ".x");
}

std::string env_setting(const char* name, std::initializer_list<const char*> allowed) {
  const char* env = std::getenv(name);
  const std::string value = env ? env : "";
  std::string expected;
  for (const char* a : allowed) {
    if (value.empty() || value == a) return value;
    expected += (expected.empty() ? "" : ", ") + std::string(a);
  }
  throw Error(ErrorCode::invalid_argument, std::string("environment variable ") + name +
                                               ": expected one of " + expected + ", got '" +
                                               value + "'");
}

namespace {

// `query(device)` for the current device (0 without one or when it fails), cached per device
// in `cache` (0 = not asked yet): the decode path asks on every call.
template <class T, class Query>
T cached_per_device(std::array<std::atomic<T>, 64>& cache, Query query) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const bool cacheable = device >= 0 && device < static_cast<int>(cache.size());
  if (cacheable)
    if (const T value = cache[device].load(std::memory_order_relaxed)) return value;
  const T value = query(device);
  if (cacheable && value) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

}  // namespace

int sm_count() {
  static std::array<std::atomic<int>, 64> cached{};
  return cached_per_device(cached, [](int device) {
    int sms = 0;
    return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess
               ? sms
               : 0;
  });
}

double peak_memory_bandwidth() {
  static std::array<std::atomic<double>, 64> cached{};
  return cached_per_device(cached, [](int device) {
    int khz = 0, bits = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess)
      return 0.0;
    return 2.0 * khz * 1e3 * bits / 8;
  });
}

int64_t chunks_per_row(const Problem& p) { return (p.T + cuda::kChunk - 1) / cuda::kChunk; }

int64_t chunk_count_bound(const Problem& p) {
  return p.cu_seqlens.present() ? chunks_per_row(p) + p.N : p.B * chunks_per_row(p);
}

void check_chunk_records(const Problem& p, const char* what) {
  const int64_t records = chunk_count_bound(p) * p.HV;
  if (records > INT_MAX)
    throw Error(ErrorCode::unsupported,
                std::string("argument 'q': ") + what + " keeps at most 2^31 - 1 chunk records "
                "(chunks x value heads), got " + std::to_string(records));
}

ScanSplit split_scan(const char* setting, int64_t scans, int64_t K, int64_t V, int64_t chunks,
                     double maps_step) {
  const std::string value = env_setting(setting, {"auto", "1", "2", "3", "4", "8"});
  int64_t best = 1;
  if (K > 128 || chunks < 2) {
    best = 1;
  } else if (!value.empty() && value != "auto") {
    best = std::min<int64_t>(std::stoi(value), chunks);
  } else {
    constexpr int64_t kWave = 128, kMinSegmentChunks = 16;
    // Once a count's blocks pass a wave, its waves grow as its segments' chunks shrink and
    // each segment adds a carry: the model's pick lies far below 4096, where the search stops
    // (short where a view makes T huge: 2^40 tokens of one broadcast token, ~2^34 chunks).
    constexpr int64_t kMostSegments = 4096;
    const int64_t value_tiles = (V + 63) / 64, map_tiles = value_tiles + (K + 63) / 64;
    auto waves = [](int64_t blocks) { return (blocks + kWave - 1) / kWave; };
    double best_steps = static_cast<double>(waves(scans * value_tiles) * chunks);
    const int64_t most = std::min(chunks / kMinSegmentChunks, kMostSegments);
    for (int64_t s = 2; s <= most; ++s) {
      const int64_t per = (chunks + s - 1) / s;
      const double steps = maps_step * static_cast<double>(waves(scans * map_tiles * (s - 1)) * per) +
                           static_cast<double>((s - 1) + waves(scans * value_tiles * s) * per);
      if (steps < best_steps) best = s, best_steps = steps;
    }
  }
  // As many segments as whole runs of the rounded-up length fill (no empty last one).
  ScanSplit split;
  split.segment_chunks = (chunks + best - 1) / best;
  if (split.segment_chunks > 0)
    split.segments = (chunks + split.segment_chunks - 1) / split.segment_chunks;
  return split;
}

}  // namespace flashdelta::detail
