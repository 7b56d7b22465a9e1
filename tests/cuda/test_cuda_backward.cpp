// The CUDA chunkwise backward against the fp64 reference backward on random inputs: every
// mechanism, lengths past several 64-token chunks and not multiples of them, K and V from 17
// to 256, GVA, both state layouts, every input dtype, varlen with empty and one-token
// sequences, the fused transforms in every gate form, strong and -inf gates, the forward's
// states kept (BackwardArgs::chunk_states); gradients bitwise identical across runs; bad
// schedules refused; both forms of the sequential scans (in registers, the default for
// K <= 128, and the tile scans at every width: FLASHDELTA_BACKWARD_SCANS, _SCAN_COLUMNS), their
// selection on the host too; the key gradients' products over V (the `keys` stage) on every
// case; sequences split into segments (FLASHDELTA_BACKWARD_SCAN_SEGMENTS); the chunk states in
// bfloat16 for 16-bit inputs and their rule (FLASHDELTA_BACKWARD_STATES); the keys stage's
// products on bfloat16 operands (FLASHDELTA_BACKWARD_KEYS) and grads' first products
// (FLASHDELTA_BACKWARD_JOINT); the scans in 128-column blocks (FLASHDELTA_BACKWARD_MMA_COLUMNS).
// Skipped on machines without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "cuda/backward_params.h"
#include "cuda/cuda.h"
#include "cuda/device_mirror.h"
#include "cuda/forward_check.h"
#include "grad_inputs.h"
#include "scoped_env.h"
#include "test_util.h"

namespace flashdelta::testing {
namespace {

constexpr size_t kNumSlots = std::size(kGradInputs);

// A case and the gradients flowing in: d_o and (optionally) d_final_state, float32.
struct BackwardCase {
  Case c;
  HostTensor d_o, d_final;
  bool with_d_final = true;
  HostTensor chunk_states;  // the kept forward states, when set

  BackwardArgs args() const {
    HostTensor unused = c.make_output(DType::f32);
    const ForwardArgs f = c.args(unused, nullptr);
    BackwardArgs a;
    a.q = f.q, a.k = f.k, a.v = f.v, a.g = f.g, a.beta = f.beta;
    a.initial_state = f.initial_state, a.cu_seqlens = f.cu_seqlens;
    a.A_log = f.A_log, a.dt_bias = f.dt_bias;
    a.d_o = d_o.view;
    if (with_d_final) a.d_final_state = d_final.view;
    if (chunk_states.view.present()) a.chunk_states = chunk_states.view;
    return a;
  }
};

BackwardCase make_backward_case(const CaseConfig& cfg, bool with_d_final = true) {
  BackwardCase b{make_case(cfg), {}, {}, with_d_final};
  std::mt19937_64 rng(cfg.seed + 77);
  b.d_o = b.c.make_output(DType::f32);
  b.d_o.set(random_normal(rng, b.d_o.numel()));
  b.d_final = b.c.make_state();
  b.d_final.set(random_normal(rng, b.d_final.numel()));
  return b;
}

struct Gradients {
  HostTensor t[kNumSlots];
  std::vector<double> values(size_t i) const { return t[i].to_double(); }
};

// Gradient outputs of every present input, poisoned so anything unwritten fails.
Gradients allocate_gradients(const BackwardCase& b, BackwardArgs& a, DType dtype) {
  Gradients g;
  for (size_t i = 0; i < kNumSlots; ++i) {
    if (!(a.*kGradInputs[i].value).present()) continue;
    const TensorView& in = (b.c.*kGradInputs[i].tensor).view;
    g.t[i] = HostTensor(dtype, std::vector<int64_t>(in.shape.begin(), in.shape.begin() + in.rank));
    g.t[i].fill(std::numeric_limits<double>::quiet_NaN());
    a.*kGradInputs[i].grad = g.t[i].view;
  }
  return g;
}

Gradients reference_gradients(const BackwardCase& b) {
  BackwardArgs a = b.args();
  Gradients g = allocate_gradients(b, a, DType::f64);
  backward(a, b.c.options, Schedule::reference);
  return g;
}

// The arguments with every tensor copied to the GPU (mirror keeps the copies).
BackwardArgs upload_args(const BackwardArgs& host, DeviceMirror& mirror) {
  BackwardArgs d = host;
  for (TensorView BackwardArgs::*f :
       {&BackwardArgs::q, &BackwardArgs::k, &BackwardArgs::v, &BackwardArgs::g,
        &BackwardArgs::beta, &BackwardArgs::initial_state, &BackwardArgs::cu_seqlens,
        &BackwardArgs::A_log, &BackwardArgs::dt_bias, &BackwardArgs::d_o,
        &BackwardArgs::d_final_state, &BackwardArgs::dq, &BackwardArgs::dk, &BackwardArgs::dv,
        &BackwardArgs::dg, &BackwardArgs::dbeta, &BackwardArgs::d_initial_state,
        &BackwardArgs::dA_log, &BackwardArgs::ddt_bias, &BackwardArgs::chunk_states})
    d.*f = mirror.upload(host.*f);
  return d;
}

// poison_workspace: the backward runs in a caller workspace filled with NaN (0xff bytes), so
// a gradient element no stage writes (or one added to before it is written) shows; its bytes
// afterwards go to *workspace_out where given.
// only < kNumSlots: that gradient alone is asked for (the others are not wanted).
Gradients cuda_gradients(const BackwardCase& b, DType dtype = DType::f32,
                         bool poison_workspace = false, size_t only = kNumSlots,
                         std::vector<unsigned char>* workspace_out = nullptr) {
  BackwardArgs host = b.args();
  Gradients g = allocate_gradients(b, host, dtype);
  if (only < kNumSlots)
    for (size_t i = 0; i < kNumSlots; ++i)
      if (i != only) host.*kGradInputs[i].grad = TensorView{};
  DeviceMirror mirror;
  BackwardArgs d = upload_args(host, mirror);
  void* workspace = nullptr;
  if (poison_workspace) {
    d.workspace_bytes = backward_workspace_bytes(d, b.c.options, Schedule::chunk);
    check_cuda(cudaMalloc(&workspace, d.workspace_bytes), "workspace");
    check_cuda(cudaMemset(workspace, 0xff, d.workspace_bytes), "workspace poison");
    d.workspace = workspace;
  }
  backward(d, b.c.options, Schedule::chunk);
  check_cuda(cudaDeviceSynchronize(), "backward");
  if (workspace != nullptr && workspace_out != nullptr) {
    workspace_out->resize(d.workspace_bytes);
    check_cuda(cudaMemcpy(workspace_out->data(), workspace, d.workspace_bytes,
                          cudaMemcpyDeviceToHost),
               "workspace download");
  }
  if (workspace != nullptr) check_cuda(cudaFree(workspace), "workspace free");
  for (const GradInput& in : kGradInputs) mirror.download(d.*in.grad, host.*in.grad);
  return g;
}

// tf32 products (11 significant bits, rounded to nearest) with float32 sums against float64:
// bench/model/backward_rounding.py puts every-product-tf32 at ~5e-4 of the largest gradient;
// the error grows with the chunk's products (sums of 64-256 terms) and the states'
// accumulation over chunks.
constexpr double kTolerance = 2e-3;
// dA_log and dt_bias's gradient sum every token's and channel's gate gradient, terms of both
// signs: the sum is smaller than its terms, so its relative error is larger.
constexpr double kParamTolerance = 5e-3;
// Gradients stored in bfloat16 round to 8 significant bits.
constexpr double kBf16Tolerance = 1.6e-2;

// For 16-bit inputs the chunk states and their gradients are the keys stage's operands in
// bfloat16 (cuda/cuda.h backward_bf16_states): bench/model/backward_rounding.py puts that
// rounding at up to 3.8e-3 of the largest gate gradient (T = 512, gates with lower bound -5)
// on top of the tf32 products. The `f32_states.` ctest pass runs every test here with them in
// float32 (FLASHDELTA_BACKWARD_STATES=f32), to the tolerances above.
constexpr double kBf16StatesTolerance = 6e-3;
constexpr double kBf16StatesParamTolerance = 1.5e-2;
constexpr const char* kStates = "FLASHDELTA_BACKWARD_STATES";

// Whether the backward keeps b's chunk states in bfloat16 (the library's rule, which
// CudaBackwardStates checks on its own).
bool bf16_states(const BackwardCase& b) {
  const BackwardArgs a = b.args();
  return detail::backward_bf16_states(detail::validate_backward(a, b.c.options),
                                      a.chunk_states.present());
}

// The tolerance of gradient slot i stored in grad_dtype.
double tolerance(size_t i, DType grad_dtype, bool states16) {
  const bool param = kGradInputs[i].value == &BackwardArgs::A_log ||
                     kGradInputs[i].value == &BackwardArgs::dt_bias;
  if (grad_dtype == DType::bf16) return kBf16Tolerance;
  if (states16) return param ? kBf16StatesParamTolerance : kBf16StatesTolerance;
  return param ? kParamTolerance : kTolerance;
}

void expect_gradients_match(const BackwardCase& b, const std::string& what,
                            DType grad_dtype = DType::f32, bool poison_workspace = false) {
  const Gradients ref = reference_gradients(b);
  const Gradients gpu = cuda_gradients(b, grad_dtype, poison_workspace);
  for (size_t i = 0; i < kNumSlots; ++i) {
    if (ref.t[i].bytes.empty() || !ref.t[i].view.present()) continue;
    EXPECT_LT(rel_error(gpu.values(i), ref.values(i)), tolerance(i, grad_dtype, bf16_states(b)))
        << what << ": d" << kGradInputs[i].name << " relative error";
  }
}

std::vector<CaseConfig> backward_grid() {
  const StateLayout kf = StateLayout::k_first, vf = StateLayout::v_first;
  return mechanism_grid({
      {2, 1, 64, 64, 2, 4, kf, DType::bf16, true},
      {1, 64, 128, 128, 1, 2, vf, DType::bf16, true},
      {2, 65, 64, 64, 1, 4, kf, DType::f16, true},
      {1, 130, 60, 100, 2, 4, vf, DType::f32, true},
      {2, 47, 17, 33, 1, 2, kf, DType::f32, false},
      {1, 150, 256, 256, 1, 1, kf, DType::bf16, true},
      {2, 100, 100, 60, 2, 2, kf, DType::f64, true},
      {1, 200, 128, 128, 2, 8, kf, DType::bf16, true},
  }, 7000);
}

class CudaBackwardGrid : public ::testing::TestWithParam<CaseConfig> {};

TEST_P(CudaBackwardGrid, MatchesReference) {
  FLASHDELTA_REQUIRE_GPU();
  expect_gradients_match(make_backward_case(GetParam()), describe(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Backward, CudaBackwardGrid, ::testing::ValuesIn(backward_grid()),
                         [](const auto& info) { return describe(info.param); });

TEST(CudaBackward, VarlenWithEmptyAndOneTokenSequences) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 7100;
  for (const Mechanism m : kAllMechanisms) {
    const CaseConfig c{.mechanism = m, .T = 337, .H = 2, .HV = 4, .K = 64, .V = 48,
                       .dtype = DType::bf16, .seqlens = {0, 1, 200, 0, 64, 65, 7, 0},
                       .seed = seed++};
    expect_gradients_match(make_backward_case(c), std::string("varlen ") + mechanism_name(m));
  }
}

// Host only: more chunk records (chunks x value heads) than a grid holds, 2^31 - 1. The size
// query and the call refuse the shape with a message naming q before the workspace is sized
// (for such shapes its products would pass int64) or any device is touched. The views are
// never read: the inputs broadcast one token along T, dq lies at an address no other view
// reaches.
TEST(CudaBackward, RefusesMoreChunkRecordsThanAGridHolds) {
  const BackwardCase b = make_backward_case({.T = 64, .K = 64, .V = 64}, false);
  BackwardArgs a = b.args();
  constexpr int64_t kT = int64_t{1} << 37;  // 2^31 chunks x 2 value heads
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.d_o}) {
    t->shape[1] = kT;
    t->stride[1] = 0;
  }
  a.dq = a.q;
  a.dq.dtype = DType::f32;
  a.dq.stride = {kT * 2 * 64, 2 * 64, 64, 1};
  a.dq.data = reinterpret_cast<void*>(uintptr_t{1} << 52);
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.initial_state, &a.d_o, &a.dq})
    if (t->present()) t->device = Device::cuda;
  const auto needles = {"'q'", "2^31 - 1 chunk records", "got 4294967296"};
  expect_error([&] { (void)backward_workspace_bytes(a, b.c.options, Schedule::chunk); },
               "the size query", ErrorCode::unsupported, needles);
  expect_error([&] { backward(a, b.c.options, Schedule::chunk); }, "the call",
               ErrorCode::unsupported, needles);
}

// The gradient buffers of the workspace are zeroed only for varlen batches (rows outside
// every sequence); otherwise every stage must write before it adds. A workspace of NaN
// from the caller shows any element that is not.
TEST(CudaBackward, PoisonedCallerWorkspace) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 7150;
  for (const Mechanism m : kAllMechanisms) {
    const MechanismTraits mt = traits(m);
    const CaseConfig c{.mechanism = m, .B = 2, .T = 100, .H = 2, .HV = 4, .K = 40, .V = 48,
                       .dtype = DType::bf16, .qk_l2norm = true, .beta_sigmoid = mt.delta,
                       .gate_in_kernel = mt.gate != GateKind::none, .seed = seed++};
    expect_gradients_match(make_backward_case(c), std::string("poisoned ") + mechanism_name(m),
                           DType::f32, true);
    CaseConfig v = c;
    v.B = 1;
    v.seqlens = {0, 70, 1, 29};
    expect_gradients_match(make_backward_case(v),
                           std::string("poisoned varlen ") + mechanism_name(m), DType::f32, true);
  }
}

// Each gradient asked for alone: the stages that skip work for outputs nobody wants (d beta's
// products with v without dv, the raw gate's gradient kept only for ddt_bias, ...) must still
// give the one that is wanted.
TEST(CudaBackward, EachGradientAlone) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 7170;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet}) {
    const CaseConfig c{.mechanism = m, .B = 2, .T = 100, .H = 2, .HV = 4, .K = 40, .V = 48,
                       .dtype = DType::bf16, .qk_l2norm = true, .beta_sigmoid = true,
                       .gate_in_kernel = true, .seed = seed++};
    const BackwardCase b = make_backward_case(c);
    const Gradients ref = reference_gradients(b);
    for (size_t want = 0; want < kNumSlots; ++want) {
      if (ref.t[want].bytes.empty() || !ref.t[want].view.present()) continue;
      const Gradients gpu = cuda_gradients(b, DType::f32, false, want);
      EXPECT_LT(rel_error(gpu.values(want), ref.values(want)),
                tolerance(want, DType::f32, bf16_states(b)))
          << mechanism_name(m) << ": d" << kGradInputs[want].name << " alone";
    }
  }
}

TEST(CudaBackward, FusedTransformsInEveryGateForm) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 7200;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::gla,
                            Mechanism::simple_gla})
    for (int form = 0; form < 4; ++form) {
      CaseConfig c = gate_form_case(m, form, 150, seed++);
      c.K = c.V = 64;  // the reference backward's time
      expect_gradients_match(make_backward_case(c), std::string(mechanism_name(m)) +
                                                        " gate form " + std::to_string(form));
    }
}

TEST(CudaBackward, StrongAndInfiniteGatesAndBetaZeroOne) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 7300;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gla, Mechanism::gated_deltanet})
    for (const double gate_min : {-1000.0, -8.0}) {
      const CaseConfig c{.mechanism = m, .T = 150, .K = 64, .V = 32, .gate_min = gate_min,
                         .seed = seed++};
      expect_gradients_match(make_backward_case(c), "gates to " + std::to_string(gate_min) +
                                                        " " + mechanism_name(m));
    }
  // Gates to -5.5 per step: over a 16-row block Gamma moves by about 41 +- 6 nats, so about
  // half of the (block, key channel) pairs keep their diagonal pairs on the tensor cores and
  // the others sum them one by one (the 40-nat bound, cuda/backward_blocks.cuh). The general
  // form only: Gated DeltaNet's scalar gate takes the short form (no bound, no tables).
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet}) {
    const CaseConfig c{.mechanism = m, .T = 150, .K = 64, .V = 32, .gate_min = -5.5,
                       .seed = 7400 + static_cast<uint64_t>(m)};
    expect_gradients_match(make_backward_case(c),
                           std::string("gates to -5.5 ") + mechanism_name(m));
  }
  BackwardCase reset = make_backward_case({.T = 130, .K = 32, .V = 32, .seed = seed++});
  std::vector<double> g = reset.c.g.to_double();
  for (size_t i = 0; i < g.size(); i += 97) g[i] = -std::numeric_limits<double>::infinity();
  reset.c.g.set(g);
  expect_gradients_match(reset, "gates of -inf");
  for (const double beta : {0.0, 1.0}) {
    const CaseConfig c{.T = 100, .K = 64, .V = 64, .beta_value = beta, .seed = seed++};
    expect_gradients_match(make_backward_case(c), "beta " + std::to_string(beta));
  }
}

// With several key heads the backward runs in passes over slices of the heads, reusing one
// workspace that stays within three times the float32 size of q, k, v and g (q and k counted
// per value head, as the workspace's arrays are), or is one key head group's where that alone
// is larger; the gradients are those of one pass (GVA and the gate parameters sliced with
// their heads).
TEST(CudaBackward, HeadPassesKeepTheWorkspaceWithinThreeTimesTheInputs) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig cases[] = {
      {.B = 2, .T = 1024, .H = 8, .HV = 8, .K = 128, .V = 128, .dtype = DType::bf16,
       .seed = 7600},
      {.B = 1, .T = 700, .H = 4, .HV = 8, .K = 64, .V = 96, .dtype = DType::bf16,
       .qk_l2norm = true, .gate_in_kernel = true, .lower_bound = -5.0, .seed = 7601},
      // Varlen, a scalar gate with its dt_bias [HV], V-first states, half precision.
      {.mechanism = Mechanism::gated_deltanet, .T = 600, .H = 3, .HV = 6, .K = 64, .V = 64,
       .dtype = DType::f16, .seqlens = {130, 0, 1, 405, 64}, .layout = StateLayout::v_first,
       .beta_sigmoid = true, .gate_in_kernel = true, .seed = 7602}};
  for (const CaseConfig& c : cases) {
    const BackwardCase b = make_backward_case(c);
    DeviceMirror mirror;
    const BackwardArgs d = upload_args(b.args(), mirror);
    const double inputs = 4.0 * c.B * c.T * c.HV * (3 * c.K + c.V);
    // The same problem with a single key head group: the workspace of one pass at the least.
    CaseConfig one = c;
    one.H = 1;
    one.HV = c.HV / c.H;
    const BackwardCase b1 = make_backward_case(one);
    DeviceMirror mirror1;
    const double one_group = static_cast<double>(
        backward_workspace_bytes(upload_args(b1.args(), mirror1), b1.c.options, Schedule::chunk));
    const double bytes =
        static_cast<double>(backward_workspace_bytes(d, b.c.options, Schedule::chunk));
    EXPECT_LE(bytes, std::max(3 * inputs, one_group)) << describe(c);
    // Every case here needs passes: a single pass over all heads would exceed the bound.
    EXPECT_LT(bytes, c.H * one_group) << describe(c);
  }
  expect_gradients_match(make_backward_case(cases[0]), "two passes of four heads");
  expect_gradients_match(make_backward_case(cases[1]), "passes over GVA heads");
  expect_gradients_match(make_backward_case(cases[2]), "passes over varlen scalar-gate heads");
}

// The case of c with the chunk states of a forward from another initial state kept: a backward
// that ignored them would give the gradients of the initial state passed, not the
// reference's with the same states. float32 states (the GPU copies contiguous rows 16 bytes
// at a time, V-first ones element by element), float64 for the linear case (any float dtype
// is read).
BackwardCase with_kept_states(const CaseConfig& c) {
  BackwardCase b = make_backward_case(c);
  Case other = b.c;
  std::vector<double> h0 = other.initial_state.to_double();
  for (double& x : h0) x = 2.0 * x + 0.5;
  other.initial_state.set(h0);
  HostTensor o = other.make_output(DType::f64);
  b.chunk_states =
      other.make_chunk_states(c.mechanism == Mechanism::gla ? DType::f64 : DType::f32);
  ForwardArgs f = other.args(o, nullptr);
  f.chunk_states = b.chunk_states.view;
  forward(f, other.options, Schedule::reference);
  return b;
}

// The forward's states kept (BackwardArgs::chunk_states) replace the sequential states pass.
TEST(CudaBackward, KeptChunkStatesAreReadInsteadOfRecomputed) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig cases[] = {
      {.B = 2, .T = 150, .K = 64, .V = 64, .dtype = DType::bf16, .seed = 7700},
      // Varlen with empty and one-token sequences, V-first states, a scalar gate.
      {.mechanism = Mechanism::gated_deltanet, .T = 266, .H = 2, .HV = 4, .K = 64, .V = 48,
       .dtype = DType::f16, .seqlens = {0, 1, 200, 65}, .layout = StateLayout::v_first,
       .seed = 7701},
      // The linear write (v_new = u), and head passes over GVA heads (states sliced too).
      {.mechanism = Mechanism::gla, .T = 130, .K = 32, .V = 40, .dtype = DType::f32,
       .seed = 7702},
      {.B = 1, .T = 700, .H = 4, .HV = 8, .K = 64, .V = 96, .dtype = DType::bf16,
       .qk_l2norm = true, .gate_in_kernel = true, .lower_bound = -5.0, .seed = 7703}};
  for (const CaseConfig& c : cases)
    expect_gradients_match(with_kept_states(c), "kept states, " + describe(c));
}

TEST(CudaBackward, WithoutFinalStateGradientAndInBfloat16) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig c{.B = 2, .T = 140, .H = 2, .HV = 4, .K = 64, .V = 64,
                     .dtype = DType::bf16, .qk_l2norm = true, .beta_sigmoid = true,
                     .gate_in_kernel = true, .lower_bound = -5.0, .seed = 7400};
  expect_gradients_match(make_backward_case(c, false), "no d_final_state");
  expect_gradients_match(make_backward_case(c), "bf16 gradients", DType::bf16);
}

// The keys stage stages bfloat16 states 8 values at a time where V is a multiple of 8, else
// one by one; a partial key tile (K = 40) and a partial last slice (V = 36) on both.
TEST(CudaBackward, Bfloat16StatesWithRaggedValueColumns) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 7800;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::gla})
    for (const int V : {36, 40}) {
      const CaseConfig c{.mechanism = m, .T = 130, .H = 1, .HV = 2, .K = 40, .V = V,
                         .dtype = DType::bf16, .seed = seed++};
      expect_gradients_match(make_backward_case(c), describe(c));
    }
}

TEST(CudaBackward, BitwiseDeterministic) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig c{.B = 2, .T = 300, .H = 2, .HV = 4, .K = 128, .V = 128,
                     .dtype = DType::bf16, .seqlens = {}, .qk_l2norm = true,
                     .beta_sigmoid = true, .gate_in_kernel = true, .seed = 7500};
  const BackwardCase b = make_backward_case(c);
  const Gradients first = cuda_gradients(b), second = cuda_gradients(b);
  for (size_t i = 0; i < kNumSlots; ++i)
    EXPECT_EQ(first.t[i].bytes, second.t[i].bytes) << "d" << kGradInputs[i].name << " differs";
}

constexpr const char* kScanColumns = "FLASHDELTA_BACKWARD_SCAN_COLUMNS";
constexpr const char* kScans = "FLASHDELTA_BACKWARD_SCANS";
constexpr const char* kScanSegments = "FLASHDELTA_BACKWARD_SCAN_SEGMENTS";

// Host arithmetic only (runs without a GPU): the scans' tile width by the environment.
TEST(CudaBackwardScanColumns, FollowsTheEnvironmentVariable) {
  // Unset, empty or `auto`: the widest tile whose scans * ceil(V / width) blocks give each of
  // the SMs one.
  for (const char* automatic_setting : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv automatic(kScanColumns, automatic_setting);
    EXPECT_EQ(detail::cuda_backward_scan_columns(33, 128, 132), 32);   // 132 blocks
    EXPECT_EQ(detail::cuda_backward_scan_columns(32, 128, 132), 16);   // 128, then 256
    EXPECT_EQ(detail::cuda_backward_scan_columns(17, 128, 132), 16);   // 68, then 136
    EXPECT_EQ(detail::cuda_backward_scan_columns(16, 128, 132), 8);    // 128 at 16
    EXPECT_EQ(detail::cuda_backward_scan_columns(1, 128, 132), 8);     // none fills: narrowest
    EXPECT_EQ(detail::cuda_backward_scan_columns(50, 40, 132), 16);    // 2 tiles of 32, 3 of 16
    EXPECT_EQ(detail::cuda_backward_scan_columns(64, 128, 132), 32);   // issue 6's B=8 passes
    EXPECT_EQ(detail::cuda_backward_scan_columns(8, 128, 132), 8);     // its B=1 T=32768 passes
  }
  for (const char* width : {"32", "16", "8"}) {
    const ScopedEnv forced(kScanColumns, width);
    EXPECT_EQ(detail::cuda_backward_scan_columns(1000, 128, 132), std::stoi(width));
  }
  for (const char* bad : {"4", "64", "Auto", "16 ", "x"})
    expect_setting_rejected(kScanColumns, bad,
                            [] { detail::cuda_backward_scan_columns(1, 128, 132); });
}

// The tile scans at every width: the same gradients, bit for bit, as the widest (each output
// column is summed in the same order whatever the tile), and the reference's. The cases have
// V not a multiple of the width (partial tiles), varlen with empty and one-token sequences,
// V-first states and GVA.
TEST(CudaBackward, ScanTilesOfEveryWidth) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv tiles(kScans, "tiles");
  const CaseConfig cases[] = {
      {.B = 1, .T = 300, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
       .qk_l2norm = true, .seed = 7800},
      {.mechanism = Mechanism::gated_deltanet, .T = 266, .H = 2, .HV = 4, .K = 64, .V = 44,
       .dtype = DType::f16, .seqlens = {0, 1, 200, 65}, .layout = StateLayout::v_first,
       .seed = 7801},
      {.mechanism = Mechanism::gla, .B = 2, .T = 130, .K = 32, .V = 20, .dtype = DType::f32,
       .seed = 7802}};
  for (const CaseConfig& c : cases) {
    const BackwardCase b = make_backward_case(c);
    Gradients widest;
    {
      const ScopedEnv forced(kScanColumns, "32");
      widest = cuda_gradients(b);
    }
    for (const char* width : {"16", "8", "auto"}) {
      const ScopedEnv forced(kScanColumns, width);
      const Gradients narrow = cuda_gradients(b);
      for (size_t i = 0; i < kNumSlots; ++i)
        EXPECT_EQ(narrow.t[i].bytes, widest.t[i].bytes)
            << describe(c) << ", width " << width << ": d" << kGradInputs[i].name << " differs";
      expect_gradients_match(b, describe(c) + ", width " + width);
    }
  }
}

// Host only: the scans in registers for K <= 128 unless the tile scans are asked for.
TEST(CudaBackwardScansMma, FollowsTheEnvironmentVariable) {
  for (const char* registers : {static_cast<const char*>(nullptr), "", "mma"}) {
    const ScopedEnv setting(kScans, registers);
    EXPECT_TRUE(detail::cuda_backward_scans_mma(17));
    EXPECT_TRUE(detail::cuda_backward_scans_mma(128));
    EXPECT_FALSE(detail::cuda_backward_scans_mma(129));  // past its shared memory: tiles
  }
  {
    const ScopedEnv tiles(kScans, "tiles");
    EXPECT_FALSE(detail::cuda_backward_scans_mma(128));
  }
  for (const char* bad : {"MMA", "pipelined"})  // `pipelined`: a form since removed
    expect_setting_rejected(kScans, bad, [] { detail::cuda_backward_scans_mma(128); });
}

// b's gradients with `setting` at `value`, checked against the reference first.
Gradients checked_gradients(const char* setting, const char* value, const BackwardCase& b,
                            const std::string& what) {
  const ScopedEnv chosen(setting, value);
  expect_gradients_match(b, what);
  return cuda_gradients(b);
}

constexpr const char* kGatePairs = "FLASHDELTA_BACKWARD_GATE_PAIRS";

// Host only: a scalar gate's short form unless the general one is asked for.
TEST(CudaBackwardGatePairs, FollowsTheEnvironmentVariable) {
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv setting(kGatePairs, automatic);
    EXPECT_TRUE(detail::cuda_backward_scalar_pairs(GateKind::scalar));
    EXPECT_FALSE(detail::cuda_backward_scalar_pairs(GateKind::vector));
    EXPECT_FALSE(detail::cuda_backward_scalar_pairs(GateKind::none));
  }
  {
    const ScopedEnv general(kGatePairs, "general");
    EXPECT_FALSE(detail::cuda_backward_scalar_pairs(GateKind::scalar));
  }
  for (const char* bad : {"scalar", "General"})
    expect_setting_rejected(kGatePairs, bad,
                            [] { detail::cuda_backward_scalar_pairs(GateKind::scalar); });
}

// A scalar gate's short form (records and grads without per-channel tables) and the general
// form, each against the reference and the two against each other on the same inputs (they
// differ by tf32 roundings, so not bit for bit: that the short form ran at all): both
// delta-rule and linear scalar gates, ragged K and V (partial key slices), varlen with empty
// and one-token sequences, V-first states, strong gates (pairs whose decay underflows),
// fused transforms; bitwise the same from run to run.
TEST(CudaBackward, ScalarGatePairsMatchTheGeneralForm) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig cases[] = {
      {.mechanism = Mechanism::gated_deltanet, .T = 300, .H = 2, .HV = 4, .K = 128, .V = 128,
       .dtype = DType::bf16, .qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true,
       .seed = 8300},
      {.mechanism = Mechanism::simple_gla, .B = 2, .T = 130, .K = 17, .V = 33,
       .dtype = DType::f32, .seed = 8301},
      {.mechanism = Mechanism::gated_deltanet, .T = 266, .H = 2, .HV = 4, .K = 40, .V = 44,
       .dtype = DType::f16, .seqlens = {0, 1, 200, 65}, .layout = StateLayout::v_first,
       .seed = 8302},
      {.mechanism = Mechanism::gated_deltanet, .B = 2, .T = 150, .K = 64, .V = 64,
       .dtype = DType::f32, .gate_min = -8.0, .seed = 8303}};
  for (const CaseConfig& c : cases) {
    const BackwardCase b = make_backward_case(c);
    const Gradients general =
        checked_gradients(kGatePairs, "general", b, describe(c) + ", general form");
    const ScopedEnv automatic(kGatePairs, nullptr);
    expect_gradients_match(b, describe(c) + ", scalar pairs");
    const Gradients first = cuda_gradients(b), second = cuda_gradients(b);
    bool any_differs = false;
    for (size_t i = 0; i < kNumSlots; ++i) {
      EXPECT_EQ(first.t[i].bytes, second.t[i].bytes)
          << describe(c) << ": d" << kGradInputs[i].name << " differs from run to run";
      if (first.t[i].bytes.empty() || !first.t[i].view.present()) continue;
      any_differs |= first.t[i].bytes != general.t[i].bytes;
      // The two forms share their states and stores: only the pairs' roundings differ.
      EXPECT_LT(rel_error(first.values(i), general.values(i)), tolerance(i, DType::f32, false))
          << describe(c) << ": d" << kGradInputs[i].name << " against the general form";
    }
    EXPECT_TRUE(any_differs) << describe(c) << ": the short form did not run";
  }
}

constexpr const char* kFinish = "FLASHDELTA_BACKWARD_FINISH";

// Host only: grads finishes the gradients it can unless the outputs stage is asked to.
TEST(CudaBackwardFinish, FollowsTheEnvironmentVariable) {
  using detail::BackwardFinish;
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv setting(kFinish, automatic);
    EXPECT_EQ(detail::cuda_backward_finish(), BackwardFinish::automatic);
  }
  {
    const ScopedEnv grads(kFinish, "grads");
    EXPECT_EQ(detail::cuda_backward_finish(), BackwardFinish::grads);
  }
  {
    const ScopedEnv outputs(kFinish, "outputs");
    EXPECT_EQ(detail::cuda_backward_finish(), BackwardFinish::outputs);
  }
  for (const char* bad : {"Grads", "stage"})
    expect_setting_rejected(kFinish, bad, [] { detail::cuda_backward_finish(); });
}

// What grads finishes for a problem (cuda_backward_split).
detail::CudaBackwardSplit split_of(const CaseConfig& c) {
  const BackwardCase b = make_backward_case(c);
  return detail::cuda_backward_split(detail::validate_backward(b.args(), b.c.options));
}

// Host only: where it can (`grads`), grads finishes a scalar gate's gradient in its short form
// and, with one value head per key head, dq, dk, dv and d beta; `auto` only for a scalar
// gate's short form; nothing with cu_seqlens or `outputs`.
TEST(CudaBackwardFinish, SplitsByTheProblem) {
  const auto expect_split = [](const CaseConfig& c, bool gate, bool rows, const char* what) {
    const detail::CudaBackwardSplit s = split_of(c);
    EXPECT_EQ(s.gate, gate) << what;
    EXPECT_EQ(s.rows, rows) << what;
  };
  const CaseConfig kda{}, kda_gva{.H = 2, .HV = 4}, varlen{.T = 20, .seqlens = {5, 15}};
  const CaseConfig gdn{.mechanism = Mechanism::gated_deltanet};
  const CaseConfig gdn_gva{.mechanism = Mechanism::gated_deltanet, .H = 2, .HV = 4};
  const CaseConfig deltanet{.mechanism = Mechanism::deltanet};
  {
    const ScopedEnv automatic(kFinish, nullptr);
    expect_split(kda, false, false, "KDA, auto");
    expect_split(kda_gva, false, false, "KDA, GVA, auto");
    expect_split(varlen, false, false, "KDA, varlen, auto");
    expect_split(gdn, true, true, "Gated DeltaNet, auto");
    expect_split(gdn_gva, true, false, "Gated DeltaNet, GVA, auto");
    expect_split(deltanet, false, false, "DeltaNet (no gate), auto");
    const ScopedEnv general(kGatePairs, "general");
    expect_split(gdn, false, false, "Gated DeltaNet, the general form, auto");
  }
  {
    const ScopedEnv grads(kFinish, "grads");
    expect_split(kda, false, true, "KDA, grads");
    expect_split(kda_gva, false, false, "KDA, GVA, grads");
    expect_split(varlen, false, false, "KDA, varlen, grads");
    expect_split(gdn, true, true, "Gated DeltaNet, grads");
    expect_split(deltanet, false, true, "DeltaNet (no gate), grads");
    const ScopedEnv general(kGatePairs, "general");
    expect_split(gdn, false, true, "Gated DeltaNet, the general form, grads");
  }
  const ScopedEnv outputs(kFinish, "outputs");
  expect_split(kda, false, false, "KDA, outputs");
  expect_split(gdn, false, false, "Gated DeltaNet, outputs");
}

// grads finishing every gradient it can (FLASHDELTA_BACKWARD_FINISH=grads: cuda_backward_split)
// against the outputs stage finishing them all, on the same inputs: both against the
// reference in a NaN-poisoned workspace (no stage reads an element it did not write; the
// gradients' own buffers start as NaN, so whatever grads takes and fails to write shows),
// grads' split also with bfloat16 gradients, bitwise the same from run to run, the same to
// float32 roundings (the same functions on the same workspace), and the two workspaces
// different where the split shows in them (it ran) and the same where both splits are one.
// Cases: every transform fused (A_log, dt_bias, beta's sigmoid, the L2
// norm), a lower-bounded gate with GVA (nothing in grads), key slices past K (K = 40), rows of
// 32 lanes (K = V = 256, and K = 256 with V = 64), a scalar gate's short form (its gate in
// grads too), with GVA (its gate alone), and its general form, linear rules with a vector, a
// scalar and no gate, last chunks cut short, each gradient wanted alone, varlen (the outputs
// stage either way).
TEST(CudaBackward, GradsFinishLikeTheOutputsStage) {
  FLASHDELTA_REQUIRE_GPU();
  struct FinishCase {
    CaseConfig c;
    const char* gate_pairs;  // FLASHDELTA_BACKWARD_GATE_PAIRS (nullptr: unset)
  };
  const FinishCase cases[] = {
      {{.B = 2, .T = 150, .H = 2, .HV = 2, .K = 128, .V = 128, .dtype = DType::bf16,
        .qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true, .seed = 8400}, nullptr},
      // A lower-bounded gate on the inputs of the head-pass and kept-state tests (a float32
      // single head, T = 200, was ill-conditioned: its dA_log a 0.4% remainder of its terms,
      // d beta off by 3.4e-3 with another seed, in both splits alike).
      {{.T = 700, .H = 4, .HV = 8, .K = 64, .V = 96, .dtype = DType::bf16, .qk_l2norm = true,
        .gate_in_kernel = true, .lower_bound = -5.0, .seed = 7601}, nullptr},
      {{.B = 2, .T = 100, .H = 2, .HV = 4, .K = 64, .V = 64, .dtype = DType::bf16,
        .gate_in_kernel = true, .seed = 8402}, nullptr},
      {{.T = 90, .H = 1, .HV = 1, .K = 40, .V = 48, .qk_l2norm = true, .gate_in_kernel = true,
        .seed = 8409}, nullptr},
      {{.T = 70, .H = 1, .HV = 1, .K = 256, .V = 256, .dtype = DType::bf16, .qk_l2norm = true,
        .seed = 8403}, nullptr},
      {{.T = 80, .H = 1, .HV = 1, .K = 256, .V = 64, .qk_l2norm = true, .gate_in_kernel = true,
        .seed = 8410}, nullptr},
      {{.mechanism = Mechanism::gated_deltanet, .B = 2, .T = 130, .K = 64, .V = 64,
        .dtype = DType::f16, .layout = StateLayout::v_first, .beta_sigmoid = true,
        .gate_in_kernel = true, .seed = 8404}, nullptr},
      {{.mechanism = Mechanism::gated_deltanet, .T = 100, .K = 48, .V = 40,
        .gate_in_kernel = true, .seed = 8411}, "general"},
      {{.mechanism = Mechanism::gated_deltanet, .T = 120, .H = 2, .HV = 4, .K = 64, .V = 64,
        .dtype = DType::bf16, .qk_l2norm = true, .seed = 8412}, nullptr},
      {{.mechanism = Mechanism::gla, .T = 90, .K = 40, .V = 48, .gate_in_kernel = true,
        .seed = 8413}, nullptr},
      {{.mechanism = Mechanism::simple_gla, .T = 90, .K = 17, .V = 33, .seed = 8405}, nullptr},
      {{.mechanism = Mechanism::linear_attention, .T = 90, .K = 24, .V = 40, .seed = 8406},
       nullptr},
      {{.mechanism = Mechanism::deltanet, .T = 64, .K = 32, .V = 32, .seed = 8407}, nullptr},
      {{.T = 266, .K = 64, .V = 64, .seqlens = {0, 1, 200, 65}, .gate_in_kernel = true,
        .seed = 8408}, nullptr}};
  bool alone = true;  // each gradient alone, for the first case
  for (const FinishCase& fc : cases) {
    const CaseConfig& c = fc.c;
    const ScopedEnv pairs(kGatePairs, fc.gate_pairs);
    const BackwardCase b = make_backward_case(c);
    const std::string name = describe(c) + (fc.gate_pairs ? ", the general form" : "");
    std::vector<unsigned char> stage_ws, grads_ws;
    Gradients stage;
    {
      const ScopedEnv outputs(kFinish, "outputs");
      expect_gradients_match(b, name + ", the outputs stage", DType::f32, true);
      stage = cuda_gradients(b, DType::f32, true, kNumSlots, &stage_ws);
    }
    const ScopedEnv grads(kFinish, "grads");
    const detail::CudaBackwardSplit split = split_of(c);
    expect_gradients_match(b, name + ", finished in grads", DType::f32, true);
    expect_gradients_match(b, name + ", finished in grads", DType::bf16, true);
    const Gradients first = cuda_gradients(b, DType::f32, true, kNumSlots, &grads_ws);
    const Gradients second = cuda_gradients(b);
    // Some of what grads finishes skips the workspace: a delta rule's d beta (left at its
    // zeros) and a scalar gate's per-row total (unless dt_bias's gradient takes its float32
    // copy there, as the outputs stage's does). There the workspaces differ, which shows that
    // the split reached the kernels; with the same split they are the same bytes.
    const bool delta = detail::validate_backward(b.args(), b.c.options).delta;
    const bool shows = (split.rows && delta) || (split.gate && !b.args().dt_bias.present());
    if (shows) {
      EXPECT_NE(grads_ws, stage_ws) << name << ": grads' split did not run";
    } else if (!split.gate && !split.rows) {
      EXPECT_EQ(grads_ws, stage_ws) << name << ": the same split, another workspace";
    }
    for (size_t i = 0; i < kNumSlots; ++i) {
      const std::string what = name + ": d" + kGradInputs[i].name;
      EXPECT_EQ(first.t[i].bytes, second.t[i].bytes) << what << " differs from run to run";
      if (first.t[i].bytes.empty() || !first.t[i].view.present()) continue;
      EXPECT_LT(rel_error(first.values(i), stage.values(i)), 1e-5)
          << what << " against the outputs stage's";
      if (!alone) continue;
      const Gradients one = cuda_gradients(b, DType::f32, false, i);
      EXPECT_LT(rel_error(one.values(i), first.values(i)), 1e-5) << what << " wanted alone";
    }
    alone = false;
  }
}

constexpr const char* kKeys = "FLASHDELTA_BACKWARD_KEYS";

// Host only: the keys stage's products by the environment (tf32 unless asked).
TEST(CudaBackwardKeys, FollowsTheEnvironmentVariable) {
  using detail::cuda::KeysProducts;
  for (const char* tf32 : {static_cast<const char*>(nullptr), "", "auto", "tf32"}) {
    const ScopedEnv setting(kKeys, tf32);
    EXPECT_EQ(detail::cuda_backward_keys_products(), KeysProducts::tf32);
  }
  {
    const ScopedEnv mixed(kKeys, "mixed");
    EXPECT_EQ(detail::cuda_backward_keys_products(), KeysProducts::mixed);
  }
  {
    const ScopedEnv bf16(kKeys, "bf16");
    EXPECT_EQ(detail::cuda_backward_keys_products(), KeysProducts::bf16);
  }
  for (const char* bad : {"BF16", "f32", "bfloat16"})
    expect_setting_rejected(kKeys, bad, [] { detail::cuda_backward_keys_products(); });
}

// Each of `forms` of `setting` against the reference and the setting's tf32 form, and bitwise
// the same from run to run, on cases whose states are bfloat16 (the forms apply only there).
// d_o is float32 noise, not exact in bfloat16: a form that ran differs from tf32 somewhere.
// A mapping error (a k slot or a fragment element taken wrongly) would be an error of the
// gradient's own size against the tf32 form.
void expect_bf16_forms_match(const char* setting, std::initializer_list<const char*> forms,
                             std::initializer_list<CaseConfig> cases) {
  const ScopedEnv states(kStates, nullptr);
  for (const CaseConfig& c : cases) {
    const BackwardCase b = make_backward_case(c);
    ASSERT_TRUE(bf16_states(b)) << describe(c);
    const Gradients ref = reference_gradients(b);
    Gradients tf32;
    {
      const ScopedEnv forced(setting, "tf32");
      tf32 = cuda_gradients(b);
    }
    for (const char* form : forms) {
      const ScopedEnv chosen(setting, form);
      const std::string what = describe(c) + ", " + setting + "=" + form;
      const Gradients first = cuda_gradients(b), second = cuda_gradients(b);
      bool any_differs = false;
      for (size_t i = 0; i < kNumSlots; ++i) {
        EXPECT_EQ(first.t[i].bytes, second.t[i].bytes)
            << what << ": d" << kGradInputs[i].name << " differs from run to run";
        if (ref.t[i].bytes.empty() || !ref.t[i].view.present()) continue;
        const double tol = tolerance(i, DType::f32, true);
        EXPECT_LT(rel_error(first.values(i), ref.values(i)), tol)
            << what << ": d" << kGradInputs[i].name << " relative error";
        any_differs |= first.t[i].bytes != tf32.t[i].bytes;
        EXPECT_LT(rel_error(first.values(i), tf32.values(i)), tol)
            << what << ": d" << kGradInputs[i].name << " against the tf32 form";
      }
      EXPECT_TRUE(any_differs) << what << ": the form did not run";
    }
  }
}

// The keys stage's products on bfloat16 operands (FLASHDELTA_BACKWARD_KEYS=mixed and bf16,
// their permuted k slots and three staged slices) against the reference and the tf32 form:
// GVA with the fused transforms, a partial key tile with V not a multiple of 8 (bfloat16
// states staged element by element) and a partial last slice, varlen with empty and one-token
// sequences on float16 and V-first states, the linear write (two products), K = V = 256,
// one or two slices of V (fewer than the stages: an empty first group, nothing staged in the
// loop), and V = 33 with a short last chunk (rows not 16-byte aligned, zero fills past it);
// bitwise the same from run to run. The states are bfloat16 here whatever the ctest pass
// (float32 states take the tf32 form).
TEST(CudaBackward, KeysProductsOnBfloat16OperandsMatchTheReference) {
  FLASHDELTA_REQUIRE_GPU();
  expect_bf16_forms_match(
      kKeys, {"mixed", "bf16"},
      {{.B = 2, .T = 300, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
        .qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true, .seed = 8400},
       {.T = 130, .H = 1, .HV = 2, .K = 40, .V = 36, .dtype = DType::bf16, .seed = 8401},
       {.mechanism = Mechanism::gated_deltanet, .T = 266, .H = 2, .HV = 4, .K = 64, .V = 40,
        .dtype = DType::f16, .seqlens = {0, 1, 200, 65}, .layout = StateLayout::v_first,
        .seed = 8402},
       {.mechanism = Mechanism::gla, .B = 2, .T = 150, .K = 64, .V = 64, .dtype = DType::bf16,
        .seed = 8403},
       {.T = 70, .H = 1, .HV = 1, .K = 256, .V = 256, .dtype = DType::bf16, .seed = 8404},
       {.T = 100, .H = 1, .HV = 2, .K = 64, .V = 12, .dtype = DType::bf16, .seed = 8405},
       {.mechanism = Mechanism::deltanet, .T = 90, .K = 32, .V = 24, .dtype = DType::bf16,
        .seed = 8406},
       {.T = 75, .H = 1, .HV = 2, .K = 48, .V = 33, .dtype = DType::bf16, .seed = 8407}});
}

constexpr const char* kJoint = "FLASHDELTA_BACKWARD_JOINT";

// Host only: grads' first products on bfloat16 operands only when asked.
TEST(CudaBackwardJoint, FollowsTheEnvironmentVariable) {
  expect_two_valued_setting(kJoint, "tf32", "bf16", {"BF16", "mixed", "f32"},
                            [] { return detail::cuda_backward_joint_bf16(); });
}

// grads' first products on bfloat16 operands (FLASHDELTA_BACKWARD_JOINT=bf16: d A_qk and
// d(beta v) v_new^T over V, their permuted k slots) against the reference and the tf32 form:
// GVA with the fused transforms, a scalar gate (grads' short form) on varlen float16 with
// empty and one-token sequences (K = 64, V = 40), K and V not multiples of 16 (partial last
// slices) and V = 33 (rows not 16-byte aligned), K = V = 256 (16 slices), V = 12 (one
// slice), K = 32 < V = 64, a short last chunk.
TEST(CudaBackward, JointProductsOnBfloat16OperandsMatchTheReference) {
  FLASHDELTA_REQUIRE_GPU();
  expect_bf16_forms_match(
      kJoint, {"bf16"},
      {{.B = 2, .T = 300, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
        .qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true, .seed = 8500},
       {.mechanism = Mechanism::gated_deltanet, .T = 266, .H = 2, .HV = 4, .K = 64, .V = 40,
        .dtype = DType::f16, .seqlens = {0, 1, 200, 65}, .layout = StateLayout::v_first,
        .seed = 8501},
       {.T = 130, .H = 1, .HV = 2, .K = 40, .V = 36, .dtype = DType::bf16, .seed = 8502},
       {.T = 75, .H = 1, .HV = 2, .K = 48, .V = 33, .dtype = DType::bf16, .seed = 8503},
       {.T = 70, .H = 1, .HV = 1, .K = 256, .V = 256, .dtype = DType::bf16, .seed = 8504},
       {.mechanism = Mechanism::deltanet, .T = 100, .K = 64, .V = 12, .dtype = DType::bf16,
        .seed = 8505},
       {.T = 90, .K = 32, .V = 64, .dtype = DType::bf16, .seed = 8506}});
}

// Host only: which inputs keep the chunk states in bfloat16, and the setting that keeps them
// in float32.
TEST(CudaBackwardStates, FollowTheInputDtypeAndTheEnvironmentVariable) {
  detail::Problem p;
  const auto with = [&p](DType q, DType k, DType v) {
    p.in.q.dtype = q, p.in.k.dtype = k, p.in.v.dtype = v;
    return p;
  };
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv setting(kStates, automatic);
    EXPECT_TRUE(detail::backward_bf16_states(with(DType::bf16, DType::bf16, DType::bf16), false));
    EXPECT_TRUE(detail::backward_bf16_states(with(DType::f16, DType::f16, DType::f16), false));
    EXPECT_FALSE(detail::backward_bf16_states(with(DType::bf16, DType::bf16, DType::bf16), true));
    EXPECT_FALSE(detail::backward_bf16_states(with(DType::bf16, DType::bf16, DType::f32), false));
    EXPECT_FALSE(detail::backward_bf16_states(with(DType::f32, DType::f32, DType::f32), false));
  }
  {
    const ScopedEnv f32(kStates, "f32");
    EXPECT_FALSE(detail::backward_bf16_states(with(DType::bf16, DType::bf16, DType::bf16), false));
  }
  for (const char* bad : {"F32", "bf16"})
    expect_setting_rejected(kStates, bad, [&] { detail::backward_bf16_states(p, false); });
}

// Host only: how many segments the scans in registers split each sequence into.
TEST(CudaBackwardScanSegments, FollowsTheEnvironmentVariable) {
  for (const char* automatic_setting : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv automatic(kScanSegments, automatic_setting);
    // The fewest chunk steps one after another: maps' waves x a segment's chunks + carries +
    // the scan's waves x a segment's chunks, 128 blocks a wave.
    EXPECT_EQ(detail::cuda_backward_scan_segments(8, 128, 128, 512), 8);   // issue 6's B=1 passes
    EXPECT_EQ(detail::cuda_backward_scan_segments(64, 128, 128, 64), 1);   // its B=8 passes
    EXPECT_EQ(detail::cuda_backward_scan_segments(16, 128, 128, 512), 3);  // 171 + 2 + 171 steps
    EXPECT_EQ(detail::cuda_backward_scan_segments(4, 128, 128, 512), 16);  // 2 x 32 + 15 + 32
    EXPECT_EQ(detail::cuda_backward_scan_segments(2, 64, 64, 512), 32);    // 16 chunks each
    EXPECT_EQ(detail::cuda_backward_scan_segments(2, 128, 128, 49), 3);    // 17 + 2 + 17 < 49
    EXPECT_EQ(detail::cuda_backward_scan_segments(2, 128, 128, 33), 1);    // 17 + 1 + 17 > 33
    EXPECT_EQ(detail::cuda_backward_scan_segments(1, 128, 128, 31), 1);    // too short
    EXPECT_EQ(detail::cuda_backward_scan_segments(8, 192, 128, 512), 1);   // the tile scans
  }
  {
    const ScopedEnv forced(kScanSegments, "3");
    EXPECT_EQ(detail::cuda_backward_scan_segments(1000, 128, 128, 512), 3);
    EXPECT_EQ(detail::cuda_backward_scan_segments(1, 128, 128, 2), 2);   // at most the chunks
    EXPECT_EQ(detail::cuda_backward_scan_segments(1, 129, 128, 512), 1);
  }
  for (const char* bad : {"0", "5", "auto ", "x"})
    expect_setting_rejected(kScanSegments, bad,
                            [] { detail::cuda_backward_scan_segments(1, 128, 128, 64); });
}

// Sequences split into segments (the segments' maps, then every segment from its carried
// entry): the reference's gradients with the initial state and the final state's gradient
// carried across 1 to 5 segment boundaries, varlen with empty, one-token and one-chunk
// sequences (fewer segments than the batch's), weak gates (what crosses a boundary matters),
// the linear write, kept states (the state
// gradient's scan split alone), K = V = 128 and K < 64; bitwise the same from run to run; and
// the automatic split of a long sequence over few heads.
TEST(CudaBackward, SplitScansMatchTheReference) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv mma(kScans, nullptr);
  {
    const CaseConfig c{.T = 700, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
                       .qk_l2norm = true, .gate_min = -0.05, .seed = 8200};
    const BackwardCase b = make_backward_case(c);
    for (const char* segments : {"3", "8"}) {
      const ScopedEnv split(kScanSegments, segments);
      expect_gradients_match(b, describe(c) + ", segments " + segments);
    }
    const ScopedEnv split(kScanSegments, "8");
    const Gradients first = cuda_gradients(b), second = cuda_gradients(b);
    for (size_t i = 0; i < kNumSlots; ++i)
      EXPECT_EQ(first.t[i].bytes, second.t[i].bytes) << "d" << kGradInputs[i].name << " differs";
  }
  const ScopedEnv split(kScanSegments, "3");
  const CaseConfig varlen{.mechanism = Mechanism::gated_deltanet, .T = 766, .H = 2, .HV = 4,
                          .K = 64, .V = 48, .dtype = DType::f16,
                          .seqlens = {0, 1, 400, 65, 300, 0}, .layout = StateLayout::v_first,
                          .gate_min = -0.05, .seed = 8201};
  expect_gradients_match(make_backward_case(varlen), "split varlen");
  const CaseConfig linear{.mechanism = Mechanism::gla, .B = 2, .T = 520, .K = 40, .V = 100,
                          .dtype = DType::f32, .gate_min = -0.05, .seed = 8202};
  expect_gradients_match(make_backward_case(linear, false), "split linear write, no d_final");
  const CaseConfig kept{.T = 700, .H = 1, .HV = 2, .K = 64, .V = 64, .dtype = DType::bf16,
                        .gate_min = -0.05, .seed = 8203};
  expect_gradients_match(with_kept_states(kept), "split, kept states");
  {
    const ScopedEnv automatic(kScanSegments, nullptr);  // 49 chunks over 2 heads: 3 segments
    const CaseConfig c{.T = 3100, .H = 1, .HV = 2, .K = 128, .V = 128, .dtype = DType::bf16,
                       .qk_l2norm = true, .beta_sigmoid = true, .seed = 8204};
    expect_gradients_match(make_backward_case(c), "automatic split");
  }
}

constexpr const char* kMmaColumns = "FLASHDELTA_BACKWARD_MMA_COLUMNS";

// Host only: 128-column scan blocks where 64-column ones (sequences x value heads x segments
// x tiles) would be more than one per SM, V is wider than one 64-column tile and the GPU has
// the shared memory.
TEST(CudaBackwardMmaColumns, FollowsTheEnvironmentVariable) {
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv setting(kMmaColumns, automatic);
    EXPECT_EQ(detail::cuda_backward_mma_columns(128, 128, 1, 132, true), 128);  // 256 blocks
    EXPECT_EQ(detail::cuda_backward_mma_columns(66, 128, 1, 132, true), 64);    // 132: one each
    EXPECT_EQ(detail::cuda_backward_mma_columns(67, 128, 1, 132, true), 128);   // 134
    EXPECT_EQ(detail::cuda_backward_mma_columns(200, 100, 1, 132, true), 128);  // 2 tiles
    EXPECT_EQ(detail::cuda_backward_mma_columns(1000, 64, 1, 132, true), 64);   // one tile
    EXPECT_EQ(detail::cuda_backward_mma_columns(16, 128, 8, 132, true), 128);   // 256
    EXPECT_EQ(detail::cuda_backward_mma_columns(8, 128, 8, 132, true), 64);     // 128: B=1's passes
    EXPECT_EQ(detail::cuda_backward_mma_columns(16, 128, 3, 132, true), 64);    // 96
    EXPECT_EQ(detail::cuda_backward_mma_columns(128, 128, 1, 132, false), 64);  // no memory
  }
  {
    const ScopedEnv wide(kMmaColumns, "128");
    EXPECT_EQ(detail::cuda_backward_mma_columns(1, 20, 1, 132, true), 128);
    EXPECT_EQ(detail::cuda_backward_mma_columns(1, 128, 3, 132, true), 128);
    EXPECT_EQ(detail::cuda_backward_mma_columns(1, 128, 1, 132, false), 64);
  }
  {
    const ScopedEnv narrow(kMmaColumns, "64");
    EXPECT_EQ(detail::cuda_backward_mma_columns(1000, 128, 1, 132, true), 64);
  }
  for (const char* bad : {"32", "256", "wide", "128 "})
    expect_setting_rejected(kMmaColumns, bad,
                            [] { detail::cuda_backward_mma_columns(1, 128, 1, 132, true); });
}

// The gradients with `setting` = `value` are those with `reference_value` bit for bit (forms
// that compute the same sums in the same order), and the reference's.
void expect_setting_bitwise(const char* setting, const char* reference_value, const char* value,
                            const BackwardCase& b, const std::string& what) {
  Gradients expected;
  {
    const ScopedEnv forced(setting, reference_value);
    expected = cuda_gradients(b);
  }
  const ScopedEnv forced(setting, value);
  const Gradients got = cuda_gradients(b);
  for (size_t i = 0; i < kNumSlots; ++i)
    EXPECT_EQ(got.t[i].bytes, expected.t[i].bytes)
        << what << ", " << setting << "=" << value << ": d" << kGradInputs[i].name
        << " differs from " << reference_value << "'s";
  expect_gradients_match(b, what + ", " + setting + "=" + value);
}

// The scans in registers in 128-column blocks (16 warps, one stage of the key rows for both
// halves): every warp computes what it computes in a 64-column block, so the gradients are
// the 64-column blocks' bit for bit, and the reference's. Cases: both key widths (KP = 64,
// 128), V not a multiple of 128 (warps past V; V = 72: the second half's columns almost all
// past it; V = 40: six of the eight column pairs idle), two 128-column tiles (V = 192, 200,
// 256: a second tile partly or wholly in range), varlen with empty and one-token sequences,
// V-first states, GVA, the linear write (no v_new correction: no partner sums in the states
// scan), no state gradient flowing in, float32 states and kept states (no states scan); split
// sequences (the segments' maps in 64-column blocks, the scans' carries across segments in
// 128-column ones), with the transposed maps and, with kept states, without.
TEST(CudaBackward, WideScanBlocksMatchTheNarrowBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  // Where the GPU lacks the 128-column blocks' shared memory the setting falls back to 64
  // columns, and the comparison would be 64 against 64.
  int device = 0, optin = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
            cudaSuccess);
  if (optin < detail::cuda::backward_scans_mma_shared_bytes(128, 128))
    GTEST_SKIP() << "128-column scan blocks need "
                 << detail::cuda::backward_scans_mma_shared_bytes(128, 128)
                 << " bytes of shared memory per block; this GPU offers " << optin;
  const ScopedEnv mma(kScans, nullptr);
  const ScopedEnv whole(kScanSegments, "1");
  const auto expect_wide_as_narrow = [](const BackwardCase& b, const std::string& what) {
    expect_setting_bitwise(kMmaColumns, "64", "128", b, what);
  };
  const CaseConfig cases[] = {
      {.T = 300, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16, .qk_l2norm = true,
       .beta_sigmoid = true, .seed = 8300},
      {.mechanism = Mechanism::gated_deltanet, .T = 337, .H = 2, .HV = 4, .K = 64, .V = 100,
       .dtype = DType::f16, .seqlens = {0, 1, 200, 0, 64, 65, 7, 0},
       .layout = StateLayout::v_first, .seed = 8301},
      {.T = 200, .H = 1, .HV = 2, .K = 96, .V = 72, .dtype = DType::f32, .seed = 8302},
      {.mechanism = Mechanism::gla, .B = 2, .T = 130, .K = 40, .V = 128, .dtype = DType::bf16,
       .seed = 8303},
      {.T = 150, .H = 1, .HV = 2, .K = 64, .V = 192, .dtype = DType::bf16, .seed = 8307},
      {.mechanism = Mechanism::deltanet, .T = 140, .H = 2, .K = 128, .V = 40,
       .dtype = DType::bf16, .seed = 8308},
      {.T = 130, .H = 1, .K = 32, .V = 256, .dtype = DType::f32, .seed = 8309}};
  for (const CaseConfig& c : cases)
    for (const bool d_final : {true, false})
      expect_wide_as_narrow(make_backward_case(c, d_final),
                            describe(c) + (d_final ? "" : ", no d_final"));
  const CaseConfig kept{.T = 300, .H = 1, .HV = 2, .K = 64, .V = 128, .dtype = DType::bf16,
                        .seed = 8304};
  expect_wide_as_narrow(with_kept_states(kept), "kept states");
  const CaseConfig c{.T = 700, .H = 1, .HV = 2, .K = 128, .V = 128, .dtype = DType::bf16,
                     .gate_min = -0.05, .seed = 8305};
  const CaseConfig ragged{.mechanism = Mechanism::gated_deltanet, .T = 766, .H = 2, .HV = 4,
                          .K = 64, .V = 100, .dtype = DType::f16,
                          .seqlens = {0, 1, 400, 65, 300, 0}, .layout = StateLayout::v_first,
                          .gate_min = -0.05, .seed = 8306};
  const CaseConfig wide_ragged{.T = 500, .H = 1, .HV = 2, .K = 64, .V = 200,
                               .dtype = DType::bf16, .seqlens = {200, 0, 300},
                               .gate_min = -0.05, .seed = 8310};
  for (const char* segments : {"3", "8"}) {
    const ScopedEnv split(kScanSegments, segments);
    expect_wide_as_narrow(make_backward_case(wide_ragged),
                          std::string("V = 200, varlen, segments ") + segments);
    expect_wide_as_narrow(make_backward_case(c), std::string("segments ") + segments);
    expect_wide_as_narrow(make_backward_case(ragged), std::string("varlen, segments ") + segments);
    expect_wide_as_narrow(with_kept_states(kept), std::string("kept, segments ") + segments);
  }
}

// The tile scans (cuda/backward_scan.cu) on the grid's cases with K <= 128, where the default
// is the scans in registers (larger K runs the tile scans in the grid itself).
class CudaBackwardTileScansGrid : public ::testing::TestWithParam<CaseConfig> {};

TEST_P(CudaBackwardTileScansGrid, MatchesReference) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv tiles(kScans, "tiles");
  expect_gradients_match(make_backward_case(GetParam()), describe(GetParam()) + ", tile scans");
}

std::vector<CaseConfig> small_key_grid() {
  std::vector<CaseConfig> grid;
  for (const CaseConfig& c : backward_grid())
    if (c.K <= 128) grid.push_back(c);
  return grid;
}

INSTANTIATE_TEST_SUITE_P(Backward, CudaBackwardTileScansGrid,
                         ::testing::ValuesIn(small_key_grid()),
                         [](const auto& info) { return describe(info.param); });

// Beyond the grid, the default path (the scans in registers for K <= 128, the `keys` stage):
// varlen with empty and one-token sequences over more than one 64-column tile, the linear
// write (no dv_new staged) with K = 40 (a partial key tile), no state gradient flowing in
// with K and V not multiples of 4 (element-wise staging), kept states (they replace the states
// scan; the state-gradient scan still runs), K = 192 (three key tiles, the tile scans),
// bitwise determinism, and the scans in registers being the default.
TEST(CudaBackward, ScansInRegistersAndKeysStageVarlenKeptStatesAndDeterminism) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv unset(kScans, nullptr);
  const CaseConfig varlen{.T = 337, .H = 2, .HV = 4, .K = 64, .V = 100, .dtype = DType::bf16,
                          .seqlens = {0, 1, 200, 0, 64, 65, 7, 0},
                          .layout = StateLayout::v_first, .seed = 7900};
  expect_gradients_match(make_backward_case(varlen), "varlen");
  const CaseConfig linear{.mechanism = Mechanism::gla, .T = 337, .H = 2, .HV = 4, .K = 40,
                          .V = 48, .dtype = DType::bf16, .seqlens = {0, 1, 200, 0, 64, 65, 7, 0},
                          .seed = 8108};
  expect_gradients_match(make_backward_case(linear), "varlen linear write, K = 40");
  const CaseConfig odd{.mechanism = Mechanism::gated_deltanet, .B = 2, .T = 130, .K = 18,
                       .V = 70, .dtype = DType::f16, .qk_l2norm = true, .seed = 7901};
  expect_gradients_match(make_backward_case(odd, false), "K = 18, no d_final");
  const CaseConfig kept{.mechanism = Mechanism::gated_deltanet, .T = 266, .H = 2, .HV = 4,
                        .K = 64, .V = 48, .dtype = DType::f16, .seqlens = {0, 1, 200, 65},
                        .layout = StateLayout::v_first, .seed = 7903};
  expect_gradients_match(with_kept_states(kept), "kept states");
  const CaseConfig wide{.T = 200, .H = 1, .HV = 2, .K = 192, .V = 100, .dtype = DType::bf16,
                        .qk_l2norm = true, .seed = 8111};
  expect_gradients_match(make_backward_case(wide), "K = 192");
  const CaseConfig big{.B = 2, .T = 300, .H = 2, .HV = 4, .K = 128, .V = 128,
                       .dtype = DType::bf16, .qk_l2norm = true, .seed = 7902};
  const BackwardCase b = make_backward_case(big);
  expect_gradients_match(b, "K = V = 128");
  const Gradients first = cuda_gradients(b), second = cuda_gradients(b);
  Gradients registers;
  {
    const ScopedEnv mma(kScans, "mma");
    registers = cuda_gradients(b);
  }
  for (size_t i = 0; i < kNumSlots; ++i) {
    if (first.t[i].bytes.empty()) continue;  // no such input (A_log, dt_bias here)
    EXPECT_EQ(first.t[i].bytes, second.t[i].bytes)
        << "d" << kGradInputs[i].name << " differs between runs";
    EXPECT_EQ(first.t[i].bytes, registers.t[i].bytes)
        << "d" << kGradInputs[i].name << ": the default is not the scans in registers";
  }
}

TEST(CudaBackward, RunsTheChunkScheduleOnly) {
  FLASHDELTA_REQUIRE_GPU();
  const BackwardCase b = make_backward_case({.T = 10, .seed = 7600});
  BackwardArgs host = b.args();
  Gradients g = allocate_gradients(b, host, DType::f32);
  DeviceMirror mirror;
  BackwardArgs d = host;
  for (TensorView BackwardArgs::*f : {&BackwardArgs::q, &BackwardArgs::k, &BackwardArgs::v,
                                      &BackwardArgs::g, &BackwardArgs::beta,
                                      &BackwardArgs::initial_state, &BackwardArgs::d_o,
                                      &BackwardArgs::d_final_state, &BackwardArgs::dq})
    d.*f = mirror.upload(host.*f);
  d.dk = d.dv = d.dg = d.dbeta = d.d_initial_state = TensorView{};
  for (const Schedule s : {Schedule::recurrent, Schedule::reference}) {
    try {
      backward(d, b.c.options, s);
      ADD_FAILURE() << "schedule " << schedule_name(s) << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'schedule'"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace flashdelta::testing
