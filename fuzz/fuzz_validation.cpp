// Fuzz target: argument validation of flashdelta::forward. The input chooses a problem:
// options, sizes, cu_seqlens values, and for every tensor its presence, dtype, shape
// (correct or changed), strides (contiguous, permuted, padded, negative, broadcast,
// arbitrary), device, a null pointer, and whether it shares memory with another. Each view
// is backed by a heap buffer exactly as large as the elements it reaches, then forward runs
// with Schedule::reference.
//
// Findings: a crash, a sanitizer report (a read outside a view, an overflow), an exception
// other than flashdelta::Error, and a disagreement with the documented contract: the harness
// judges each case on its own (judge() below, written from flashdelta.h) and aborts when a
// case it knows to be valid is rejected, or one it knows to be invalid runs.
//
// Choices are read front to back, one byte each; a missing byte reads as 0 and choice 0 is
// always the ordinary one, so the empty input is a valid small KDA problem and a seed is a
// short list of choices (see fuzz/corpus/README.md).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashdelta/flashdelta.h"
#include "fuzz_views.h"

namespace {

using namespace flashdelta;
using namespace flashdelta::fuzz;

// ---------------------------------------------------------------------------------------
// A case

enum Role { q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, o, final_state, kRoles };
constexpr const char* kRoleNames[] = {
    "q",          "k",     "v",       "g", "beta",       "initial_state",
    "cu_seqlens", "A_log", "dt_bias", "o", "final_state"};

enum class Sharing { none, in_place_state, output_over_input, outputs_together };

struct Case {
  Options options;
  bool varlen = false;
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, N = 0;
  std::array<Plan, kRoles> plans;
  Sharing sharing = Sharing::none;
  std::array<std::unique_ptr<unsigned char[]>, kRoles> buffers;

  ForwardArgs args() const {
    ForwardArgs a;
    TensorView* fields[] = {
        &a.q,          &a.k,     &a.v,       &a.g, &a.beta,       &a.initial_state,
        &a.cu_seqlens, &a.A_log, &a.dt_bias, &a.o, &a.final_state};
    for (int role = 0; role < kRoles; ++role) *fields[role] = plans[role].view;
    return a;
  }
};

Options decode_options(ChoiceReader& r) {
  Options opt;
  opt.mechanism = r.choose(kMechanisms);
  opt.state_layout = r.flag() ? StateLayout::v_first : StateLayout::k_first;
  opt.qk_l2norm = r.flag();
  opt.beta_sigmoid = r.flag();
  opt.allow_neg_eigval = r.flag();
  opt.gate_in_kernel = r.flag();
  opt.lower_bound = r.choose(kLowerBounds);
  opt.scale = r.choose(kScales);
  opt.chunk_size = r.choose(kChunkSizes);
  opt.num_threads = r.choose(kThreadCounts);
  return opt;
}

// Decodes a case and backs its views with memory; false when it is too large to run.
bool decode_case(ChoiceReader& r, Case& c) {
  c.options = decode_options(r);
  const MechanismTraits mt = traits(c.options.mechanism);

  // Sizes. Variable length packs N sequences of chosen lengths into one batch row.
  c.varlen = r.flag();
  std::vector<int64_t> cu = {0};
  if (c.varlen) {
    const int n = r.pick(5);
    for (int i = 0; i < n; ++i) cu.push_back(cu.back() + r.choose(kSequenceLengths));
    c.B = 1;
    c.T = cu.back();
  } else {
    c.B = r.choose(kDims);
    c.T = r.choose(kDims);
  }
  c.H = r.choose(kDims);
  c.HV = r.flag() ? r.choose(kDims) : saturating_mul(c.H, r.choose(kGroups));
  c.K = r.choose(kDims);
  c.V = r.choose(kDims);
  c.N = c.varlen ? static_cast<int64_t>(cu.size()) - 1 : c.B;
  const auto [B, T, H, HV, K, V, N] = std::array<int64_t, 7>{c.B, c.T, c.H, c.HV, c.K, c.V, c.N};
  // Work: the tokens, and a K x V state per (sequence, head) even when there are no tokens.
  int64_t token_work = 1, state_work = 1;
  for (int64_t s : {B, T, HV, K, V}) token_work = s <= 0 ? 0 : saturating_mul(token_work, s);
  for (int64_t s : {N, HV, K, V}) state_work = s <= 0 ? 0 : saturating_mul(state_work, s);
  if (token_work > kMaxWork || state_work > kMaxWork) return false;

  const bool with_initial_state = !r.flag();
  const bool with_final_state = !r.flag();
  const std::vector<int64_t> state = c.options.state_layout == StateLayout::k_first
                                         ? std::vector<int64_t>{N, HV, K, V}
                                         : std::vector<int64_t>{N, HV, V, K};
  std::vector<int64_t> dt_bias_shape = {HV};
  if (mt.gate == GateKind::vector)
    dt_bias_shape =
        r.flag() ? std::vector<int64_t>{HV, K} : std::vector<int64_t>{saturating_mul(HV, K)};

  const DType f32 = DType::f32;
  auto& plans = c.plans;
  plans[q] = plan_tensor(r, true, f32, {B, T, H, K});
  plans[k] = plan_tensor(r, true, f32, {B, T, H, K});
  plans[v] = plan_tensor(r, true, f32, {B, T, HV, V});
  plans[g] = plan_tensor(r, mt.gate != GateKind::none, f32,
                         mt.gate == GateKind::scalar ? std::vector<int64_t>{B, T, HV}
                                                     : std::vector<int64_t>{B, T, HV, K});
  plans[beta] = plan_tensor(r, mt.delta, f32, {B, T, HV});
  plans[initial_state] = plan_tensor(r, with_initial_state, f32, state);
  plans[cu_seqlens] = plan_tensor(r, c.varlen, DType::i64, {saturating_add(N, 1)});
  plans[A_log] = plan_tensor(r, c.options.gate_in_kernel, f32, {HV});
  plans[dt_bias] = plan_tensor(r, c.options.gate_in_kernel, f32, dt_bias_shape);
  plans[o] = plan_tensor(r, true, f32, {B, T, HV, V});
  plans[final_state] = plan_tensor(r, with_final_state, f32, state);
  // A resized cu_seqlens may hold many more sequences than were planned.
  const TensorView& cu_view = plans[cu_seqlens].view;
  if (cu_view.rank >= 1 && cu_view.shape[0] - 1 > N) {
    int64_t work = cu_view.shape[0];
    for (int64_t s : {HV, K, V}) work = s <= 0 ? 0 : saturating_mul(work, s);
    if (work > kMaxWork) return false;
  }

  // Memory: each tensor in its own buffer, or two sharing one.
  for (int role = 0; role < kRoles; ++role) plans[role].group = role;
  switch (r.pick(8)) {
    case 5: c.sharing = Sharing::in_place_state; break;
    case 6: c.sharing = Sharing::output_over_input; break;
    case 7: c.sharing = Sharing::outputs_together; break;
    default: break;
  }
  if (c.sharing == Sharing::in_place_state) plans[initial_state].group = final_state;
  if (c.sharing == Sharing::output_over_input) plans[o].group = q;
  if (c.sharing == Sharing::outputs_together) plans[final_state].group = o;
  for (Plan& p : plans)
    if (!measure(p)) return false;

  ValueSource values{r.byte(), r.pick(4)};
  back_with_memory(plans, c.buffers, values);
  if (c.sharing == Sharing::in_place_state && plans[initial_state].view.present() &&
      plans[final_state].view.present()) {
    // Exactly the same view, and the same plan: the judge must see final_state's pointer
    // (never null here if final_state's is not) and reach.
    plans[initial_state] = plans[final_state];
  }

  // cu_seqlens: the offsets of the chosen lengths, perhaps with one value spoiled.
  const int64_t spoiled[] = {-1, saturating_add(T, 1), std::numeric_limits<int32_t>::max(),
                             std::numeric_limits<int64_t>::min(), 1};
  write_offsets(r, plans[cu_seqlens], cu, spoiled);
  return true;
}

// ---------------------------------------------------------------------------------------
// The contract, restated from flashdelta.h without looking at validate.cpp

enum class Verdict { valid, invalid, unknown };

struct Judgement {
  Verdict verdict = Verdict::valid;
  std::string reason;  // why it is invalid (the first reason found)

  void invalid(const std::string& why) {
    if (verdict == Verdict::invalid) return;
    verdict = Verdict::invalid;
    reason = why;
  }
  void unknown() {
    if (verdict == Verdict::valid) verdict = Verdict::unknown;
  }
};

bool is_index(DType t) { return t == DType::i32 || t == DType::i64; }

Judgement judge(const Case& c) {
  Judgement j;
  const Options& opt = c.options;
  const MechanismTraits mt = traits(opt.mechanism);
  const bool gated = mt.gate != GateKind::none;
  const auto& plans = c.plans;
  auto present = [&](Role role) { return plans[role].view.present(); };
  auto shape = [&](Role role) { return plans[role].shape(); };

  // Options.
  if (opt.gate_in_kernel && !gated) j.invalid("gate_in_kernel without a gate");
  const bool lower_bound_ok = opt.lower_bound && opt.gate_in_kernel &&
                              std::isfinite(*opt.lower_bound) && *opt.lower_bound < 0;
  if (opt.lower_bound && !lower_bound_ok)
    j.invalid("lower_bound not finite < 0 with gate_in_kernel");
  if (opt.scale && !std::isfinite(*opt.scale)) j.invalid("scale not finite");
  if (opt.chunk_size != 16 && opt.chunk_size != 32 && opt.chunk_size != 64 && opt.chunk_size != 128)
    j.invalid("chunk_size");
  if (opt.num_threads < 0) j.invalid("num_threads < 0");

  // Sizes, as the contract defines them: B, T, H, K from q; HV, V from v; N from cu_seqlens.
  for (Role role : {q, k, v, o})
    if (!present(role)) j.invalid(std::string(kRoleNames[role]) + " absent");
  if (!present(q) || !present(v)) return j;
  if (shape(q).size() != 4 || shape(v).size() != 4) {
    j.invalid("q or v not of rank 4");
    return j;
  }
  const int64_t B = shape(q)[0], T = shape(q)[1], H = shape(q)[2], K = shape(q)[3];
  const int64_t HV = shape(v)[2], V = shape(v)[3];
  const bool varlen = present(cu_seqlens);
  const int64_t N = varlen && shape(cu_seqlens).size() == 1 ? shape(cu_seqlens)[0] - 1 : B;
  for (int64_t s : {B, T, H, HV, K, V, N})  // far beyond memory: not this harness's question
    if (s > (int64_t{1} << 40)) j.unknown();
  if (B < 0 || T < 0) j.invalid("negative B or T");
  if (B > (int64_t{1} << 24)) j.invalid("B above 2^24");
  if (HV > (int64_t{1} << 24)) j.invalid("HV above 2^24");
  if (H < 1) j.invalid("H < 1");
  if (HV < 1 || (H >= 1 && HV % H != 0)) j.invalid("HV not a positive multiple of H");
  if (K < 1 || K > 256 || V < 1 || V > 256) j.invalid("K or V outside 1..256");

  // Shapes, presence and the gate parameters.
  using Shape = std::vector<int64_t>;
  const Shape state =
      opt.state_layout == StateLayout::k_first ? Shape{N, HV, K, V} : Shape{N, HV, V, K};
  std::vector<std::pair<Role, std::vector<Shape>>> expected = {
      {k, {{B, T, H, K}}},
      {v, {{B, T, HV, V}}},
      {o, {{B, T, HV, V}}},
      {beta, {{B, T, HV}}},
      {initial_state, {state}},
      {final_state, {state}},
      {A_log, {{HV}}},
      {g, {mt.gate == GateKind::scalar ? Shape{B, T, HV} : Shape{B, T, HV, K}}},
      {dt_bias, mt.gate == GateKind::vector ? std::vector<Shape>{{HV, K}, {saturating_mul(HV, K)}}
                                            : std::vector<Shape>{{HV}}}};
  for (const auto& [role, shapes] : expected)
    if (present(role) && std::find(shapes.begin(), shapes.end(), shape(role)) == shapes.end())
      j.invalid(std::string(kRoleNames[role]) + " shape");
  if (present(g) != gated) j.invalid("g present iff the mechanism is gated");
  if (present(beta) != mt.delta) j.invalid("beta present iff the mechanism has a delta rule");
  if (present(A_log) && !opt.gate_in_kernel) j.invalid("A_log without gate_in_kernel");
  if (!present(A_log) && opt.gate_in_kernel && !opt.lower_bound)
    j.invalid("gate_in_kernel without lower_bound needs A_log");
  if (present(dt_bias) && !opt.gate_in_kernel) j.invalid("dt_bias without gate_in_kernel");

  // Each present tensor's device, pointer, dtype and (for outputs) strides.
  for (int role = 0; role < kRoles; ++role) {
    const Plan& p = plans[role];
    const TensorView& t = p.view;
    if (!t.present()) continue;
    const std::string name = kRoleNames[role];
    if (t.device != Device::cpu) j.invalid(name + " on cuda (not in this build)");
    if (p.null_data && element_count(t) > 0) j.invalid(name + " null with elements");
    const bool is_state = role == initial_state || role == final_state;
    if (is_state && t.dtype != DType::f32 && t.dtype != DType::f64) j.invalid(name + " dtype");
    if (role == cu_seqlens && !is_index(t.dtype)) j.invalid("cu_seqlens dtype");
    if (!is_state && role != cu_seqlens && !is_floating(t.dtype)) j.invalid(name + " dtype");
    if (role == o || role == final_state) {
      // Arbitrary strides may make an output's elements coincide; the contract is silent.
      if (p.layout == Layout::arbitrary) j.unknown();
      for (int d = 0; d < t.rank; ++d)
        if (t.stride[d] == 0 && t.shape[d] > 1 && element_count(t) > 0)
          j.invalid(name + " broadcast output");
    }
  }

  // Memory shared between an output and another tensor, read from the views as passed (the
  // buffer groups and the reach of each plan), not from the sharing mode drawn: plans of one
  // group share a buffer and every view in it starts at its first byte, so two that reach
  // memory overlap. The one overlap the contract allows is final_state aliasing
  // initial_state exactly (an in-place update).
  auto same_view = [&](Role a, Role b) {
    const TensorView &x = plans[a].view, &y = plans[b].view;
    return x.data == y.data && x.dtype == y.dtype && x.rank == y.rank && x.shape == y.shape &&
           x.stride == y.stride;
  };
  for (int a = 0; a < kRoles; ++a)
    for (int b = a + 1; b < kRoles; ++b) {
      const bool output = a == o || a == final_state || b == o || b == final_state;
      if (!output || plans[a].group != plans[b].group || !plans[a].reaches_memory() ||
          !plans[b].reaches_memory())
        continue;
      if (a == initial_state && b == final_state && same_view(initial_state, final_state))
        continue;
      j.invalid(std::string(kRoleNames[b]) + " overlaps " + kRoleNames[a]);
    }

  // cu_seqlens: B = 1, and offsets read back through the view: 0, non-decreasing, ending at T.
  if (varlen) {
    const TensorView& cu = plans[cu_seqlens].view;
    if (B != 1) j.invalid("cu_seqlens with B != 1");
    if (cu.rank != 1 || cu.shape[0] < 1) {
      j.invalid("cu_seqlens shape");
    } else if (cu.data && is_index(cu.dtype) && cu.device == Device::cpu) {
      bool ok = load_index(cu, 0) == 0;
      for (int64_t i = 1; i < cu.shape[0]; ++i)
        ok = ok && load_index(cu, i) >= load_index(cu, i - 1) && load_index(cu, i) <= T;
      ok = ok && load_index(cu, cu.shape[0] - 1) == T;
      if (!ok) j.invalid("cu_seqlens values");
    }
  }
  return j;
}

void print_case(const Case& c) {
  const Options& opt = c.options;
  std::fprintf(stderr, "%s B=%lld T=%lld H=%lld HV=%lld K=%lld V=%lld N=%lld %s\n",
               mechanism_name(opt.mechanism), static_cast<long long>(c.B),
               static_cast<long long>(c.T), static_cast<long long>(c.H),
               static_cast<long long>(c.HV), static_cast<long long>(c.K),
               static_cast<long long>(c.V), static_cast<long long>(c.N), c.varlen ? "varlen" : "");
  for (int role = 0; role < kRoles; ++role) {
    const TensorView& t = c.plans[role].view;
    if (!t.present()) continue;
    std::string shape, stride;
    for (int d = 0; d < t.rank; ++d) {
      shape += (d ? ", " : "") + std::to_string(t.shape[d]);
      stride += (d ? ", " : "") + std::to_string(t.stride[d]);
    }
    std::fprintf(stderr, "  %-13s %-8s [%s] strides [%s]%s%s\n", kRoleNames[role],
                 dtype_name(t.dtype), shape.c_str(), stride.c_str(),
                 t.device == Device::cuda ? " cuda" : "", t.data ? "" : " null");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ChoiceReader r(data, size);
  Case c;
  if (!decode_case(r, c)) return 0;
  const Judgement expected = judge(c);

  // FLASHDELTA_FUZZ_VERBOSE=1 prints each case and its outcome, to see what a seed or a
  // reproducer does.
  static const bool verbose = std::getenv("FLASHDELTA_FUZZ_VERBOSE") != nullptr;
  if (verbose) print_case(c);
  std::string rejection;
  bool ran = false;
  try {
    forward(c.args(), c.options, Schedule::reference);
    ran = true;
    if (verbose) std::fprintf(stderr, "ran: %s\n", mechanism_name(c.options.mechanism));
  } catch (const Error& e) {  // rejected with a message: the outcome for most inputs
    rejection = e.what();
    if (verbose) std::fprintf(stderr, "rejected: %s\n", e.what());
  }
  if (expected.verdict == Verdict::valid && !ran) {
    std::fprintf(stderr, "FINDING: a valid call was rejected: %s\n", rejection.c_str());
    std::abort();
  }
  if (expected.verdict == Verdict::invalid && ran) {
    std::fprintf(stderr, "FINDING: an invalid call ran (%s)\n", expected.reason.c_str());
    std::abort();
  }
  return 0;
}
