// Host side of the CUDA chunkwise forward: sizes the workspace of prepared chunk records
// (cuda/chunk_params.h), takes the caller's or one from the stream-ordered allocator (no
// synchronisation, capturable in CUDA graphs), and launches the chunk table, prepare and
// state kernels, for long sequences over few heads in pieces whose state kernels run beside
// the next piece's prepare kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cuda/chunk_params.h"
#include "cuda/cuda.h"
#include "cuda/forked_stream.h"
#include "cuda/host_params.h"
#include "cuda/workspace.h"

namespace flashdelta::detail {
namespace {

// Forces the state kernel's split (split_scan).
constexpr const char* kSegmentsSetting = "FLASHDELTA_CHUNK_STATE_SEGMENTS";
// `general` makes the prepare kernel read every token tensor by dtype and layout at run time
// even where the dense bfloat16 path applies (ChunkParams::dense_tokens): for tests and A/B
// timing.
constexpr const char* kTokenRunsSetting = "FLASHDELTA_CHUNK_TOKEN_RUNS";
// `mma_sync` keeps the state kernel's products on mma.sync where wgmma applies
// (ChunkParams::state_wgmma): for tests and A/B timing.
constexpr const char* kStateProductsSetting = "FLASHDELTA_CHUNK_STATE_PRODUCTS";
// `1` or `2` fixes the wgmma state kernel's record stages (ChunkParams::state_stages): for
// tests and A/B timing.
constexpr const char* kStateStagesSetting = "FLASHDELTA_CHUNK_STATE_STAGES";
// `distance` makes the prepare kernel invert T off the diagonal by distances on the CUDA
// cores instead of by column blocks on the tensor cores (ChunkParams::inverse_by_columns):
// for tests and A/B timing. `tf32` keeps the column blocks with one tf32 product a step
// (ChunkParams::inverse_one_product): opt-in (-1-3% of the prepare kernel, outputs moved by
// up to 2e-3 in weak-gate cases: bench/NOTES.md (at), (av)).
constexpr const char* kInverseSetting = "FLASHDELTA_CHUNK_INVERSE";
// `split` takes A_qk and its slices' operands as bfloat16 pairs (ChunkParams::split_aqk):
// issue 5's first row 4.1e-3 -> 3.0e-3 against fp64, at +15% of the KDA forward (H100,
// bench/NOTES.md (bk)). `auto` and `bf16` keep single bfloat16.
constexpr const char* kAqkSetting = "FLASHDELTA_CHUNK_AQK";
// `auto` and `f16` keep A_qk in float16 and take A_qk v_new on float16 operands where its
// range is bounded (ChunkParams::aqk_f16, aqk_f16_applies) and K <= 128: issue 5's first row
// 4.0e-3 -> 3.3e-3 against fp64 at the same time (H100, bench/NOTES.md (cd)); `bf16` keeps
// bfloat16.
constexpr const char* kAqkDtypeSetting = "FLASHDELTA_CHUNK_AQK_DTYPE";
// `auto` (or `operands`) leaves every operand the state kernel can read as given out of the
// records (ChunkParams::qk_from_tokens and v_from_tokens); `qk` keeps u in them, `full` also
// qg and kg: for tests and A/B timing.
constexpr const char* kRecordsSetting = "FLASHDELTA_CHUNK_RECORDS";
// A maps step against a scan step (no outputs, no A_qk term). It weighed 0.6 while the
// records came by cp.async (bench/NOTES.md (ab)); with bulk copies the scan step is shorter
// and B=1 T=32768 H=32 runs faster whole than in two segments (3.536 against 3.577 ms,
// NOTES (ac)), which 1.0 reproduces.
constexpr double kMapsStep = 1.0;

// The chunk table numbers the chunk states too (ForwardArgs::chunk_states).
static_assert(cuda::kChunk == kChunkStateTokens);

// The workspace regions in order: chunk table (cu_seqlens only), qg and kg (unless
// qk_from_tokens), w (delta rule only), u (unless v_from_tokens), aqk, tu (v_from_tokens with
// the delta rule), aqk_lo (split_aqk only), decay (with the inverse lengths).
Carver layout_of(cuda::ChunkParams& c, bool varlen) {
  const int64_t records = c.max_chunks * c.p.HV, rows = records * cuda::kChunk;
  cuda::ChunkWorkspace& w = c.ws;
  Carver r;
  r.add(w.chunk_start, varlen ? c.p.N + 1 : 0);
  r.add(w.qg, c.qk_from_tokens ? 0 : rows * c.KP);
  r.add(w.kg, c.qk_from_tokens ? 0 : rows * c.KP);
  r.add(w.w, c.p.delta ? rows * c.KP : 0);
  r.add(w.u, c.v_from_tokens ? 0 : rows * c.VP);
  r.add(w.aqk, rows * cuda::kChunk);
  r.add(w.tu, cuda::records_keep_tu(c) ? rows * cuda::kChunk : 0);
  r.add(c.aqk_lo, c.split_aqk ? rows * cuda::kChunk : 0);
  r.add(w.decay, records * cuda::chunk_record_floats(c.KP));
  r.add(w.segment_maps,
        c.segments > 1 ? c.p.N * c.p.HV * c.segments * c.p.K * (c.p.V + c.p.K) : 0);
  return r;
}

// Whether A_qk fits float16 (ChunkParams::aqk_f16): with q and k L2-normalised and every log
// gate <= 0 (no gate, or one activated in the kernel: a precomputed gate may be anything)
// |A_qk| <= |scale| (1 + ~2^-7 for the norms' eps) once its rows carry n_q and the scale.
// float16 holds that up to |scale| ~ 2^16; 2^12 leaves a margin, and below 2^-8 A_qk's entries
// would fall in its subnormals.
bool aqk_f16_applies(const cuda::RecurrentParams& r) {
  const float s = std::fabs(r.scale);
  return r.qk_l2norm && (r.gate == cuda::GateForm::none || r.gate_in_kernel) &&
         s >= 0x1p-8f && s <= 0x1p12f;
}

// The kernels' arguments for a problem, without the workspace pointers.
cuda::ChunkParams chunk_params(const Problem& p, const ForwardIO& io) {
  cuda::ChunkParams c;
  c.p = problem_params(p);
  c.p.o = token_tensor(io.o);
  c.p.state_in = state_tensor(io.initial_state);
  c.p.state_out = state_tensor(io.final_state);
  c.chunk_states = state_tensor(io.chunk_states);
  c.chunk_states_dtype = io.chunk_states.t.dtype;
  c.chunk_states_count = io.chunk_states.t.present() ? io.chunk_states.t.shape[0] : 0;
  c.KP = cuda::chunk_key_width(p.K);
  c.VP = cuda::chunk_value_width(p.V);
  const cuda::RecurrentParams& r = c.p;
  c.dense_tokens = env_setting(kTokenRunsSetting, {"auto", "general"}) != "general" &&
                   bf16_dense_runs(r.q, p.K) && bf16_dense_runs(r.k, p.K) &&
                   bf16_dense_runs(r.v, p.V) &&
                   (r.gate != cuda::GateForm::vector || bf16_dense_runs(r.g, p.K));
  c.dense_output = bf16_dense_runs(c.p.o, p.V);
  const std::string records = env_setting(kRecordsSetting, {"auto", "operands", "qk", "full"});
  c.qk_from_tokens = records != "full" && c.dense_tokens && r.gate != cuda::GateForm::vector;
  c.v_from_tokens = records != "full" && records != "qk" && c.dense_tokens;
  const std::string inverse = env_setting(kInverseSetting, {"auto", "distance", "tf32"});
  c.inverse_by_columns = inverse != "distance";
  c.inverse_one_product = inverse == "tf32";
  c.split_aqk = env_setting(kAqkSetting, {"auto", "bf16", "split"}) == "split";
  c.aqk_f16 = env_setting(kAqkDtypeSetting, {"auto", "bf16", "f16"}) != "bf16" &&
              aqk_f16_applies(r) && c.KP <= 128;  // not instantiated at K = 256
  if (c.inverse_one_product && c.split_aqk)
    throw Error(ErrorCode::invalid_argument,
                std::string("environment variable ") + kInverseSetting + ": 'tf32' is not built "
                "together with " + kAqkSetting + "=split; unset one of the two");
  c.state_wgmma = env_setting(kStateProductsSetting, {"auto", "mma_sync"}) != "mma_sync" &&
                  c.KP <= 128;
  const std::string stages = env_setting(kStateStagesSetting, {"auto", "1", "2"});
  c.state_stages = stages == "1" ? 1 : stages == "2" ? 2 : 0;
  c.chunks_per_row = chunks_per_row(p);
  c.max_chunks = chunk_count_bound(p);
  const ScanSplit split = split_scan(kSegmentsSetting, p.N * p.HV, p.K, p.V, c.chunks_per_row, kMapsStep);
  c.segments = split.segments;
  c.segment_chunks = split.segment_chunks;
  return c;
}

// Throws Error(unsupported) where a kernel would need more than 2^31 - 1 blocks; called before
// the workspace is sized (check_chunk_records).
void check_block_counts(const Problem& p, const cuda::ChunkParams& c) {
  check_chunk_records(p, "the CUDA chunk schedule");
  const int64_t columns = cuda::chunk_state_columns(c.KP);
  const int64_t state_blocks = p.N * p.HV * ((p.V + columns - 1) / columns);
  if (state_blocks > INT_MAX)
    throw Error(ErrorCode::unsupported,
                "argument 'q': the CUDA chunk schedule runs at most 2^31 - 1 blocks, got " +
                    std::to_string(state_blocks) + " state tiles");
}

// Piece `first` .. first + chunks - 1 of every sequence of the whole's (no cu_seqlens): the
// token tensors from the piece's first token on, one run of state segments.
cuda::ChunkParams piece_params(const cuda::ChunkParams& whole, int64_t first, int64_t chunks) {
  cuda::ChunkParams c = whole;
  const int64_t t0 = first * cuda::kChunk;
  c.p.T = std::min(whole.p.T - t0, chunks * cuda::kChunk);
  for (cuda::TokenTensor* x : {&c.p.q, &c.p.k, &c.p.v, &c.p.g, &c.p.beta, &c.p.o})
    if (x->data)
      x->data = static_cast<const char*>(x->data) + t0 * x->stride[1] * dtype_size(x->dtype);
  c.chunks_per_row = chunks;
  c.max_chunks = c.p.N * chunks;
  c.segments = 1;
  c.segment_chunks = chunks;
  return c;
}

// The forward's launches and workspace: one piece (the whole, on the caller's stream), or
// pieces (cuda_chunk_pieces) each with its regions after the one before's, then a float32
// state [N, HV, K, V] that carries a piece's end state to the next (each piece's state
// kernel reads it first and writes it last, as it does the caller's state in place). Not
// for cu_seqlens, recorded chunk states (entries numbered by sequence, not by piece) or
// sequences split into segments.
class ForwardPlan {
 public:
  ForwardPlan(const cuda::ChunkParams& whole, bool varlen) {
    const std::vector<int64_t> sizes =
        varlen || whole.chunk_states.data || whole.segments > 1 || whole.max_chunks == 0
            ? std::vector<int64_t>{whole.chunks_per_row}
            : cuda_chunk_pieces(whole.p.N * whole.p.HV, whole.p.V, whole.chunks_per_row);
    if (sizes.size() == 1) {
      pieces_.push_back(whole);
    } else {
      int64_t first = 0;
      for (const int64_t n : sizes) {
        pieces_.push_back(piece_params(whole, first, n));
        first += n;
      }
      carry_floats_ = whole.p.N * whole.p.HV * whole.p.K * whole.p.V;
    }
    layouts_.reserve(pieces_.size());  // they point into pieces_, which is complete
    for (cuda::ChunkParams& c : pieces_) layouts_.push_back(layout_of(c, varlen));
    carries_.add(carry_, carry_floats_);
  }
  ForwardPlan(const ForwardPlan&) = delete;
  ForwardPlan& operator=(const ForwardPlan&) = delete;

  int64_t bytes() const {
    int64_t total = carries_.total();
    for (const Carver& l : layouts_) total += l.total();
    return total;
  }
  std::vector<cuda::ChunkParams>& pieces() { return pieces_; }

  // Sets every piece's workspace pointers and its carried states.
  void carve(char* base) {
    for (const Carver& l : layouts_) {
      l.carve(base);
      base += l.total();
    }
    if (carry_floats_ == 0) return;
    carries_.carve(base);
    const int64_t K = pieces_[0].p.K, V = pieces_[0].p.V;
    cuda::StateTensor carry;  // K-first, dense
    carry.data = carry_;
    carry.slot_stride = pieces_[0].p.HV * K * V;
    carry.head_stride = K * V;
    carry.key_stride = V;
    carry.value_stride = 1;
    for (size_t i = 0; i + 1 < pieces_.size(); ++i) {
      pieces_[i].p.state_out = carry;
      pieces_[i + 1].p.state_in = carry;
    }
  }

 private:
  std::vector<cuda::ChunkParams> pieces_;
  std::vector<Carver> layouts_;
  Carver carries_;
  float* carry_ = nullptr;
  int64_t carry_floats_ = 0;
};

}  // namespace

int64_t cuda_chunk_state_segments(int64_t scans, int64_t K, int64_t V, int64_t chunks) {
  return split_scan(kSegmentsSetting, scans, K, V, chunks, kMapsStep).segments;
}

int64_t cuda_chunk_workspace_bytes(const Problem& p) {
  cuda::ChunkParams c = chunk_params(p, ForwardIO{});
  check_block_counts(p, c);
  return ForwardPlan(c, p.cu_seqlens.present()).bytes();
}

void cuda_chunk_forward(const Problem& p, const ForwardIO& io, void* stream, void* workspace,
                        size_t workspace_bytes) {
  require_f32_state(io.initial_state.t, "initial_state");
  require_f32_state(io.final_state.t, "final_state");
  cuda::ChunkParams c = chunk_params(p, io);
  check_block_counts(p, c);
  const bool varlen = p.cu_seqlens.present();
  // With recorded chunk states the plan is one piece, no larger than the size query's.
  ForwardPlan plan(c, varlen);
  const int64_t bytes = plan.bytes();
  const bool caller_memory = workspace != nullptr || workspace_bytes > 0;
  // The caller's workspace is checked before anything else (no GPU is needed to fail here).
  if (caller_memory) check_caller_workspace(workspace, workspace_bytes, bytes);
  require_sm80("the CUDA chunk schedule");
  const bool one_stage = cuda::chunk_state_one_stage_only(c);
  const int sms = sm_count();
  for (cuda::ChunkParams& piece : plan.pieces()) {
    if (one_stage) piece.state_stages = 1;
    piece.sm_count = sms;
  }

  const StreamWorkspace memory("CUDA chunk schedule", bytes, workspace, workspace_bytes, stream);
  if (bytes > 0) plan.carve(memory.data());
  if (varlen) {  // one piece
    cuda::launch_chunk_table(plan.pieces()[0], stream);
    check_kernel_launch("CUDA chunk table");
  }
  // Each piece's prepare kernel on the caller's stream; with more than one piece, its state
  // kernel on the side stream once that prepare kernel is done (and the piece before's state
  // kernel, in stream order), joined back to the caller's stream before the workspace is
  // returned (declared after it).
  std::optional<ForkedStream> side;
  if (plan.pieces().size() > 1) side.emplace(stream, "the CUDA chunk schedule");
  for (cuda::ChunkParams& piece : plan.pieces()) {
    if (piece.max_chunks > 0) {
      cuda::launch_chunk_prepare(piece, stream);
      check_kernel_launch("CUDA chunk prepare");
    }
    if (side) side->follow_caller();
    cuda::launch_chunk_state(piece, side ? side->side() : stream);
    check_kernel_launch("CUDA chunk state");
  }
}

}  // namespace flashdelta::detail
