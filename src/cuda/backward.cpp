// Host side of the CUDA chunkwise backward: sizes and carves the float32 workspace
// (cuda/backward_params.h), the caller's or one from the stream-ordered allocator
// (cuda/workspace.h), and launches the stages in order on the caller's stream without
// synchronising.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
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
// outside every sequence of a varlen batch).
constexpr size_t kZeroedRegions = 6;

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
  c.add(w.states, records * K * V);
  c.add(w.dstates, records * K * V);
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
  b.chunks_per_row = (p.T + cuda::kChunk - 1) / cuda::kChunk;
  b.max_chunks = p.cu_seqlens.present() ? b.chunks_per_row + p.N : p.B * b.chunks_per_row;
  b.d_o = token_tensor(a.d_o);
  b.d_final = state_tensor(StateView{a.d_final_state, layout});
  b.d_final_dtype = a.d_final_state.dtype;
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

// Throws Error(unsupported) when the GPU lacks the per-block shared memory of the per-chunk
// and scan kernels (about 107 KB: Hopper and A100 have it, GPUs with 99 KB per block do
// not); called before anything is launched.
void require_shared_memory() {
  const int64_t needed = std::max(cuda::backward_chunk_shared_bytes(),
                                  cuda::backward_scan_shared_bytes());
  int device = 0, available = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess)
    throw Error(ErrorCode::runtime, "the CUDA chunk backward: no usable CUDA device");
  if (available < needed)
    throw Error(ErrorCode::unsupported,
                "argument 'q': the CUDA chunk backward needs " + std::to_string(needed) +
                    " bytes of shared memory per block; this GPU offers " +
                    std::to_string(available));
}

}  // namespace

int64_t cuda_chunk_backward_workspace_bytes(const Problem& p) {
  cuda::BackwardParams b = backward_params(p, BackwardArgs{});
  return layout(b, p.cu_seqlens.present()).total();
}

void cuda_chunk_backward(const Problem& p, const BackwardArgs& a) {
  cuda::BackwardParams b = backward_params(p, a);
  const bool varlen = p.cu_seqlens.present();
  const Carver regions = layout(b, varlen);
  const int64_t bytes = regions.total();
  // The caller's workspace is checked before anything else (no GPU is needed to fail here).
  if (a.workspace != nullptr || a.workspace_bytes > 0)
    check_caller_workspace(a.workspace, a.workspace_bytes, bytes);
  require_sm80("the CUDA chunk backward");
  require_shared_memory();
  const int64_t records = b.max_chunks * p.HV, scan_tiles = p.N * p.HV * ((p.V + 31) / 32),
                param_blocks = p.HV * (p.K + 1);
  if (records > INT_MAX || scan_tiles > INT_MAX || param_blocks > INT_MAX)
    throw Error(ErrorCode::unsupported,
                "argument 'q': the CUDA chunk backward runs at most 2^31 - 1 blocks per kernel, "
                "got " + std::to_string(records) + " chunk records, " +
                    std::to_string(scan_tiles) + " scan tiles and " +
                    std::to_string(param_blocks) + " gate-parameter sums");

  const StreamWorkspace memory("CUDA chunk backward", bytes, a.workspace, a.workspace_bytes,
                               a.stream);
  if (bytes > 0) {
    regions.carve(memory.data());
    cudaMemsetAsync(memory.data(), 0, static_cast<size_t>(regions.prefix(kZeroedRegions)),
                    static_cast<cudaStream_t>(a.stream));
  }
  if (varlen) {
    cuda::ChunkParams table;
    table.p = b.p;
    table.max_chunks = b.max_chunks;
    table.ws.chunk_start = b.ws.chunk_start;
    cuda::launch_chunk_table(table, a.stream);
    check_kernel_launch("CUDA backward chunk table");
  }
  using Launch = void (*)(const cuda::BackwardParams&, void*);
  const std::pair<Launch, const char*> stages[] = {
      {cuda::launch_backward_inputs, "inputs"},   {cuda::launch_backward_records, "records"},
      {cuda::launch_backward_states, "states"},   {cuda::launch_backward_dstates, "dstates"},
      {cuda::launch_backward_grads, "grads"},     {cuda::launch_backward_outputs, "outputs"},
      {cuda::launch_backward_params, "params"}};
  for (const auto& [launch, name] : stages) {
    launch(b, a.stream);
    check_kernel_launch((std::string("CUDA backward ") + name).c_str());
  }
}

}  // namespace flashdelta::detail
