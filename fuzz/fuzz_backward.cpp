// Fuzz target: argument validation of flashdelta::backward (Schedule::reference). The input
// chooses a problem: options, sizes, cu_seqlens values, which of d_final_state,
// chunk_states (the kept forward states) and the eight gradients are given, and for every
// tensor its presence, dtype, shape, strides, device, a null pointer, and whether it shares
// memory with another (a gradient over an input, over another gradient, or over the kept
// states). Each view is backed by a heap buffer exactly as large as the elements it reaches.
//
// Findings: a crash, a sanitizer report, an exception other than flashdelta::Error, a
// rejected call that wrote any byte of any buffer (the contract: nothing is written unless
// every argument is valid), and the ordinary problem (every choice 0: the empty input)
// rejected. Unlike fuzz_validation it restates no contract beyond these, so it cannot
// disagree with the header; it is there for memory safety and all-or-nothing writes.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "flashdelta/flashdelta.h"
#include "fuzz_views.h"

namespace {

using namespace flashdelta;
using namespace flashdelta::fuzz;

enum Role {
  q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, d_o, d_final_state,
  chunk_states, dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias, kRoles
};
// The gradients, in role order from dq, and the input each belongs to.
constexpr Role kFirstGrad = dq;
constexpr Role kGradOf[] = {q, k, v, g, beta, initial_state, A_log, dt_bias};

struct Case {
  Options options;
  std::array<Plan, kRoles> plans;
  std::array<std::unique_ptr<unsigned char[]>, kRoles> buffers;
  std::array<size_t, kRoles> bytes{};

  BackwardArgs args() const {
    BackwardArgs a;
    TensorView* fields[] = {&a.q,      &a.k,           &a.v,           &a.g,
                            &a.beta,   &a.initial_state, &a.cu_seqlens, &a.A_log,
                            &a.dt_bias, &a.d_o,        &a.d_final_state, &a.chunk_states,
                            &a.dq,     &a.dk,          &a.dv,          &a.dg,
                            &a.dbeta,  &a.d_initial_state, &a.dA_log,   &a.ddt_bias};
    static_assert(std::size(fields) == kRoles);
    for (int role = 0; role < kRoles; ++role) *fields[role] = plans[role].view;
    return a;
  }
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s(kRoles);
    for (int i = 0; i < kRoles; ++i) s[i].assign(buffers[i].get(), buffers[i].get() + bytes[i]);
    return s;
  }
};

// 64-token chunks of a sequence (ForwardArgs::chunk_states), saturating.
int64_t chunks_of(int64_t len) { return len <= 0 ? 0 : len / 64 + (len % 64 != 0); }

// Decodes a case and backs its views with memory; false when it is too large to run.
bool decode_case(ChoiceReader& r, Case& c) {
  Options& opt = c.options;
  opt.mechanism = r.choose(kMechanisms);
  const MechanismTraits mt = traits(opt.mechanism);
  const bool gated = mt.gate != GateKind::none;
  opt.state_layout = r.flag() ? StateLayout::v_first : StateLayout::k_first;
  opt.qk_l2norm = r.flag();
  opt.beta_sigmoid = r.flag();
  opt.allow_neg_eigval = opt.beta_sigmoid && r.flag();
  opt.gate_in_kernel = gated && r.flag();
  opt.lower_bound = opt.gate_in_kernel ? r.choose(kLowerBounds) : std::nullopt;
  opt.scale = r.choose(kScales);
  opt.num_threads = r.choose(kThreadCounts);

  const bool varlen = r.flag();
  std::vector<int64_t> cu = {0};
  int64_t B = 0, T = 0, C = 0;
  if (varlen) {
    const int n = r.pick(4);
    for (int i = 0; i < n; ++i) {
      const int64_t len = r.flag() ? 65 : r.choose(kSequenceLengths);  // past a chunk, or short
      cu.push_back(cu.back() + len);
      C += chunks_of(len);
    }
    B = 1;
    T = cu.back();
  } else {
    B = r.choose(kDims);
    T = r.choose(kDims);
    C = B <= 0 ? 0 : saturating_mul(B, chunks_of(T));
  }
  const int64_t H = r.choose(kDims);
  const int64_t HV = saturating_mul(H, r.choose(kGroups));
  const int64_t K = r.choose(kDims), V = r.choose(kDims);
  const int64_t N = varlen ? static_cast<int64_t>(cu.size()) - 1 : B;
  int64_t token_work = 1, state_work = 1, kept_work = 1;
  for (int64_t s : {B, T, HV, K, V}) token_work = s <= 0 ? 0 : saturating_mul(token_work, s);
  for (int64_t s : {N, HV, K, V}) state_work = s <= 0 ? 0 : saturating_mul(state_work, s);
  for (int64_t s : {C, HV, K, V}) kept_work = s <= 0 ? 0 : saturating_mul(kept_work, s);
  if (token_work > kMaxWork || state_work > kMaxWork || kept_work > kMaxWork) return false;

  const bool with_initial_state = !r.flag(), with_d_final = !r.flag(), with_kept = r.flag();
  const auto state_shape = [&](int64_t n) {
    return opt.state_layout == StateLayout::k_first ? std::vector<int64_t>{n, HV, K, V}
                                                    : std::vector<int64_t>{n, HV, V, K};
  };
  std::vector<int64_t> dt_bias_shape = {HV};
  if (mt.gate == GateKind::vector)
    dt_bias_shape =
        r.flag() ? std::vector<int64_t>{HV, K} : std::vector<int64_t>{saturating_mul(HV, K)};
  const bool with_A_log = opt.gate_in_kernel && (!opt.lower_bound || r.flag());
  const std::vector<int64_t> gate_shape = mt.gate == GateKind::scalar
                                              ? std::vector<int64_t>{B, T, HV}
                                              : std::vector<int64_t>{B, T, HV, K};

  const DType f32 = DType::f32;
  auto& p = c.plans;
  p[q] = plan_tensor(r, true, f32, {B, T, H, K});
  p[k] = plan_tensor(r, true, f32, {B, T, H, K});
  p[v] = plan_tensor(r, true, f32, {B, T, HV, V});
  p[g] = plan_tensor(r, gated, f32, gate_shape);
  p[beta] = plan_tensor(r, mt.delta, f32, {B, T, HV});
  p[initial_state] = plan_tensor(r, with_initial_state, f32, state_shape(N));
  p[cu_seqlens] = plan_tensor(r, varlen, DType::i64, {saturating_add(N, 1)});
  p[A_log] = plan_tensor(r, with_A_log, f32, {HV});
  p[dt_bias] = plan_tensor(r, opt.gate_in_kernel && !r.flag(), f32, dt_bias_shape);
  p[d_o] = plan_tensor(r, true, f32, {B, T, HV, V});
  p[d_final_state] = plan_tensor(r, with_d_final, f32, state_shape(N));
  p[chunk_states] = plan_tensor(r, with_kept, f32, state_shape(C));
  // A gradient is asked for (usually) where its input is given, in the input's shape.
  for (int i = 0; i < 8; ++i) {
    const Plan& in = p[kGradOf[i]];
    const bool wanted = in.view.present() && r.pick(4) != 3;
    p[kFirstGrad + i] = plan_tensor(r, wanted, f32, in.view.present() ? in.shape()
                                                                       : std::vector<int64_t>{});
  }
  // A resized cu_seqlens may hold many more sequences than were planned.
  const TensorView& cu_view = p[cu_seqlens].view;
  if (cu_view.rank >= 1 && cu_view.shape[0] - 1 > N) {
    int64_t work = cu_view.shape[0];
    for (int64_t s : {HV, K, V}) work = s <= 0 ? 0 : saturating_mul(work, s);
    if (work > kMaxWork) return false;
  }

  // Memory: each tensor in its own buffer, or a gradient sharing one with another tensor.
  for (int role = 0; role < kRoles; ++role) p[role].group = role;
  if (r.pick(4) == 3) {
    const int grad = kFirstGrad + r.pick(8);
    const int other = r.pick(kRoles);
    if (other != grad) p[grad].group = p[other].group;
  }
  for (Plan& plan : p)
    if (!measure(plan)) return false;

  ValueSource values{r.byte(), r.pick(4)};
  c.bytes = back_with_memory(p, c.buffers, values);
  // cu_seqlens: the offsets of the chosen lengths, perhaps with one value spoiled.
  const int64_t spoiled[] = {-1, saturating_add(T, 1), 1, 64};
  write_offsets(r, p[cu_seqlens], cu, spoiled);
  return true;
}

bool all_zero(const uint8_t* data, size_t size) {
  for (size_t i = 0; i < size; ++i)
    if (data[i] != 0) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ChoiceReader r(data, size);
  Case c;
  if (!decode_case(r, c)) return 0;
  const auto before = c.snapshot();
  // FLASHDELTA_FUZZ_VERBOSE=1 prints each outcome, to see what a seed or a reproducer does.
  static const bool verbose = std::getenv("FLASHDELTA_FUZZ_VERBOSE") != nullptr;
  try {
    backward(c.args(), c.options, Schedule::reference);
    if (verbose)
      std::fprintf(stderr, "ran: %s%s%s\n", mechanism_name(c.options.mechanism),
                   c.plans[cu_seqlens].view.present() ? ", varlen" : "",
                   c.plans[chunk_states].view.present() ? ", kept chunk states" : "");
  } catch (const Error& e) {  // rejected with a message: the outcome for most inputs
    if (verbose) std::fprintf(stderr, "rejected: %s\n", e.what());
    if (all_zero(data, size)) {
      std::fprintf(stderr, "FINDING: the ordinary problem was rejected: %s\n", e.what());
      std::abort();
    }
    if (c.snapshot() != before) {
      std::fprintf(stderr, "FINDING: a rejected call wrote memory (%s)\n", e.what());
      std::abort();
    }
  }
  return 0;
}
