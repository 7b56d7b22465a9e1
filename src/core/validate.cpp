// Argument validation: the one place that decides whether a call is well-formed. Every
// entry point validates fully before anything is written.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/chunk_states.h"
#include "core/problem.h"
#include "core/tensor_io.h"

namespace flashdelta::detail {
namespace {

constexpr int64_t kMaxHeadDim = 256;
// Sequences per call, B rows or cu_seqlens' N: with at most 2^24 value heads, N x HV (the
// scans, states and chunk records the kernels size and index) stays within 2^48.
constexpr int64_t kMaxSequences = int64_t{1} << 24;

[[noreturn]] void fail(const std::string& msg) { throw Error(ErrorCode::invalid_argument, msg); }

std::string arg(const char* name) { return std::string("argument '") + name + "': "; }

std::string shape_str(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.rank; ++i) os << (i ? ", " : "") << t.shape[i];
  os << "]";
  return os.str();
}

// Expected shape with -1 for "any"; `dims` names the dimensions, e.g. "[B, T, H, K]".
std::string expected_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    os << (i ? ", " : "");
    if (shape[i] < 0) os << "*"; else os << shape[i];
  }
  os << "]";
  return os.str();
}

void check_pointer(const TensorView& t, const char* name) {
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 0) fail(arg(name) + "negative size in shape " + shape_str(t));
  if (t.numel() == INT64_MAX) fail(arg(name) + "too many elements in shape " + shape_str(t));
  if (t.numel() > 0 && t.data == nullptr)
    fail(arg(name) + "null data pointer for " + std::to_string(t.numel()) + " elements");
}

void check_float(const TensorView& t, const char* name) {
  if (!is_floating(t.dtype))
    fail(arg(name) + "expected a float dtype (float32, bfloat16, float16 or float64), got " +
         dtype_name(t.dtype));
}

void check_shape(const TensorView& t, const char* name, const char* dims,
                 const std::vector<int64_t>& shape) {
  bool ok = t.rank == static_cast<int>(shape.size());
  for (int i = 0; ok && i < t.rank; ++i) ok = shape[i] < 0 || t.shape[i] == shape[i];
  if (!ok)
    fail(arg(name) + "expected shape " + dims + " = " + expected_str(shape) + ", got " +
         shape_str(t));
}

void check_rank(const TensorView& t, const char* name, const char* dims, int rank) {
  if (t.rank != rank)
    fail(arg(name) + "expected rank " + std::to_string(rank) + " " + dims + ", got rank " +
         std::to_string(t.rank) + " " + shape_str(t));
}

void check_device(const TensorView& t, const char* name, Device device) {
  if (t.present() && t.device != device)
    fail(arg(name) + "expected device " + (device == Device::cpu ? "cpu" : "cuda") +
         " (the device of q), got " + (t.device == Device::cpu ? "cpu" : "cuda"));
}

void check_absent(const TensorView& t, const char* name, const std::string& why) {
  if (t.present()) fail(arg(name) + "must be absent " + why);
}

// Outputs must not broadcast (stride 0 on a dimension of size > 1): writes would collide.
void check_writable(const TensorView& t, const char* name) {
  check_float(t, name);
  if (t.numel() == 0) return;  // nothing is written
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] > 1 && t.stride[i] == 0)
      fail(arg(name) + "output has stride 0 on dimension " + std::to_string(i) +
           ", so its elements would overlap");
  // No two elements at one address (their order of writing would decide the result): with
  // the dimensions of size > 1 in order of |stride|, each stride must pass the elements the
  // smaller ones span. A sufficient condition, met by every dense, permuted, padded or
  // negative-stride view; magnitudes saturate, so huge strides fail rather than wrap.
  std::array<std::pair<uint64_t, int>, kMaxRank> dims{};
  int n = 0;
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] > 1)
      dims[n++] = {t.stride[i] < 0 ? 0 - static_cast<uint64_t>(t.stride[i])
                                   : static_cast<uint64_t>(t.stride[i]),
                   i};
  for (int a = 1; a < n; ++a)  // insertion sort: at most four dimensions
    for (int b = a; b > 0 && dims[b] < dims[b - 1]; --b) std::swap(dims[b], dims[b - 1]);
  uint64_t span = 0;  // the largest element offset the smaller strides reach
  for (int d = 0; d < n; ++d) {
    const auto [magnitude, i] = dims[d];
    if (magnitude <= span)
      fail(arg(name) + "output elements overlap: stride " + std::to_string(t.stride[i]) +
           " of dimension " + std::to_string(i) + " falls within the " + std::to_string(span) +
           " elements the smaller strides span");
    uint64_t reach = 0;
    if (__builtin_mul_overflow(magnitude, static_cast<uint64_t>(t.shape[i] - 1), &reach) ||
        __builtin_add_overflow(span, reach, &span))
      span = std::numeric_limits<uint64_t>::max();
  }
}

// Byte range [lo, hi) a view touches (empty views touch nothing).
struct ByteRange {
  uintptr_t lo = 0, hi = 0;
};
ByteRange byte_range(const TensorView& t) {
  if (!t.present() || t.numel() == 0 || t.data == nullptr) return {};
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < t.rank; ++i) {
    const int64_t span = (t.shape[i] - 1) * t.stride[i];
    (span < 0 ? lo : hi) += span;
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  const int64_t es = dtype_size(t.dtype);
  return {base + static_cast<uintptr_t>(lo * es), base + static_cast<uintptr_t>((hi + 1) * es)};
}

bool overlaps(const TensorView& a, const TensorView& b) {
  const ByteRange x = byte_range(a), y = byte_range(b);
  return x.lo < x.hi && y.lo < y.hi && x.lo < y.hi && y.lo < x.hi;
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.rank == b.rank && a.shape == b.shape &&
         a.stride == b.stride;
}

// `in` may be an input or another output (chunk_states against o, say): the message says which
// two tensors, not which kind.
void check_no_overlap(const TensorView& out, const char* out_name, const TensorView& in,
                      const char* in_name) {
  if (overlaps(out, in))
    fail(arg(out_name) + "output memory overlaps '" + in_name + "'");
}

// Checks the per-token inputs shared by forward, decode and backward, and fills the sizes,
// sequence table and views of `p`.
void check_token_inputs(Problem& p, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& g, const TensorView& beta,
                        const TensorView& cu_seqlens, const TensorView& A_log,
                        const TensorView& dt_bias, const Options& o) {
  if (!q.present()) fail(arg("q") + "is required");
  if (!k.present()) fail(arg("k") + "is required");
  if (!v.present()) fail(arg("v") + "is required");
  check_rank(q, "q", "[B, T, H, K]", 4);
  check_float(q, "q");
  check_pointer(q, "q");
  p.B = q.shape[0];
  // The sequence table has one entry per row: bound B so a huge empty batch fails here
  // with a message rather than in an allocation.
  if (p.B > kMaxSequences)
    fail(arg("q") + "expected batch size B <= 2^24, got B = " + std::to_string(p.B));
  p.T = q.shape[1];
  p.H = q.shape[2];
  p.K = q.shape[3];
  const Device dev = q.device;
  if (p.H < 1) fail(arg("q") + "expected H >= 1 key heads, got H = " + std::to_string(p.H));
  if (p.K < 1 || p.K > kMaxHeadDim)
    fail(arg("q") + "expected key dimension K in 1..256, got K = " + std::to_string(p.K));
  check_shape(k, "k", "[B, T, H, K]", {p.B, p.T, p.H, p.K});
  check_float(k, "k");
  check_pointer(k, "k");
  check_device(k, "k", dev);
  check_rank(v, "v", "[B, T, HV, V]", 4);
  check_float(v, "v");
  check_pointer(v, "v");
  check_device(v, "v", dev);
  check_shape(v, "v", "[B, T, HV, V]", {p.B, p.T, -1, -1});
  p.HV = v.shape[2];
  p.V = v.shape[3];
  if (p.HV < 1 || p.HV % p.H != 0)
    fail(arg("v") + "expected HV a positive multiple of H = " + std::to_string(p.H) +
         ", got HV = " + std::to_string(p.HV));
  constexpr int64_t kMaxHeads = int64_t{1} << 24;  // see kMaxSequences
  if (p.HV > kMaxHeads)
    fail(arg("v") + "expected at most 2^24 value heads, got HV = " + std::to_string(p.HV));
  if (p.V < 1 || p.V > kMaxHeadDim)
    fail(arg("v") + "expected value dimension V in 1..256, got V = " + std::to_string(p.V));
  p.group = p.HV / p.H;

  const MechanismTraits mt = traits(o.mechanism);
  p.gate = mt.gate;
  p.delta = mt.delta;
  const std::string mech = std::string("for mechanism ") + mechanism_name(o.mechanism);
  if (mt.gate == GateKind::none) {
    check_absent(g, "g", "(" + mech + ", which has no gate)");
  } else {
    if (!g.present()) fail(arg("g") + "is required " + mech);
    check_float(g, "g");
    check_pointer(g, "g");
    check_device(g, "g", dev);
    if (mt.gate == GateKind::vector)
      check_shape(g, "g", "[B, T, HV, K] (vector gate)", {p.B, p.T, p.HV, p.K});
    else
      check_shape(g, "g", "[B, T, HV] (scalar gate)", {p.B, p.T, p.HV});
  }
  if (!mt.delta) {
    check_absent(beta, "beta", "(" + mech + ", which has no delta rule)");
  } else {
    if (!beta.present()) fail(arg("beta") + "is required " + mech);
    check_float(beta, "beta");
    check_pointer(beta, "beta");
    check_device(beta, "beta", dev);
    check_shape(beta, "beta", "[B, T, HV]", {p.B, p.T, p.HV});
  }

  // Gate activation and its parameters.
  if (o.gate_in_kernel && mt.gate == GateKind::none)
    fail(arg("gate_in_kernel") + "requires a gated mechanism, got " + mechanism_name(o.mechanism));
  if (o.lower_bound) {
    if (!o.gate_in_kernel) fail(arg("lower_bound") + "requires gate_in_kernel");
    if (!std::isfinite(*o.lower_bound) || *o.lower_bound >= 0)
      fail(arg("lower_bound") + "expected a finite value < 0, got " +
           std::to_string(*o.lower_bound));
  }
  if (!o.gate_in_kernel) {
    check_absent(A_log, "A_log", "without gate_in_kernel");
    check_absent(dt_bias, "dt_bias", "without gate_in_kernel");
  } else {
    if (!A_log.present() && !o.lower_bound)
      fail(arg("A_log") + "is required with gate_in_kernel and no lower_bound");
    if (A_log.present()) {
      check_float(A_log, "A_log");
      check_pointer(A_log, "A_log");
      check_device(A_log, "A_log", dev);
      check_shape(A_log, "A_log", "[HV]", {p.HV});
    }
    if (dt_bias.present()) {
      check_float(dt_bias, "dt_bias");
      check_pointer(dt_bias, "dt_bias");
      check_device(dt_bias, "dt_bias", dev);
      if (mt.gate == GateKind::vector) {
        if (dt_bias.rank == 2)
          check_shape(dt_bias, "dt_bias", "[HV, K]", {p.HV, p.K});
        else if (dt_bias.rank != 1 || dt_bias.shape[0] % p.K != 0 ||
                 dt_bias.shape[0] / p.K != p.HV)  // HV * K may overflow: compare by division
          fail(arg("dt_bias") + "expected shape [HV * K] = [" + std::to_string(p.HV) + " * " +
               std::to_string(p.K) + "] or [HV, K], got " + shape_str(dt_bias));
      } else {
        check_shape(dt_bias, "dt_bias", "[HV] (scalar gate)", {p.HV});
      }
    }
  }

  if (o.scale && !std::isfinite(*o.scale))
    fail(arg("scale") + "expected a finite value, got " + std::to_string(*o.scale));
  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(p.K));
  if (o.chunk_size != 16 && o.chunk_size != 32 && o.chunk_size != 64 && o.chunk_size != 128)
    fail(arg("chunk_size") + "expected 16, 32, 64 or 128, got " + std::to_string(o.chunk_size));
  if (o.num_threads < 0)
    fail(arg("num_threads") + "expected >= 0 (0 = all), got " + std::to_string(o.num_threads));

  // Sequences.
  p.seqs.clear();
  p.cu_seqlens = cu_seqlens;
  if (cu_seqlens.present()) {
    if (cu_seqlens.dtype != DType::i32 && cu_seqlens.dtype != DType::i64)
      fail(arg("cu_seqlens") + "expected int32 or int64, got " + dtype_name(cu_seqlens.dtype));
    check_rank(cu_seqlens, "cu_seqlens", "[N + 1]", 1);
    check_pointer(cu_seqlens, "cu_seqlens");
    check_device(cu_seqlens, "cu_seqlens", q.device);
    if (cu_seqlens.shape[0] < 1)
      fail(arg("cu_seqlens") + "expected at least one element (N + 1 offsets), got 0");
    if (p.B != 1)
      fail(arg("cu_seqlens") + "requires batch size B = 1 (sequences packed along T), got B = " +
           std::to_string(p.B));
    const int64_t n = cu_seqlens.shape[0] - 1;
    if (n > kMaxSequences)
      fail(arg("cu_seqlens") + "expected at most 2^24 sequences (N + 1 offsets), got N = " +
           std::to_string(n));
    // Device-resident offsets are not read by the host (no synchronisation): the CUDA
    // kernels clamp each sequence to [0, T], so a malformed table cannot reach outside q.
    if (cu_seqlens.device != Device::cpu) {
      p.N = n;
      p.options = o;
      p.in = {q, k, v, g, beta, A_log, dt_bias};
      p.indices_on_host = false;
      return;
    }
    int64_t prev = load_index(cu_seqlens, 0);
    if (prev != 0)
      fail(arg("cu_seqlens") + "expected cu_seqlens[0] = 0, got " + std::to_string(prev));
    for (int64_t i = 1; i <= n; ++i) {
      const int64_t cur = load_index(cu_seqlens, offset_of(cu_seqlens, i));
      if (cur < prev)
        fail(arg("cu_seqlens") + "expected non-decreasing offsets, got cu_seqlens[" +
             std::to_string(i) + "] = " + std::to_string(cur) + " < cu_seqlens[" +
             std::to_string(i - 1) + "] = " + std::to_string(prev));
      if (cur > p.T)
        fail(arg("cu_seqlens") + "offset cu_seqlens[" + std::to_string(i) + "] = " +
             std::to_string(cur) + " exceeds T = " + std::to_string(p.T));
      p.seqs.push_back({0, prev, cur - prev});
      prev = cur;
    }
    if (prev != p.T)
      fail(arg("cu_seqlens") + "expected the last offset to equal T = " + std::to_string(p.T) +
           ", got " + std::to_string(prev));
  } else {
    for (int64_t b = 0; b < p.B; ++b) p.seqs.push_back({b, 0, p.T});
  }
  p.N = static_cast<int64_t>(p.seqs.size());
  p.options = o;
  p.in = {q, k, v, g, beta, A_log, dt_bias};
}

std::vector<int64_t> state_shape(const Problem& p, int64_t n, StateLayout layout) {
  return layout == StateLayout::k_first ? std::vector<int64_t>{n, p.HV, p.K, p.V}
                                        : std::vector<int64_t>{n, p.HV, p.V, p.K};
}

const char* state_dims(StateLayout layout) {
  return layout == StateLayout::k_first ? "[N, HV, K, V] (K-first)" : "[N, HV, V, K] (V-first)";
}

void check_state(const Problem& p, const TensorView& s, const char* name, bool output) {
  if (!s.present()) return;
  const StateLayout layout = p.options.state_layout;
  check_rank(s, name, state_dims(layout), 4);
  check_shape(s, name, state_dims(layout), state_shape(p, p.N, layout));
  if (s.dtype != DType::f32 && s.dtype != DType::f64)
    fail(arg(name) + "expected float32 (or float64) state, got " + dtype_name(s.dtype));
  check_pointer(s, name);
  check_device(s, name, p.in.q.device);
  if (output) check_writable(s, name);
}

void check_inputs_untouched(const TensorView& out, const char* name, const Problem& p,
                            const TensorView& initial_state) {
  const TokenViews& in = p.in;
  check_no_overlap(out, name, in.q, "q");
  check_no_overlap(out, name, in.k, "k");
  check_no_overlap(out, name, in.v, "v");
  check_no_overlap(out, name, in.g, "g");
  check_no_overlap(out, name, in.beta, "beta");
  check_no_overlap(out, name, p.cu_seqlens, "cu_seqlens");
  check_no_overlap(out, name, in.A_log, "A_log");
  check_no_overlap(out, name, in.dt_bias, "dt_bias");
  if (!same_view(out, initial_state)) check_no_overlap(out, name, initial_state, "initial_state");
}

void check_output_like(const TensorView& t, const char* name, const char* dims,
                       const std::vector<int64_t>& shape, Device dev) {
  check_shape(t, name, dims, shape);
  check_writable(t, name);
  check_pointer(t, name);
  check_device(t, name, dev);
}

// A state per 64-token chunk of every sequence, in order: ForwardArgs::chunk_states (an
// output) and BackwardArgs::chunk_states (an input). Its shape, dtype, pointer and device.
void check_chunk_states_view(const Problem& p, const TensorView& s, const char* name) {
  const StateLayout layout = p.options.state_layout;
  const bool k_first = layout == StateLayout::k_first;
  check_rank(s, name, k_first ? "[C, HV, K, V] (K-first)" : "[C, HV, V, K] (V-first)", 4);
  const std::string per_chunk = "; C = the 64-token chunks of all sequences, ";
  if (p.indices_on_host) {
    const int64_t C = ChunkStateEntries(p).total();
    const std::string dims = (k_first ? "[C, HV, K, V] (K-first" : "[C, HV, V, K] (V-first") +
                             per_chunk + std::to_string(C) + ")";
    check_shape(s, name, dims.c_str(), state_shape(p, C, layout));
  } else {
    // Device-resident cu_seqlens are not read: C is only known to lie between the chunks
    // of T tokens in one sequence and one more partial chunk per non-empty sequence.
    const int64_t lo = chunk_state_count(p.T);
    const int64_t hi = p.T / kChunkStateTokens + std::min(p.N, p.T);
    const std::string dims = (k_first ? "[C, HV, K, V] (K-first" : "[C, HV, V, K] (V-first") +
                             per_chunk + std::to_string(lo) + " to " + std::to_string(hi) +
                             " for device-resident cu_seqlens)";
    check_shape(s, name, dims.c_str(), state_shape(p, -1, layout));
    if (s.shape[0] < lo || s.shape[0] > hi)
      fail(arg(name) + "expected shape " + dims + ", got " + shape_str(s));
  }
  check_float(s, name);
  check_pointer(s, name);
  check_device(s, name, p.in.q.device);
}

void check_chunk_states(const Problem& p, const ForwardArgs& a) {
  const TensorView& s = a.chunk_states;
  if (!s.present()) return;
  const char* name = "chunk_states";
  check_chunk_states_view(p, s, name);
  check_writable(s, name);
  check_inputs_untouched(s, name, p, TensorView{});
  check_no_overlap(s, name, a.initial_state, "initial_state");
  check_no_overlap(s, name, a.o, "o");
  check_no_overlap(s, name, a.final_state, "final_state");
}

}  // namespace

Problem validate_forward(const ForwardArgs& a, const Options& o) {
  Problem p;
  check_token_inputs(p, a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.A_log, a.dt_bias, o);
  check_state(p, a.initial_state, "initial_state", false);
  check_state(p, a.final_state, "final_state", true);
  if (!a.o.present()) fail(arg("o") + "is required (the output)");
  check_output_like(a.o, "o", "[B, T, HV, V]", {p.B, p.T, p.HV, p.V}, a.q.device);
  check_inputs_untouched(a.o, "o", p, a.initial_state);
  if (overlaps(a.o, a.initial_state)) fail(arg("o") + "output memory overlaps 'initial_state'");
  if (a.final_state.present()) {
    check_inputs_untouched(a.final_state, "final_state", p, a.initial_state);
    if (overlaps(a.final_state, a.o)) fail(arg("final_state") + "output memory overlaps 'o'");
  }
  check_chunk_states(p, a);
  return p;
}

DecodeProblem validate_decode(const DecodeArgs& a, const Options& o) {
  DecodeProblem d;
  Problem& p = d.p;
  check_token_inputs(p, a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.A_log, a.dt_bias, o);
  const StateLayout layout = o.state_layout;
  if (!a.state_pool.present()) fail(arg("state_pool") + "is required");
  check_rank(a.state_pool, "state_pool", "[P, HV, K, V] / [P, HV, V, K]", 4);
  check_shape(a.state_pool, "state_pool", state_dims(layout), state_shape(p, -1, layout));
  if (a.state_pool.dtype != DType::f32 && a.state_pool.dtype != DType::bf16)
    fail(arg("state_pool") + "expected float32 or bfloat16, got " +
         dtype_name(a.state_pool.dtype));
  check_pointer(a.state_pool, "state_pool");
  check_device(a.state_pool, "state_pool", a.q.device);
  check_writable(a.state_pool, "state_pool");
  d.pool = {a.state_pool, layout};
  const int64_t P = a.state_pool.shape[0];

  const TensorView& idx = a.state_indices;
  if (!idx.present()) fail(arg("state_indices") + "is required");
  if (idx.dtype != DType::i32 && idx.dtype != DType::i64)
    fail(arg("state_indices") + "expected int32 or int64, got " + dtype_name(idx.dtype));
  if (idx.rank != 1 && idx.rank != 2)
    fail(arg("state_indices") + "expected rank 1 [N] or rank 2 [N, S], got rank " +
         std::to_string(idx.rank) + " " + shape_str(idx));
  check_pointer(idx, "state_indices");
  check_device(idx, "state_indices", a.q.device);
  if (idx.shape[0] != p.N)
    fail(arg("state_indices") + "expected " + std::to_string(p.N) +
         " rows (one per sequence), got " + shape_str(idx));
  d.state_indices = idx;
  d.per_token_slots = idx.rank == 2;
  // Device-resident indices are not read by the host (no synchronisation, graph capture):
  // the CUDA kernel treats a slot outside 0..P-1, or a num_accepted_tokens outside 1..S, as
  // a padding row, and skips token writes beyond S. Only shapes are checked here.
  const bool read_indices = idx.device == Device::cpu;
  p.indices_on_host = read_indices;
  if (d.per_token_slots && idx.shape[1] < 1)
    fail(arg("state_indices") + "expected at least 1 slot per row, got " + shape_str(idx));
  if (d.per_token_slots && read_indices && idx.shape[1] < std::max<int64_t>(p.max_len(), 1))
    fail(arg("state_indices") + "expected at least " + std::to_string(p.max_len()) +
         " slots per row (the longest sequence), got " + shape_str(idx));
  const int64_t slots_per_row = d.per_token_slots ? idx.shape[1] : 1;
  for (int64_t n = 0; read_indices && n < p.N; ++n)
    for (int64_t s = 0; s < slots_per_row; ++s) {
      const int64_t v = load_index(idx, d.per_token_slots ? offset_of(idx, n, s) : offset_of(idx, n));
      if (v < -1 || v >= P)
        fail(arg("state_indices") + "slot " + std::to_string(v) + " at row " + std::to_string(n) +
             " is outside -1..P-1 with pool size P = " + std::to_string(P));
    }

  const TensorView& acc = a.num_accepted_tokens;
  if (acc.present()) {
    if (!d.per_token_slots)
      fail(arg("num_accepted_tokens") + "requires per-token state_indices [N, S]");
    if (acc.dtype != DType::i32 && acc.dtype != DType::i64)
      fail(arg("num_accepted_tokens") + "expected int32 or int64, got " + dtype_name(acc.dtype));
    check_shape(acc, "num_accepted_tokens", "[N]", {p.N});
    check_pointer(acc, "num_accepted_tokens");
    check_device(acc, "num_accepted_tokens", a.q.device);
    for (int64_t n = 0; read_indices && n < p.N; ++n) {
      const int64_t v = load_index(acc, offset_of(acc, n));
      if (v < 1 || v > idx.shape[1])
        fail(arg("num_accepted_tokens") + "expected values in 1.." + std::to_string(idx.shape[1]) +
             ", got " + std::to_string(v) + " at row " + std::to_string(n));
    }
  }
  d.num_accepted_tokens = acc;

  // Every slot written by a live row must be written by that row only.
  std::vector<std::pair<int64_t, int64_t>> written;  // (slot, row)
  for (int64_t n = 0; read_indices && n < p.N; ++n) {
    if (decode_start_slot(d, n) < 0) continue;
    if (!d.per_token_slots) {
      written.push_back({decode_start_slot(d, n), n});
      continue;
    }
    for (int64_t t = 0; t < p.seqs[n].len; ++t) {
      const int64_t s = decode_slot_after(d, n, t);
      if (s >= 0) written.push_back({s, n});
    }
  }
  std::sort(written.begin(), written.end());
  for (size_t i = 1; i < written.size(); ++i)
    if (written[i].first == written[i - 1].first && written[i].second != written[i - 1].second)
      fail(arg("state_indices") + "slot " + std::to_string(written[i].first) +
           " is written by rows " + std::to_string(written[i - 1].second) + " and " +
           std::to_string(written[i].second));
  // Rows run concurrently: a row must not start from a slot another row writes.
  for (int64_t n = 0; read_indices && n < p.N; ++n) {
    const int64_t start = decode_start_slot(d, n);
    if (start < 0) continue;
    auto it = std::lower_bound(written.begin(), written.end(), std::pair<int64_t, int64_t>{start, -1});
    for (; it != written.end() && it->first == start; ++it)
      if (it->second != n)
        fail(arg("state_indices") + "row " + std::to_string(n) + " starts from slot " +
             std::to_string(start) + ", which row " + std::to_string(it->second) + " writes");
  }

  if (!a.o.present()) fail(arg("o") + "is required (the output)");
  check_output_like(a.o, "o", "[B, T, HV, V]", {p.B, p.T, p.HV, p.V}, a.q.device);
  check_inputs_untouched(a.o, "o", p, TensorView{});
  check_no_overlap(a.o, "o", a.state_pool, "state_pool");
  check_inputs_untouched(a.state_pool, "state_pool", p, TensorView{});
  for (const auto& [out, out_name] : {std::pair{&a.o, "o"}, {&a.state_pool, "state_pool"}}) {
    check_no_overlap(*out, out_name, a.state_indices, "state_indices");
    check_no_overlap(*out, out_name, a.num_accepted_tokens, "num_accepted_tokens");
  }
  return d;
}

int64_t decode_start_slot(const DecodeProblem& d, int64_t n) {
  const TensorView& idx = d.state_indices;
  if (!d.per_token_slots) return load_index(idx, offset_of(idx, n));
  const int64_t a =
      d.num_accepted_tokens.present()
          ? load_index(d.num_accepted_tokens, offset_of(d.num_accepted_tokens, n))
          : 1;
  return load_index(idx, offset_of(idx, n, a - 1));
}

int64_t decode_slot_after(const DecodeProblem& d, int64_t n, int64_t t) {
  const TensorView& idx = d.state_indices;
  if (!d.per_token_slots) return t + 1 == d.p.seqs[n].len ? load_index(idx, offset_of(idx, n)) : -1;
  return load_index(idx, offset_of(idx, n, t));
}

Problem validate_backward(const BackwardArgs& a, const Options& o) {
  Problem p;
  check_token_inputs(p, a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.A_log, a.dt_bias, o);
  check_state(p, a.initial_state, "initial_state", false);
  if (!a.d_o.present()) fail(arg("d_o") + "is required (the gradient of o)");
  check_shape(a.d_o, "d_o", "[B, T, HV, V]", {p.B, p.T, p.HV, p.V});
  check_float(a.d_o, "d_o");
  check_pointer(a.d_o, "d_o");
  check_device(a.d_o, "d_o", a.q.device);
  check_state(p, a.d_final_state, "d_final_state", false);
  if (a.chunk_states.present()) check_chunk_states_view(p, a.chunk_states, "chunk_states");

  struct Grad {
    const TensorView& grad;
    const char* name;
    const TensorView& input;
    const char* input_name;
  };
  const Grad grads[] = {{a.dq, "dq", a.q, "q"},
                        {a.dk, "dk", a.k, "k"},
                        {a.dv, "dv", a.v, "v"},
                        {a.dg, "dg", a.g, "g"},
                        {a.dbeta, "dbeta", a.beta, "beta"},
                        {a.d_initial_state, "d_initial_state", a.initial_state, "initial_state"},
                        {a.dA_log, "dA_log", a.A_log, "A_log"},
                        {a.ddt_bias, "ddt_bias", a.dt_bias, "dt_bias"}};
  const TensorView* inputs[] = {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.initial_state,
                                &a.A_log, &a.dt_bias, &a.d_o, &a.d_final_state,
                                &a.chunk_states};
  const char* input_names[] = {"q", "k", "v", "g", "beta", "initial_state",
                               "A_log", "dt_bias", "d_o", "d_final_state", "chunk_states"};
  for (const Grad& gr : grads) {
    if (!gr.grad.present()) continue;
    if (!gr.input.present())
      fail(arg(gr.name) + "given, but its input '" + gr.input_name + "' is absent");
    if (gr.grad.rank != gr.input.rank || gr.grad.shape != gr.input.shape)
      fail(arg(gr.name) + "expected the shape of '" + gr.input_name + "' " +
           shape_str(gr.input) + ", got " + shape_str(gr.grad));
    check_writable(gr.grad, gr.name);
    check_pointer(gr.grad, gr.name);
    check_device(gr.grad, gr.name, a.q.device);
    for (size_t i = 0; i < std::size(inputs); ++i)
      check_no_overlap(gr.grad, gr.name, *inputs[i], input_names[i]);
    for (const Grad& other : grads)
      if (&other != &gr && overlaps(gr.grad, other.grad))
        fail(arg(gr.name) + "output memory overlaps '" + other.name + "'");
  }
  return p;
}

}  // namespace flashdelta::detail
