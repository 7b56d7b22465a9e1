// Host side of the CUDA chunkwise backward: sizes and carves the float32 workspace
// (cuda/backward_params.h), the caller's or one from the stream-ordered allocator
// (cuda/workspace.h), and launches the stages in order on the caller's stream without
// synchronising, in passes over slices of the heads when one pass would need too much
// workspace (heads_per_pass).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include "cuda/backward_params.h"
#include "cuda/chunk_params.h"
#include "cuda/cuda.h"
#include "cuda/host_params.h"
#include "cuda/workspace.h"

namespace flashdelta::detail {
namespace {

// The gradient buffers come first: they must read as zero where no chunk writes (token rows
// outside every sequence of a varlen batch). Without varlen every row is a chunk's, and the
// stages write every element of dq, dk, dg and dv (the first writer stores, later ones add):
// only dbeta and dA_log_part, which some mechanisms leave unwritten, are zeroed then.
constexpr size_t kTokenGradRegions = 4, kZeroedRegions = 6;

// Forces the scans' split (split_scan).
constexpr const char* kSegmentsSetting = "FLASHDELTA_BACKWARD_SCAN_SEGMENTS";
// `f32` keeps the chunk states and their gradients in float32 for 16-bit inputs too
// (backward_bf16_states).
constexpr const char* kStatesSetting = "FLASHDELTA_BACKWARD_STATES";
// A maps step against a scan step: counted alike here (measured 0.65-0.9 of one, bench/
// NOTES.md (aa); the split counts were chosen and tested with this weight).
constexpr double kMapsStep = 1.0;

Carver layout(cuda::BackwardParams& b, bool varlen) {
  cuda::BackwardWorkspace& w = b.ws;
  const int64_t rows = b.B * b.p.T, HV = b.p.HV, K = b.p.K, V = b.p.V;
  const int64_t rk = rows * HV * K, rv = rows * HV * V, records = b.max_chunks * HV;
  Carver c;
  c.add(w.dq, rk);
  c.add(w.dk, rk);
  c.add(w.dg, rk);
  c.add(w.dv, rv);
  c.add(w.dbeta, rows * HV);
  c.add(w.dA_log_part, rows * HV);
  c.add(w.chunk_start, varlen ? b.p.N + 1 : 0);
  c.add(w.qn, rows * b.H * K);
  c.add(w.kn, rows * b.H * K);
  c.add(w.gate, rk);
  c.add(w.beta, rows * HV);
  c.add(w.dout, rv);
  // The chunks' own intermediates, record-major: a chunk's rows are contiguous.
  const int64_t record_rows = records * cuda::kChunk;
  for (float** p : {&w.gamma, &w.qg, &w.kg, &w.kb, &w.w, &w.dw}) c.add(*p, record_rows * K);
  for (float** p : {&w.vb, &w.u, &w.vn, &w.dvn}) c.add(*p, record_rows * V);
  const int64_t tile = cuda::kChunk * cuda::kChunk;
  for (float** p : {&w.aqk, &w.tm, &w.kdot}) c.add(*p, records * tile);
  c.add(w.decay, records * K);
  c.add(w.dgamma, records * K);
  const int64_t slab = records * K * V;
  c.add(w.states, b.bf16_states ? 0 : slab);
  c.add(w.dstates, b.bf16_states ? 0 : slab);
  c.add(w.states16, b.bf16_states ? slab : 0);
  c.add(w.dstates16, b.bf16_states ? slab : 0);
  c.add(w.segment_maps, b.segments > 1 ? b.p.N * HV * b.segments * K * (K + V) : 0);
  return c;
}

cuda::HeadParam head_param(const TensorView& t, int64_t width) {
  cuda::HeadParam h;
  if (!t.present()) return h;
  h.data = t.data;
  h.dtype = t.dtype;
  h.head_stride = t.rank == 2 ? t.stride[0] : width * t.stride[0];
  h.key_stride = t.rank == 2 ? t.stride[1] : t.stride[0];
  return h;
}

cuda::BackwardParams backward_params(const Problem& p, const BackwardArgs& a) {
  const StateLayout layout = p.options.state_layout;
  cuda::BackwardParams b;
  b.p = problem_params(p);
  b.p.state_in = state_tensor(StateView{a.initial_state, layout});
  b.state_in_dtype = a.initial_state.dtype;
  b.B = p.B;
  b.H = p.H;
  b.chunks_per_row = chunks_per_row(p);
  b.max_chunks = chunk_count_bound(p);
  const ScanSplit split = split_scan(kSegmentsSetting, p.N * p.HV, p.K, p.V, b.chunks_per_row, kMapsStep);
  b.segments = split.segments;
  b.segment_chunks = split.segment_chunks;
  b.d_o = token_tensor(a.d_o);
  b.d_final = state_tensor(StateView{a.d_final_state, layout});
  b.d_final_dtype = a.d_final_state.dtype;
  b.chunk_states = state_tensor(StateView{a.chunk_states, layout});
  b.chunk_states_dtype = a.chunk_states.dtype;
  b.chunk_states_count = a.chunk_states.present() ? a.chunk_states.shape[0] : 0;
  b.bf16_states = backward_bf16_states(p, a.chunk_states.present());
  b.dq = token_tensor(a.dq);
  b.dk = token_tensor(a.dk);
  b.dv = token_tensor(a.dv);
  b.dg = token_tensor(a.dg);
  b.dbeta = token_tensor(a.dbeta);
  b.d_initial = state_tensor(StateView{a.d_initial_state, layout});
  b.d_initial_dtype = a.d_initial_state.dtype;
  b.dA_log = head_param(a.dA_log, 1);
  b.ddt_bias = head_param(a.ddt_bias, p.gate == GateKind::vector ? p.K : 1);
  return b;
}

// Shared memory per block the current device offers (opt-in); Error(runtime) without one.
int64_t shared_memory_per_block() {
  int device = 0, available = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess)
    throw Error(ErrorCode::runtime, "the CUDA chunk backward: no usable CUDA device");
  return available;
}

// Throws Error(unsupported) when the GPU lacks the per-block shared memory of the per-chunk
// and tile-scan kernels (about 102 KB: Hopper and A100 have it, GPUs with 99 KB per block
// do not); called before anything is launched.
void require_shared_memory(int64_t available) {
  const int64_t needed =
      std::max({cuda::backward_chunk_shared_bytes(), cuda::backward_scan_shared_bytes(),
                cuda::backward_keys_shared_bytes()});
  if (available < needed)
    throw Error(ErrorCode::unsupported,
                "argument 'q': the CUDA chunk backward needs " + std::to_string(needed) +
                    " bytes of shared memory per block; this GPU offers " +
                    std::to_string(available));
}

// The stages of one pass, in order on the stream (the chunk table first with cu_seqlens: it
// lives in the pass's workspace).
void run_stages(const cuda::BackwardParams& b, bool varlen, void* stream) {
  if (varlen) {
    cuda::ChunkParams table;
    table.p = b.p;
    table.max_chunks = b.max_chunks;
    table.ws.chunk_start = b.ws.chunk_start;
    cuda::launch_chunk_table(table, stream);
    check_kernel_launch("CUDA backward chunk table");
  }
  using Launch = void (*)(const cuda::BackwardParams&, void*);
  // Kept forward states replace the sequential states pass with a parallel one.
  const Launch states = b.chunk_states.data ? cuda::launch_backward_given_states
                        : b.scans_mma        ? cuda::launch_backward_states_mma
                                             : cuda::launch_backward_states;
  const Launch dstates =
      b.scans_mma ? cuda::launch_backward_dstates_mma : cuda::launch_backward_dstates;
  const std::pair<Launch, const char*> stages[] = {
      {cuda::launch_backward_inputs, "inputs"},   {cuda::launch_backward_records, "records"},
      {states, "states"},                         {dstates, "dstates"},
      {cuda::launch_backward_keys, "keys"},       {cuda::launch_backward_grads, "grads"},
      {cuda::launch_backward_outputs, "outputs"}, {cuda::launch_backward_params, "params"}};
  for (const auto& [launch, name] : stages) {
    launch(b, stream);
    check_kernel_launch((std::string("CUDA backward ") + name).c_str());
  }
}

// A slice of `count` heads starting at `first` along dimension `dim` of t; a head spans
// `width` entries of that dimension (dt_bias given flat as [HV * K]).
TensorView head_slice(TensorView t, int dim, int64_t first, int64_t count, int64_t width = 1) {
  if (!t.present() || dim >= t.rank) return t;
  t.data = static_cast<char*>(t.data) + first * width * t.stride[dim] * dtype_size(t.dtype);
  t.shape[dim] = count * width;
  return t;
}

// The problem and arguments restricted to key heads [h0, h0 + count) and their value heads:
// the same backward on a slice of the heads, every view moved to the slice's first head.
std::pair<Problem, BackwardArgs> head_pass(const Problem& p, const BackwardArgs& a, int64_t h0,
                                           int64_t count) {
  const int64_t hv0 = h0 * p.group, hvs = count * p.group;
  const int64_t param_width = p.gate == GateKind::vector ? p.K : 1;
  auto key = [&](const TensorView& t) { return head_slice(t, 2, h0, count); };
  auto value = [&](const TensorView& t) { return head_slice(t, 2, hv0, hvs); };
  auto state = [&](const TensorView& t) { return head_slice(t, 1, hv0, hvs); };
  auto param = [&](const TensorView& t) {
    return head_slice(t, 0, hv0, hvs, t.rank == 1 ? param_width : 1);
  };
  Problem ps = p;
  ps.H = count;
  ps.HV = hvs;
  ps.in.q = key(p.in.q);
  ps.in.k = key(p.in.k);
  ps.in.v = value(p.in.v);
  ps.in.g = value(p.in.g);
  ps.in.beta = value(p.in.beta);
  ps.in.A_log = head_slice(p.in.A_log, 0, hv0, hvs);
  ps.in.dt_bias = param(p.in.dt_bias);
  BackwardArgs as = a;
  as.initial_state = state(a.initial_state);
  as.d_o = value(a.d_o);
  as.d_final_state = state(a.d_final_state);
  as.chunk_states = state(a.chunk_states);
  as.dq = key(a.dq);
  as.dk = key(a.dk);
  as.dv = value(a.dv);
  as.dg = value(a.dg);
  as.dbeta = value(a.dbeta);
  as.d_initial_state = state(a.d_initial_state);
  as.dA_log = head_slice(a.dA_log, 0, hv0, hvs);
  as.ddt_bias = param(a.ddt_bias);
  return {ps, as};
}

int64_t workspace_bytes(const Problem& p, int64_t heads, bool kept) {
  Problem ps = p;
  ps.H = heads;
  ps.HV = heads * p.group;
  cuda::BackwardParams b = backward_params(ps, BackwardArgs{});
  b.bf16_states = backward_bf16_states(ps, kept);
  return layout(b, p.cu_seqlens.present()).total();
}

// Float32 bytes of q, k, v and g with q and k counted per value head: the scale the workspace
// is held to. The workspace is per value head (its key-head arrays are two of ~20), and so is
// fla's memory (3742 MiB a GVA step of H = 8, HV = 16 against 3872 at H = HV = 16); counted
// per key head, that GVA step ran in 3 passes of 6 value heads instead of 2 of 8: 13.24 ms
// against 12.12 now, its peak 2503 MiB against 3161 (bench/NOTES.md (ao)).
int64_t input_bytes(const Problem& p) {
  return int64_t{4} * p.B * p.T * p.HV * (3 * p.K + p.V);
}

// Key heads per pass. The float32 workspace grows linearly with the heads (about 11-12 KB per
// token and value head at K = V = 128), so the backward runs over slices of whole key-head
// groups one after another on the stream, reusing one workspace: as few, equal passes as
// keep it within three times input_bytes (fla keeps about 3.7 times that for the same
// shape), down to one key-head group per pass, which can need more. Fewer heads per pass
// means fewer blocks in the sequential scans.
int64_t heads_per_pass(const Problem& p, bool kept) {
  const int64_t budget = 3 * input_bytes(p), whole = workspace_bytes(p, p.H, kept);
  if (p.H <= 1 || whole <= budget) return p.H;
  const int64_t fit = std::max<int64_t>(1, static_cast<int64_t>(
                                                static_cast<double>(p.H) * budget / whole));
  const int64_t passes = (p.H + fit - 1) / fit;
  return (p.H + passes - 1) / passes;
}

}  // namespace

int cuda_backward_scan_columns(int64_t scans, int64_t V, int sms) {
  const std::string setting =
      env_setting("FLASHDELTA_BACKWARD_SCAN_COLUMNS", {"auto", "32", "16", "8"});
  if (setting.empty() || setting == "auto") {
    for (const int cols : cuda::kScanColumnWidths)
      if (scans * ((V + cols - 1) / cols) >= sms) return cols;
    return std::end(cuda::kScanColumnWidths)[-1];
  }
  return std::stoi(setting);
}

bool cuda_backward_scans_mma(int64_t K) {
  return env_setting("FLASHDELTA_BACKWARD_SCANS", {"tiles", "mma"}) != "tiles" && K <= 128;
}

int cuda_backward_mma_columns(int64_t scans, int64_t V, int64_t segments, int sms,
                              bool wide_fits) {
  const std::string setting =
      env_setting("FLASHDELTA_BACKWARD_MMA_COLUMNS", {"auto", "64", "128"});
  if (!wide_fits || setting == "64") return 64;
  if (setting == "128") return 128;
  return V > 64 && scans * segments * ((V + 63) / 64) > sms ? 128 : 64;
}

bool cuda_backward_scalar_pairs(GateKind gate) {
  return env_setting("FLASHDELTA_BACKWARD_GATE_PAIRS", {"auto", "general"}) != "general" &&
         gate == GateKind::scalar;
}

cuda::KeysProducts cuda_backward_keys_products() {
  const std::string setting =
      env_setting("FLASHDELTA_BACKWARD_KEYS", {"auto", "tf32", "mixed", "bf16"});
  return setting == "mixed" ? cuda::KeysProducts::mixed
         : setting == "bf16" ? cuda::KeysProducts::bf16
                             : cuda::KeysProducts::tf32;
}

bool cuda_backward_joint_bf16() {
  return env_setting("FLASHDELTA_BACKWARD_JOINT", {"auto", "tf32", "bf16"}) == "bf16";
}

BackwardFinish cuda_backward_finish() {
  const std::string setting =
      env_setting("FLASHDELTA_BACKWARD_FINISH", {"auto", "grads", "outputs"});
  return setting == "grads"     ? BackwardFinish::grads
         : setting == "outputs" ? BackwardFinish::outputs
                                : BackwardFinish::automatic;
}

CudaBackwardSplit cuda_backward_split(const Problem& p) {
  const BackwardFinish finish = cuda_backward_finish();
  if (p.cu_seqlens.present() || finish == BackwardFinish::outputs) return {};
  const bool scalar_short = cuda_backward_scalar_pairs(p.gate);
  if (finish == BackwardFinish::automatic && !scalar_short) return {};
  return {scalar_short, p.group == 1};
}

int64_t cuda_backward_scan_segments(int64_t scans, int64_t K, int64_t V, int64_t chunks) {
  return split_scan(kSegmentsSetting, scans, K, V, chunks, kMapsStep).segments;
}

bool backward_bf16_states(const Problem& p, bool kept) {
  const std::string setting = env_setting(kStatesSetting, {"auto", "f32"});
  const auto sixteen = [](const TensorView& t) {
    return t.dtype == DType::bf16 || t.dtype == DType::f16;
  };
  return setting != "f32" && !kept && sixteen(p.in.q) && sixteen(p.in.k) && sixteen(p.in.v);
}

int64_t cuda_chunk_backward_workspace_bytes(const Problem& p, bool kept) {
  check_chunk_records(p, "the CUDA chunk backward");
  return workspace_bytes(p, heads_per_pass(p, kept), kept);
}

void cuda_chunk_backward(const Problem& p, const BackwardArgs& a) {
  const bool varlen = p.cu_seqlens.present();
  const bool kept = a.chunk_states.present();
  check_chunk_records(p, "the CUDA chunk backward");
  const int64_t pass_heads = heads_per_pass(p, kept);
  const int64_t bytes = workspace_bytes(p, pass_heads, kept);
  // The caller's workspace is checked before anything else (no GPU is needed to fail here).
  if (a.workspace != nullptr || a.workspace_bytes > 0)
    check_caller_workspace(a.workspace, a.workspace_bytes, bytes);
  require_sm80("the CUDA chunk backward");
  const int64_t shared = shared_memory_per_block();
  require_shared_memory(shared);
  // The scans in registers unless the tile scans are asked for or the GPU lacks their shared
  // memory (170 KB at K = 128).
  const bool scans_mma =
      cuda_backward_scans_mma(p.K) && shared >= cuda::backward_scans_mma_shared_bytes(p.K, 64);
  const int64_t pass_scans = p.N * pass_heads * p.group;
  const int scan_cols = cuda_backward_scan_columns(pass_scans, p.V, sm_count());
  const int mma_cols = cuda_backward_mma_columns(
      pass_scans, p.V,
      cuda_backward_scan_segments(pass_scans, p.K, p.V, (p.T + cuda::kChunk - 1) / cuda::kChunk),
      sm_count(), scans_mma && shared >= cuda::backward_scans_mma_shared_bytes(p.K, 128));
  const bool scalar_pairs = cuda_backward_scalar_pairs(p.gate);
  const cuda::KeysProducts keys_products = cuda_backward_keys_products();
  const bool joint_bf16 = cuda_backward_joint_bf16();
  const CudaBackwardSplit split = cuda_backward_split(p);
  {
    const cuda::BackwardParams b = backward_params(p, a);
    // The per-chunk stages run one block per record (`keys` one per record and key tile); the
    // scans one per sequence, value head and column tile.
    const int64_t key_tiles = (p.K + cuda::kKeysTile - 1) / cuda::kKeysTile;
    const int64_t record_tiles = b.max_chunks * pass_heads * p.group * key_tiles,
                  scan_tiles = p.N * pass_heads * p.group * ((p.V + scan_cols - 1) / scan_cols),
                  param_blocks = pass_heads * p.group * (p.K + 1);
    if (record_tiles > INT_MAX || scan_tiles > INT_MAX || param_blocks > INT_MAX)
      throw Error(ErrorCode::unsupported,
                  "argument 'q': the CUDA chunk backward runs at most 2^31 - 1 blocks per "
                  "kernel, got " + std::to_string(record_tiles) + " per-chunk blocks, " +
                      std::to_string(scan_tiles) + " scan tiles, " +
                      std::to_string(param_blocks) + " gate-parameter sums");
  }

  const StreamWorkspace memory("CUDA chunk backward", bytes, a.workspace, a.workspace_bytes,
                               a.stream);
  for (int64_t h0 = 0; h0 < p.H; h0 += pass_heads) {
    const auto [ps, as] = head_pass(p, a, h0, std::min(pass_heads, p.H - h0));
    cuda::BackwardParams b = backward_params(ps, as);
    b.scan_cols = scan_cols;
    b.scans_mma = scans_mma;
    b.mma_cols = mma_cols;
    b.scalar_pairs = scalar_pairs;
    b.gate_in_grads = split.gate;
    b.rows_in_grads = split.rows;
    b.keys_products = b.bf16_states ? keys_products : cuda::KeysProducts::tf32;
    b.joint_bf16 = b.bf16_states && joint_bf16;
    if (!scans_mma) b.segments = 1;  // the tile scans run whole sequences
    b.transposed_maps = b.segments > 1 && !b.chunk_states.data;
    const Carver regions = layout(b, varlen);
    if (regions.total() > 0) {
      regions.carve(memory.data());
      const int64_t from = varlen ? 0 : regions.prefix(kTokenGradRegions);
      cudaMemsetAsync(static_cast<char*>(memory.data()) + from, 0,
                      static_cast<size_t>(regions.prefix(kZeroedRegions) - from),
                      static_cast<cudaStream_t>(a.stream));
    }
    run_stages(b, varlen, a.stream);
  }
}

}  // namespace flashdelta::detail
