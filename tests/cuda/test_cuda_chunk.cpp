// The CUDA chunkwise forward against the fp64 reference on random inputs: every mechanism,
// lengths that are not multiples of the 64-token chunk, every key width the kernels are
// compiled for (64 / 128 / 256, with odd K and V padded), GVA, both state layouts, every
// input dtype, varlen with empty and one-token sequences, the fused transforms, strong
// gates, the per-chunk states, sequences split into segments (FLASHDELTA_CHUNK_STATE_SEGMENTS,
// and automatically for long ones over few heads). Skipped on machines without a GPU; run on
// the device by scripts/device-run.sh.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda.h"
#include "cuda/device_mirror.h"
#include "cuda/forward_check.h"
#include "scoped_env.h"
#include "test_util.h"

namespace flashdelta::testing {
namespace {

constexpr Schedule kChunk = Schedule::chunk;

std::vector<CaseConfig> chunk_grid() {
  const StateLayout kf = StateLayout::k_first, vf = StateLayout::v_first;
  return mechanism_grid({
      {2, 1, 128, 128, 2, 4, kf, DType::bf16, true},
      {1, 64, 128, 128, 1, 2, vf, DType::bf16, true},
      {2, 65, 64, 64, 1, 4, kf, DType::f16, true},
      {1, 130, 60, 100, 2, 4, vf, DType::f32, true},
      {2, 47, 17, 33, 1, 2, kf, DType::f32, false},
      {1, 200, 256, 256, 1, 1, kf, DType::bf16, true},
      {1, 129, 256, 200, 1, 2, vf, DType::f32, true},
      {2, 100, 100, 60, 2, 2, kf, DType::f64, true},
      {1, 300, 128, 128, 2, 8, kf, DType::bf16, true},
  }, 5000);
}

class CudaChunkGrid : public ::testing::TestWithParam<CaseConfig> {};

TEST_P(CudaChunkGrid, MatchesReference) {
  FLASHDELTA_REQUIRE_GPU();
  expect_forward_matches_reference(make_case(GetParam()), describe(GetParam()), kChunk);
}

INSTANTIATE_TEST_SUITE_P(Forward, CudaChunkGrid, ::testing::ValuesIn(chunk_grid()),
                         [](const auto& info) { return describe(info.param); });

TEST(CudaChunk, VarlenLongAndShortWithEmptyAndOneTokenSequences) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 5100;
  for (const Mechanism m : kAllMechanisms) {
    const CaseConfig c{.mechanism = m, .T = 337, .H = 2, .HV = 4, .K = 128, .V = 96,
                       .dtype = DType::bf16, .seqlens = {0, 1, 200, 0, 64, 65, 7, 0},
                       .seed = seed++};
    expect_forward_matches_reference(make_case(c), std::string("varlen ") + mechanism_name(m),
                                     kChunk);
  }
}

TEST(CudaChunk, FusedTransformsAndGateForms) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 5200;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::gla})
    for (int form = 0; form < 4; ++form)
      expect_forward_matches_reference(
          make_case(gate_form_case(m, form, 150, seed++)),
          std::string(mechanism_name(m)) + " gate form " + std::to_string(form),
          kChunk);
}

// Gates down to -1000 per step (the exact pairwise path of the vector gate's diagonal
// blocks), -8 per step (the factorised path near its limit), beta at 0 and 1.
TEST(CudaChunk, StrongGatesAndBetaZeroOne) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 5300;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gla, Mechanism::gated_deltanet,
                            Mechanism::simple_gla})
    for (const double gate_min : {-1000.0, -8.0}) {
      const CaseConfig c{.mechanism = m, .T = 150, .K = 128, .V = 64, .gate_min = gate_min,
                         .seed = seed++};
      expect_forward_matches_reference(
          make_case(c), std::string("gates to ") + std::to_string(gate_min) + " " +
                            mechanism_name(m), kChunk);
    }
  for (const double b : {0.0, 1.0}) {
    const CaseConfig c{.T = 100, .K = 64, .V = 64, .beta_value = b, .seed = seed++};
    expect_forward_matches_reference(make_case(c), "beta " + std::to_string(b), kChunk);
  }
}

// The gate activation's lower bound of -5 (fla's safe_gate) makes the strongest gates the
// factorised path must handle: check no overflow or NaN with raw gates pushed to it.
TEST(CudaChunk, LowerBoundGatesAtTheirLimit) {
  FLASHDELTA_REQUIRE_GPU();
  CaseConfig c{.T = 256, .H = 1, .HV = 2, .K = 128, .V = 128, .dtype = DType::bf16,
               .qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true,
               .lower_bound = -5.0, .seed = 5400};
  Case k = make_case(c);
  k.g.fill(30.0);  // sigmoid -> 1: g = -5 per step
  expect_forward_matches_reference(k, "lower bound -5 saturated", kChunk);
}

// Gates that stress the factorisation (test_util.h): decay concentrated in half of each
// 16-token block with large queries, and hard resets (gates of -inf).
TEST(CudaChunk, OneSidedBlockDecayAndResetGates) {
  FLASHDELTA_REQUIRE_GPU();
  for (const Mechanism m : {Mechanism::kda, Mechanism::gla, Mechanism::gated_deltanet})
    for (const bool one_sided : {true, false})
      expect_forward_matches_reference(
          stressed_gate_case(m, one_sided, 78),
          std::string(mechanism_name(m)) + (one_sided ? " one-sided block decay" : " resets"),
          kChunk);
}

// Seven sequences whose device-resident cu_seqlens overlap (0, 640, 0, 640, ...): the host
// cannot check them, and together they promise more chunks than T holds.
Case malformed_offsets_case() {
  Case c = make_case({.T = 640, .H = 1, .HV = 2, .K = 64, .V = 64,
                      .seqlens = {91, 91, 91, 91, 91, 91, 94}});
  const int64_t overlapping[8] = {0, 640, 0, 640, 0, 640, 0, 640};
  EXPECT_EQ(c.cu_seqlens.view.dtype, DType::i64);
  std::memcpy(c.cu_seqlens.bytes.data(), overlapping, sizeof overlapping);
  return c;
}

// A device-resident cu_seqlens the host cannot check: overlapping sequences promise more
// chunks than the workspace holds. The call must stay inside its memory (run it under
// compute-sanitizer) and finish; its results are unspecified.
TEST(CudaChunk, MalformedDeviceOffsetsStayInBounds) {
  FLASHDELTA_REQUIRE_GPU();
  Case c = malformed_offsets_case();
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  forward_on_device(c.args(o, &s), c.options, kChunk);  // synchronises: faults surface here
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaChunk, InPlaceAndWithoutFinalState) {
  FLASHDELTA_REQUIRE_GPU();
  const Case c = make_case({.B = 3, .T = 70, .K = 128, .V = 64});
  const Outputs ref = run_reference(c);

  HostTensor state = c.initial_state, o = c.make_output(DType::f32);
  ForwardArgs a = c.args(o, nullptr);
  a.initial_state = state.view;
  a.final_state = state.view;  // in place
  forward_on_device(a, c.options, kChunk);
  EXPECT_LT(rel_error(o.to_double(), ref.o), 1e-2);
  EXPECT_LT(rel_error(state.to_double(), ref.state), 1e-2);

  HostTensor o2 = c.make_output(DType::f32);
  forward_on_device(c.args(o2, nullptr), c.options, kChunk);
  EXPECT_LT(rel_error(o2.to_double(), ref.o), 1e-2);
}

TEST(CudaChunk, EmptyBatchPassesStatesThrough) {
  FLASHDELTA_REQUIRE_GPU();
  expect_forward_matches_reference(make_case({.B = 2, .T = 0, .K = 64, .V = 64}), "T = 0", kChunk);
  expect_forward_matches_reference(make_case({.T = 0, .K = 64, .V = 64, .seqlens = {0, 0}}),
                                   "varlen, all empty", kChunk);
}

TEST(CudaChunk, DeterministicBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  const Case c = make_case({.B = 2, .T = 333, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16});
  HostTensor o1 = c.make_output(DType::f32), s1 = c.make_state();
  HostTensor o2 = c.make_output(DType::f32), s2 = c.make_state();
  forward_on_device(c.args(o1, &s1), c.options, kChunk);
  forward_on_device(c.args(o2, &s2), c.options, kChunk);
  EXPECT_EQ(o1.bytes, o2.bytes);
  EXPECT_EQ(s1.bytes, s2.bytes);
}

constexpr const char* kTokenRuns = "FLASHDELTA_CHUNK_TOKEN_RUNS";
constexpr const char* kStateProducts = "FLASHDELTA_CHUNK_STATE_PRODUCTS";
constexpr const char* kStateStages = "FLASHDELTA_CHUNK_STATE_STAGES";
constexpr const char* kInverse = "FLASHDELTA_CHUNK_INVERSE";
constexpr const char* kAqk = "FLASHDELTA_CHUNK_AQK";
constexpr const char* kAqkDtype = "FLASHDELTA_CHUNK_AQK_DTYPE";
constexpr const char* kRecords = "FLASHDELTA_CHUNK_RECORDS";

// Views of host arguments labelled as cuda: the size query and the workspace checks are
// host arithmetic and run before any device access, so this needs no GPU.
ForwardArgs labelled_cuda(ForwardArgs a) {
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.initial_state, &a.cu_seqlens,
                        &a.A_log, &a.dt_bias, &a.o, &a.final_state, &a.chunk_states})
    if (t->present()) t->device = Device::cuda;
  return a;
}

TEST(CudaChunkWorkspace, SizeQueryAndCheckedBeforeAnythingRuns) {
  const ScopedEnv single(kAqk, "bf16");  // the sizes below; the split_aqk ctest pass sets split
  const Case c = make_case({.B = 2, .T = 130, .K = 128, .V = 64});
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  o.fill(kPoison);
  s.fill(kPoison);
  const std::vector<unsigned char> o_before = o.bytes, s_before = s.bytes;
  const ForwardArgs host = c.args(o, &s);
  ForwardArgs a = labelled_cuda(host);

  EXPECT_EQ(forward_workspace_bytes(host, c.options, kChunk), 0u) << "cpu tensors";
  EXPECT_EQ(forward_workspace_bytes(a, c.options, Schedule::recurrent), 0u);
  const size_t need = forward_workspace_bytes(a, c.options, kChunk);
  // 2 rows x 3 chunks x 2 heads = 12 records of 64 rows: bf16 qg, kg, w (128 columns),
  // u (64) and A_qk (64), and per record 128 fp32 decays and 64 + 64 inverse lengths;
  // FLASHDELTA_CHUNK_AQK=split adds A_qk's low part (64).
  EXPECT_EQ(need, 3u * 768 * 128 * 2 + 768 * 64 * 2 + 768 * 64 * 2 + 12 * (128 + 64 + 64) * 4);
  {
    const ScopedEnv pair(kAqk, "split");
    EXPECT_EQ(forward_workspace_bytes(a, c.options, kChunk), need + 768 * 64 * 2);
  }
  // Dense bfloat16 inputs at V = 128 (KDA's gate computed in the kernel from a bfloat16 input):
  // T diag(beta) (64 columns) instead of u, and for Gated DeltaNet no qg and kg;
  // FLASHDELTA_CHUNK_RECORDS=qk keeps u, `full` also qg and kg.
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet}) {
    const Case dense = make_case({.mechanism = m, .B = 2, .T = 130, .K = 128, .V = 128,
                                  .dtype = DType::bf16, .gate_in_kernel = true});
    HostTensor o3 = dense.make_output(DType::f32), s3 = dense.make_state();
    const ForwardArgs args = labelled_cuda(dense.args(o3, &s3));
    const size_t floats = 12 * (128 + 64 + 64) * 4, qk = 2u * 768 * 128 * 2,
                 full = 4u * 768 * 128 * 2 + 768 * 64 * 2 + floats;
    const size_t with_u = m == Mechanism::kda ? full : full - qk,
                 automatic = with_u - 768 * 128 * 2 + 768 * 64 * 2;
    EXPECT_EQ(forward_workspace_bytes(args, dense.options, kChunk), automatic);
    for (const char* same : {"auto", "operands"}) {
      const ScopedEnv records(kRecords, same);
      EXPECT_EQ(forward_workspace_bytes(args, dense.options, kChunk), automatic) << same;
    }
    {
      const ScopedEnv records(kRecords, "qk");
      EXPECT_EQ(forward_workspace_bytes(args, dense.options, kChunk), with_u);
    }
    const ScopedEnv records(kRecords, "full");
    EXPECT_EQ(forward_workspace_bytes(args, dense.options, kChunk), full);
  }
  // A larger T needs more: the size follows the problem, not a fixed cap.
  const Case longer = make_case({.B = 2, .T = 1000, .K = 128, .V = 64});
  HostTensor o2 = longer.make_output(DType::f32), s2 = longer.make_state();
  EXPECT_GT(forward_workspace_bytes(labelled_cuda(longer.args(o2, &s2)), longer.options, kChunk),
            need);

  auto expect_error = [&](const ForwardArgs& args, const std::string& needle) {
    try {
      forward(args, c.options, kChunk);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  alignas(256) static unsigned char small[512];
  a.workspace = small;
  a.workspace_bytes = need - 1;
  expect_error(a, "'workspace_bytes'");
  a.workspace = nullptr;
  a.workspace_bytes = need;
  expect_error(a, "'workspace'");
  a.workspace = small + 16;
  expect_error(a, "aligned to 256");
  EXPECT_EQ(o.bytes, o_before);
  EXPECT_EQ(s.bytes, s_before);
}

// Host only: more chunk records (chunks x value heads) than a grid holds, 2^31 - 1. The size
// query and the call refuse the shape with a message naming q before anything is sized (for
// such shapes the workspace's products would pass int64) or any device is touched. The views
// are never read: the inputs broadcast one token along T, the output lies at an address no
// other view reaches.
TEST(CudaChunkWorkspace, RefusesMoreChunkRecordsThanAGridHolds) {
  const Case c = make_case({.T = 64, .K = 64, .V = 64});
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  s.fill(kPoison);
  const std::vector<unsigned char> s_before = s.bytes;
  ForwardArgs a = labelled_cuda(c.args(o, &s));
  constexpr int64_t kT = int64_t{1} << 37;  // 2^31 chunks x 2 value heads
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta}) {
    t->shape[1] = kT;
    t->stride[1] = 0;
  }
  a.o.shape[1] = kT;
  a.o.stride[0] = kT * a.o.stride[1];
  a.o.data = reinterpret_cast<void*>(uintptr_t{1} << 52);
  const auto needles = {"'q'", "2^31 - 1 chunk records", "got 4294967296"};
  expect_error([&] { (void)forward_workspace_bytes(a, c.options, kChunk); }, "the size query",
               ErrorCode::unsupported, needles);
  expect_error([&] { forward(a, c.options, kChunk); }, "the call", ErrorCode::unsupported,
               needles);
  EXPECT_EQ(s.bytes, s_before) << "the final state was written";
}

// Host only: FLASHDELTA_CHUNK_TOKEN_RUNS takes auto or general,
// FLASHDELTA_CHUNK_STATE_PRODUCTS auto or mma_sync, FLASHDELTA_CHUNK_STATE_STAGES auto, 1 or
// 2, FLASHDELTA_CHUNK_INVERSE auto, distance or tf32, FLASHDELTA_CHUNK_AQK auto, bf16 or split,
// FLASHDELTA_CHUNK_AQK_DTYPE auto, bf16 or f16,
// FLASHDELTA_CHUNK_RECORDS auto, operands, qk or full (read for every mechanism and input,
// not only where it applies);
// anything else fails the call (here its size query, before any device access) naming the
// variable; so does the one-product inverse with the A_qk pair (not built together).
TEST(CudaChunkSettings, RejectUnknownValues) {
  // The pair unset (ctest's split_aqk. pass sets it), for tf32 among the fine values.
  const ScopedEnv single_aqk(kAqk, nullptr);
  const Case c = make_case({.T = 100, .K = 64, .V = 64, .dtype = DType::bf16});
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  const ForwardArgs a = labelled_cuda(c.args(o, &s));
  struct Setting {
    const char* name;
    std::vector<const char*> fine;
    const char* wrong;
  };
  const Setting settings[] = {{kTokenRuns, {"", "auto", "general"}, "dense"},
                              {kStateProducts, {"", "auto", "mma_sync"}, "wgmma"},
                              {kStateStages, {"", "auto", "1", "2"}, "3"},
                              {kInverse, {"", "auto", "distance", "tf32"}, "columns"},
                              {kAqk, {"", "auto", "bf16", "split"}, "pair"},
                              {kAqkDtype, {"", "auto", "bf16", "f16"}, "fp16"},
                              {kRecords, {"", "auto", "operands", "qk", "full"}, "keep_u"}};
  for (const Setting& setting : settings) {
    for (const char* fine : setting.fine) {
      const ScopedEnv set(setting.name, fine);
      EXPECT_GT(forward_workspace_bytes(a, c.options, kChunk), 0u) << setting.name << "=" << fine;
    }
    expect_setting_rejected(setting.name, setting.wrong,
                            [&] { forward_workspace_bytes(a, c.options, kChunk); });
  }
  const ScopedEnv split(kAqk, "split");
  expect_setting_rejected(kInverse, "tf32", [&] { forward_workspace_bytes(a, c.options, kChunk); });
}

TEST(CudaChunkWorkspace, CallerMemoryMatchesTheAllocatingPath) {
  FLASHDELTA_REQUIRE_GPU();
  const Case c = make_case({.B = 1, .T = 333, .HV = 4, .K = 128, .V = 96, .dtype = DType::bf16,
                            .seqlens = {100, 0, 200, 33}});
  HostTensor o1 = c.make_output(DType::f32), s1 = c.make_state();
  forward_on_device(c.args(o1, &s1), c.options, kChunk);

  HostTensor o2 = c.make_output(DType::f32), s2 = c.make_state();
  const ForwardArgs host = c.args(o2, &s2);
  cli::DeviceForward d(host);
  const size_t bytes = forward_workspace_bytes(d.args, c.options, kChunk);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(ws, 0xff, bytes), cudaSuccess);  // garbage: all of it is written first
  d.args.workspace = ws;
  d.args.workspace_bytes = bytes;
  forward(d.args, c.options, kChunk);
  d.download_outputs(host);
  cudaFree(ws);
  EXPECT_EQ(o1.bytes, o2.bytes);
  EXPECT_EQ(s1.bytes, s2.bytes);
}

// ForwardArgs::chunk_states: the state entering every 64-token chunk, written from the state
// kernel's registers by each warp for its value columns, against the reference's entries
// (which test_chunk_states.cpp checks against runs over each prefix). Entries start
// poisoned, so one left unwritten fails.
struct ChunkStatesRun {
  std::vector<double> o, state, chunks;
};

ChunkStatesRun run_with_chunk_states(const Case& c, DType chunk_dtype, Schedule schedule,
                                     DType out_dtype = DType::f32) {
  HostTensor o = c.make_output(out_dtype), s = c.make_state();
  HostTensor h = c.make_chunk_states(chunk_dtype);
  o.fill(kPoison);
  s.fill(kPoison);
  h.fill(kPoison);
  ForwardArgs a = c.args(o, &s);
  a.chunk_states = h.view;
  if (schedule == Schedule::reference)
    forward(a, c.options, schedule);
  else
    forward_on_device(a, c.options, schedule);
  return {o.to_double(), s.to_double(), h.to_double()};
}

void expect_chunk_states_match(const Case& c, DType chunk_dtype, const std::string& what) {
  const ChunkStatesRun ref = run_with_chunk_states(c, DType::f64, Schedule::reference);
  const ChunkStatesRun gpu = run_with_chunk_states(c, chunk_dtype, kChunk);
  const double tol = 1e-2;  // bfloat16 products (and at most bfloat16 rounding of the entries)
  EXPECT_LT(rel_error(gpu.chunks, ref.chunks), tol) << what << ": chunk states, "
                                                    << dtype_name(chunk_dtype);
  EXPECT_LT(rel_error(gpu.o, ref.o), tol) << what << ": output";
  EXPECT_LT(rel_error(gpu.state, ref.state), tol) << what << ": final state";
}

// Fixed length and varlen (empty and one-token sequences), T not a multiple of 64, both
// layouts, with and without an initial state, the three key widths, V over one to four
// blocks of 64 columns with a partial last one, every entry dtype.
TEST(CudaChunkStates, MatchReference) {
  FLASHDELTA_REQUIRE_GPU();
  const StateLayout kf = StateLayout::k_first, vf = StateLayout::v_first;
  struct Shape {
    CaseConfig cfg;
    DType chunk_dtype;
  };
  const Shape shapes[] = {
      {{.B = 2, .T = 150, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16}, DType::f32},
      {{.T = 267, .H = 1, .HV = 2, .K = 64, .V = 96, .seqlens = {0, 1, 64, 65, 130, 0, 7},
        .initial_state = false, .layout = vf},
       DType::f32},
      {{.B = 1, .T = 200, .H = 1, .HV = 1, .K = 256, .V = 200, .layout = vf}, DType::bf16},
      {{.B = 3, .T = 64, .H = 1, .HV = 2, .K = 17, .V = 33, .dtype = DType::f16, .layout = kf},
       DType::f16},
      {{.B = 1, .T = 129, .H = 1, .HV = 1, .K = 100, .V = 60, .dtype = DType::f64}, DType::f64},
  };
  uint64_t seed = 5600;
  for (const Mechanism m : kAllMechanisms)
    for (const Shape& shape : shapes) {
      CaseConfig cfg = shape.cfg;
      cfg.mechanism = m;
      cfg.seed = seed++;
      expect_chunk_states_match(make_case(cfg), shape.chunk_dtype, describe(cfg));
    }
}

// Recording writes the registers out and changes nothing the kernel computes: the same sums
// with and without it, bit for bit. Both output paths (float32: runs of 8 through
// store_run8; dense bfloat16: stmatrix), the token operands (fused transforms, v as given),
// sequences of one token, one chunk and one token more, and exactly two chunks.
TEST(CudaChunkStates, OutputsUnchangedByRecording) {
  FLASHDELTA_REQUIRE_GPU();
  const std::vector<std::pair<std::string, CaseConfig>> cases = {
      {"kda", {.B = 2, .T = 333, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
               .seed = 5700}},
      {"kda, fused transforms, lower bound", gate_form_case(Mechanism::kda, 1, 150, 5701)},
      {"kda, two chunks", {.T = 128, .HV = 2, .K = 128, .V = 128, .dtype = DType::bf16,
                           .seed = 5702}},
      {"gated deltanet, K = V = 64, varlen", {.mechanism = Mechanism::gated_deltanet, .T = 267,
                                              .HV = 4, .K = 64, .V = 64, .dtype = DType::bf16,
                                              .seqlens = {0, 1, 130, 64, 65, 7}, .seed = 5703}},
      {"deltanet, K = 40, V = 200", {.mechanism = Mechanism::deltanet, .B = 2, .T = 130, .K = 40,
                                     .V = 200, .dtype = DType::f32, .seed = 5704}},
  };
  for (const auto& [what, cfg] : cases) {
    const Case c = make_case(cfg);
    for (const DType out : {DType::f32, DType::bf16}) {
      const std::string label = what + ", " + dtype_name(out) + " output";
      HostTensor o = c.make_output(out), s = c.make_state();
      forward_on_device(c.args(o, &s), c.options, kChunk);
      const ChunkStatesRun with = run_with_chunk_states(c, DType::f32, kChunk, out);
      EXPECT_EQ(with.o, o.to_double()) << label;
      EXPECT_EQ(with.state, s.to_double()) << label;
    }
  }
}

// A forward on the device (the other outputs discarded) whose chunk_states is `view` (shape,
// strides, dtype) placed `offset` elements into a device buffer of `elements` elements that
// starts out holding distinct marks: the buffer before and after the call.
struct BufferRun {
  std::vector<double> before, after;
};

BufferRun run_into_buffer(const Case& c, TensorView view, int64_t offset, int64_t elements) {
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  cli::DeviceForward d(c.args(o, &s));
  HostTensor buffer(view.dtype, {elements});
  std::vector<double> marks(static_cast<size_t>(elements));
  for (size_t i = 0; i < marks.size(); ++i) marks[i] = 1000.0 + static_cast<double>(i % 512);
  buffer.set(marks);
  BufferRun run{buffer.to_double(), {}};
  const size_t bytes = buffer.bytes.size();
  char* base = static_cast<char*>(d.mirror.allocate(bytes));
  cli::check_cuda(cudaMemcpy(base, buffer.bytes.data(), bytes, cudaMemcpyHostToDevice), "upload");
  view.data = base + static_cast<size_t>(offset * dtype_size(view.dtype));
  view.device = Device::cuda;
  d.args.chunk_states = view;
  forward(d.args, c.options, kChunk);
  cli::check_cuda(cudaDeviceSynchronize(), "forward");
  cli::check_cuda(cudaMemcpy(buffer.bytes.data(), base, bytes, cudaMemcpyDeviceToHost), "download");
  run.after = buffer.to_double();
  return run;
}

// The chunk states in a view of `dtype` whose rows (the last dimension) are `pad` elements
// apart beyond their length, starting `offset` elements into its buffer: the view's
// elements in shape order, and whether every buffer element outside it kept its value.
struct StridedStates {
  std::vector<double> entries;
  bool outside_untouched = true;
};

StridedStates run_strided_chunk_states(const Case& c, DType dtype, int64_t pad, int64_t offset) {
  std::vector<int64_t> shape = c.state_shape();
  shape[0] = c.chunk_count();
  TensorView v;
  v.dtype = dtype;
  v.rank = 4;
  for (int i = 0; i < 4; ++i) v.shape[i] = shape[i];
  const int64_t row = shape[3] + pad;
  v.stride = {shape[1] * shape[2] * row, shape[2] * row, row, 1};
  int64_t span = 1;
  for (int i = 0; i < 4; ++i) span += (shape[i] - 1) * v.stride[i];
  const BufferRun run = run_into_buffer(c, v, offset, offset + span);

  StridedStates out;
  std::vector<bool> inside(run.after.size(), false);
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t i = 0; i < shape[2]; ++i)
        for (int64_t j = 0; j < shape[3]; ++j) {
          const size_t at = static_cast<size_t>(offset + a * v.stride[0] + b * v.stride[1] +
                                                i * v.stride[2] + j);
          out.entries.push_back(run.after[at]);
          inside[at] = true;
        }
  for (size_t i = 0; i < run.after.size(); ++i)
    if (!inside[i] && run.after[i] != run.before[i]) out.outside_untouched = false;
  return out;
}

// Every way the state kernel stores an entry, in every dtype: key pairs as one vector store
// (V-first, dense rows, the pair's alignment), single elements (K-first; V-first rows an odd
// number of elements apart, or a view one element off the pair's alignment), and the checked
// stores of a slice partly past V (V = 40: the third warp's 16 columns hold 8). Nothing
// outside the view is written.
TEST(CudaChunkStates, EveryStorePathAndDtype) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 5800;
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    const Case c = make_case({.mechanism = Mechanism::kda, .B = 2, .T = 150, .H = 1, .HV = 2,
                              .K = 64, .V = 40, .dtype = DType::bf16, .layout = layout,
                              .seed = seed++});
    const ChunkStatesRun ref = run_with_chunk_states(c, DType::f64, Schedule::reference);
    struct View {
      int64_t pad, offset;
    };
    for (const DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64})
      for (const View view : {View{0, 0}, View{1, 0}, View{0, 1}}) {
        const StridedStates got = run_strided_chunk_states(c, dtype, view.pad, view.offset);
        const std::string what = describe(c.cfg) + " " + dtype_name(dtype) + " pad " +
                                 std::to_string(view.pad) + " offset " +
                                 std::to_string(view.offset);
        EXPECT_LT(rel_error(got.entries, ref.chunks), 1e-2) << what;
        EXPECT_TRUE(got.outside_untouched) << what << ": written outside the view";
      }
  }
}

// No entries (T = 0, or only empty sequences): a zero-length chunk_states is accepted and
// the final states still pass through.
TEST(CudaChunkStates, NoEntries) {
  FLASHDELTA_REQUIRE_GPU();
  for (const CaseConfig& cfg : {CaseConfig{.B = 2, .T = 0, .K = 64, .V = 64},
                                CaseConfig{.T = 0, .K = 64, .V = 64, .seqlens = {0, 0, 0}}}) {
    const Case c = make_case(cfg);
    ASSERT_EQ(c.chunk_count(), 0);
    const ChunkStatesRun ref = run_with_chunk_states(c, DType::f64, Schedule::reference);
    const ChunkStatesRun gpu = run_with_chunk_states(c, DType::f32, kChunk);
    EXPECT_TRUE(gpu.chunks.empty());
    EXPECT_EQ(gpu.state, ref.state) << describe(cfg);
  }
}

// A malformed device table (overlapping sequences) promises more chunks than C: the entries
// past C are not written. C = 10 entries lie at the start of a buffer of 17 (T / 64 + N,
// the most a device table can promise), and the 7 past them must keep their values;
// results are otherwise unspecified (run it under compute-sanitizer too).
TEST(CudaChunkStates, MalformedDeviceOffsetsStayInBounds) {
  FLASHDELTA_REQUIRE_GPU();
  Case c = malformed_offsets_case();
  const int64_t entry = 2 * 64 * 64;
  HostTensor h(DType::f32, {10, 2, 64, 64});  // C = 10: the least a device table allows
  const BufferRun run = run_into_buffer(c, h.view, 0, 17 * entry);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (auto i = static_cast<size_t>(10 * entry); i < run.after.size(); ++i)
    ASSERT_EQ(run.after[i], run.before[i]) << "element " << i << " past C written";
}

// The CUDA recurrent kernel records no chunk states: refused before anything runs (no GPU
// needed), naming the argument.
TEST(CudaChunkStates, RecurrentScheduleRefusesThem) {
  const Case c = make_case({.B = 1, .T = 70, .K = 64, .V = 64});
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  HostTensor h = c.make_chunk_states(DType::f32);
  ForwardArgs host = c.args(o, &s);
  host.chunk_states = h.view;
  ForwardArgs a = labelled_cuda(host);
  try {
    forward(a, c.options, Schedule::recurrent);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("'chunk_states'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(forward_workspace_bytes(a, c.options, Schedule::recurrent), Error);
  // The chunk schedule's workspace does not depend on them.
  ForwardArgs without = a;
  without.chunk_states = TensorView{};
  EXPECT_EQ(forward_workspace_bytes(a, c.options, kChunk),
            forward_workspace_bytes(without, c.options, kChunk));
}

// Long sequences: the state is carried through many chunks in bfloat16 products.
TEST(CudaChunk, LongSequenceAccuracy) {
  FLASHDELTA_REQUIRE_GPU();
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::deltanet}) {
    const CaseConfig c{.mechanism = m, .T = 4000, .H = 1, .HV = 2, .K = 128, .V = 128,
                       .dtype = DType::bf16, .qk_l2norm = true, .beta_sigmoid = true,
                       .seed = 5500};
    expect_forward_matches_reference(make_case(c), std::string("T = 4000 ") + mechanism_name(m),
                                     kChunk);
  }
}

constexpr const char* kSegments = "FLASHDELTA_CHUNK_STATE_SEGMENTS";

// Host only: how many segments the state kernel splits each sequence into.
TEST(CudaChunkStateSegments, FollowsTheEnvironmentVariable) {
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv setting(kSegments, automatic);
    // The fewest chunk steps one after another (detail::split_scan).
    EXPECT_EQ(detail::cuda_chunk_state_segments(16, 128, 128, 512), 3);  // B=1 H=16 T=32768
    EXPECT_EQ(detail::cuda_chunk_state_segments(32, 128, 128, 512), 1);  // 256 + 1 + 256 > 512
    EXPECT_EQ(detail::cuda_chunk_state_segments(64, 128, 128, 128), 1);  // H=64 T=8192
    EXPECT_EQ(detail::cuda_chunk_state_segments(2, 128, 128, 63), 3);    // LongSequenceAccuracy
    EXPECT_EQ(detail::cuda_chunk_state_segments(128, 128, 128, 64), 1);  // B=8 H=16
    EXPECT_EQ(detail::cuda_chunk_state_segments(1, 256, 256, 512), 1);   // K > 128: not split
  }
  {
    const ScopedEnv forced(kSegments, "4");
    EXPECT_EQ(detail::cuda_chunk_state_segments(1000, 64, 64, 100), 4);
    EXPECT_EQ(detail::cuda_chunk_state_segments(1, 64, 64, 3), 3);  // at most the chunks
    EXPECT_EQ(detail::cuda_chunk_state_segments(1, 200, 64, 100), 1);
  }
  for (const char* bad : {"0", "6", "auto ", "x"}) {
    const ScopedEnv wrong(kSegments, bad);
    try {
      detail::cuda_chunk_state_segments(1, 64, 64, 100);
      ADD_FAILURE() << kSegments << ": accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(kSegments), std::string::npos) << e.what();
    }
  }
}

// Sequences split into 3 and 8 segments (the segments' maps, then each segment from its
// carried entry): outputs, final states and recorded chunk states as the reference's, with
// weak gates (what crosses a boundary matters), the initial state carried across up to 7
// boundaries, varlen with empty, one-token and one-chunk sequences, V-first states, the
// linear write, no gate at all (DeltaNet), K = 40 and K = V = 128; and bitwise the same from
// run to run.
TEST(CudaChunk, SplitSequencesMatchTheReference) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig cases[] = {
      {.T = 700, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16, .qk_l2norm = true,
       .gate_min = -0.05, .seed = 5700},
      {.mechanism = Mechanism::gated_deltanet, .T = 766, .H = 2, .HV = 4, .K = 64, .V = 48,
       .dtype = DType::f16, .seqlens = {0, 1, 400, 65, 300, 0}, .layout = StateLayout::v_first,
       .gate_min = -0.05, .seed = 5701},
      {.mechanism = Mechanism::gla, .B = 2, .T = 520, .K = 40, .V = 100, .gate_min = -0.05,
       .seed = 5702},
      {.mechanism = Mechanism::deltanet, .T = 1000, .H = 1, .HV = 2, .K = 128, .V = 128,
       .dtype = DType::bf16, .qk_l2norm = true, .beta_sigmoid = true, .seed = 5703}};
  for (const char* segments : {"3", "8"}) {
    const ScopedEnv split(kSegments, segments);
    for (const CaseConfig& c : cases) {
      const std::string what = describe(c) + ", segments " + segments;
      expect_forward_matches_reference(make_case(c), what, kChunk);
      expect_chunk_states_match(make_case(c), DType::f32, what);
    }
  }
  const ScopedEnv split(kSegments, "8");
  const Case c = make_case(cases[0]);
  const ChunkStatesRun first = run_with_chunk_states(c, DType::f32, kChunk),
                       second = run_with_chunk_states(c, DType::f32, kChunk);
  EXPECT_EQ(first.o, second.o);
  EXPECT_EQ(first.state, second.state);
  EXPECT_EQ(first.chunks, second.chunks);
}

constexpr const char* kPieces = "FLASHDELTA_CHUNK_PIECES";

// Host only: the pieces the forward splits long sequences over few heads into, their state
// kernels beside the next piece's prepare kernel (cuda_chunk_pieces).
TEST(CudaChunkPieces, FollowTheModelAndTheEnvironmentVariable) {
  using detail::cuda_chunk_pieces;
  using Sizes = std::vector<int64_t>;
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv setting(kPieces, automatic);
    // B=1 H=32 T=32768: 64 state blocks leave half of a 128-SM wave to prepare; each piece
    // 0.5 x 30 / 32 times the one before.
    EXPECT_EQ(cuda_chunk_pieces(32, 128, 512), (Sizes{286, 134, 63, 29}));
    EXPECT_EQ(cuda_chunk_pieces(64, 128, 128), Sizes{128});  // H=64 T=8192: every SM's
    EXPECT_EQ(cuda_chunk_pieces(128, 128, 64), Sizes{64});   // B=8 H=16
    EXPECT_EQ(cuda_chunk_pieces(32, 256, 512), Sizes{512});  // K = V = 256: 128 blocks
    EXPECT_EQ(cuda_chunk_pieces(32, 128, 31), Sizes{31});    // fewer than 32 chunks
    // A state step outlasting a chunk's share of prepare: equal pieces.
    EXPECT_EQ(cuda_chunk_pieces(16, 128, 512), (Sizes{128, 128, 128, 128}));
    // The fourth and third pieces would be under 8 chunks.
    EXPECT_EQ(cuda_chunk_pieces(32, 128, 48), (Sizes{33, 15}));
    EXPECT_EQ(cuda_chunk_pieces(48, 128, 512), (Sizes{390, 98, 24}));  // q at its floor 1/4
  }
  for (const char* whole : {"off", "1"}) {
    const ScopedEnv forced(kPieces, whole);
    EXPECT_EQ(cuda_chunk_pieces(32, 128, 512), Sizes{512}) << whole;
  }
  {
    const ScopedEnv forced(kPieces, "2");
    EXPECT_EQ(cuda_chunk_pieces(64, 128, 128), (Sizes{102, 26}));  // where auto takes one
  }
  {
    const ScopedEnv forced(kPieces, "8");
    EXPECT_EQ(cuda_chunk_pieces(1, 64, 3), (Sizes{1, 1, 1}));  // at most the chunks
    EXPECT_EQ(cuda_chunk_pieces(1, 64, 1), Sizes{1});
  }
  for (const char* bad : {"0", "5", "x", "auto ", "on"}) {
    const ScopedEnv wrong(kPieces, bad);
    try {
      cuda_chunk_pieces(32, 128, 512);
      ADD_FAILURE() << kPieces << ": accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(kPieces), std::string::npos) << e.what();
    }
  }
}

// A forward in pieces (each piece's state kernel on a second stream, starting from the
// float32 state the piece before ended with) gives the outputs and final states of one piece
// bit for bit: fixed length with B = 1 and 2, T not a multiple of the chunk (the last piece
// partial), GVA, both state layouts, with and without an initial state, in place, KDA with
// its fused transforms, Gated DeltaNet, the linear write, K = V = 128 (wgmma) and odd widths;
// in the caller's workspace too (garbage-filled). And the pieces as the reference's; with
// chunk states asked for, or cu_seqlens, one piece whatever the variable says.
TEST(CudaChunk, PiecesMatchOnePieceBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  CaseConfig kda = gate_form_case(Mechanism::kda, 1, 1000, 5900);  // GVA, V-first
  kda.B = 1;
  const CaseConfig cases[] = {
      kda,
      {.mechanism = Mechanism::gated_deltanet, .B = 2, .T = 700, .H = 1, .HV = 2, .K = 64,
       .V = 96, .dtype = DType::f16, .layout = StateLayout::v_first, .gate_min = -0.05,
       .seed = 5901},
      {.mechanism = Mechanism::deltanet, .T = 640, .HV = 2, .K = 128, .V = 128,
       .dtype = DType::bf16, .initial_state = false, .qk_l2norm = true, .seed = 5902},
      {.mechanism = Mechanism::gla, .B = 2, .T = 333, .K = 40, .V = 70, .seed = 5903},
  };
  auto run = [](const Case& c, const char* pieces, bool in_place, bool caller_workspace) {
    const ScopedEnv set(kPieces, pieces);
    HostTensor o = c.make_output(DType::f32);
    HostTensor s = in_place ? c.initial_state : c.make_state();
    o.fill(kPoison);
    if (!in_place) s.fill(kPoison);
    ForwardArgs host = c.args(o, &s);
    if (in_place) host.initial_state = s.view;
    cli::DeviceForward d(host);
    void* ws = nullptr;
    if (caller_workspace) {
      const size_t bytes = forward_workspace_bytes(d.args, c.options, kChunk);
      EXPECT_EQ(cudaMalloc(&ws, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemset(ws, 0xff, bytes), cudaSuccess);
      d.args.workspace = ws;
      d.args.workspace_bytes = bytes;
    }
    forward(d.args, c.options, kChunk);
    d.download_outputs(host);
    if (ws) cudaFree(ws);
    return std::make_pair(o.bytes, s.bytes);
  };
  // The size query (host arithmetic, the forward's own plan) says whether pieces run: their
  // regions plus the carried state [N, HV, K, V] in float32.
  auto workspace_bytes = [](const Case& c, const char* pieces) {
    const ScopedEnv set(kPieces, pieces);
    HostTensor o = c.make_output(DType::f32), s = c.make_state();
    return forward_workspace_bytes(labelled_cuda(c.args(o, &s)), c.options, kChunk);
  };
  for (const CaseConfig& cfg : cases) {
    const Case c = make_case(cfg);
    const size_t carry = static_cast<size_t>(c.N * cfg.HV * cfg.K * cfg.V) * 4;
    EXPECT_GE(workspace_bytes(c, "3"), workspace_bytes(c, "off") + carry) << describe(cfg);
    const bool in_place = cfg.initial_state;
    const auto whole = run(c, "off", in_place, false);
    for (const char* pieces : {"2", "3", "8"})
      for (const bool caller_workspace : {false, true}) {
        const std::string what = describe(cfg) + ", " + pieces + " pieces" +
                                 (caller_workspace ? ", caller's workspace" : "");
        const auto split = run(c, pieces, in_place, caller_workspace);
        EXPECT_EQ(split.first, whole.first) << what << ": outputs";
        EXPECT_EQ(split.second, whole.second) << what << ": final states";
      }
    const ScopedEnv three(kPieces, "3");
    expect_forward_matches_reference(c, describe(cfg) + ", 3 pieces", kChunk);
  }
  // Where the forward takes one piece whatever the variable says: recorded chunk states
  // (numbered by sequence) and cu_seqlens; the size query asks for no less than either needs.
  const ScopedEnv three(kPieces, "3");
  expect_chunk_states_match(make_case(kda), DType::f32, "kda, 3 pieces asked, chunk states");
  const CaseConfig varlen{.mechanism = Mechanism::gated_deltanet, .T = 2200, .HV = 2, .K = 64,
                          .V = 64, .dtype = DType::bf16, .seqlens = {0, 2100, 1, 99},
                          .seed = 5904};
  expect_forward_matches_reference(make_case(varlen), "varlen, 3 pieces asked", kChunk);
  EXPECT_EQ(workspace_bytes(make_case(varlen), "3"), workspace_bytes(make_case(varlen), "off"));
}

// Two runs' outputs, final states and chunk states within a relative tol of each other.
void expect_runs_close(const ChunkStatesRun& a, const ChunkStatesRun& b, double tol,
                       const std::string& what) {
  EXPECT_LT(rel_error(a.o, b.o), tol) << what << ": outputs";
  EXPECT_LT(rel_error(a.state, b.state), tol) << what << ": final states";
  EXPECT_LT(rel_error(a.chunks, b.chunks), tol) << what << ": chunk states";
}

// Run a's output no further from c's fp64 reference than 1.25 times run b's (+1e-5); both
// errors printed under their labels.
void expect_about_as_accurate(const Case& c, const ChunkStatesRun& a, const ChunkStatesRun& b,
                              const std::string& what,
                              const std::pair<const char*, const char*>& labels) {
  const ChunkStatesRun ref = run_with_chunk_states(c, DType::f64, Schedule::reference);
  const double e_a = rel_error(a.o, ref.o), e_b = rel_error(b.o, ref.o);
  std::printf("  %s: output error against fp64, %s %.2e, %s %.2e\n", what.c_str(), labels.first,
              e_a, labels.second, e_b);
  EXPECT_LT(e_a, 1.25 * e_b + 1e-5) << what << ": " << labels.first << " is less accurate";
}

// The state kernel's products on wgmma (the default where K <= 128 on sm_90a) and on mma.sync
// (FLASHDELTA_CHUNK_STATE_PRODUCTS=mma_sync) take the same bfloat16 operands and differ only
// in the order of float32 sums, so their outputs, final states and chunk states agree to far
// below the reference's tolerance: a misread operand tile or swizzle would be an error of
// order 1. Both key widths wgmma takes, V-first states, the fused transforms, varlen, a value
// width over four tiles with a partial last one, the linear write (no w), and sequences split
// into segments (the maps' identity columns). The wgmma kernel's one-stage form (two blocks
// per SM, FLASHDELTA_CHUNK_STATE_STAGES=1) and its two-stage form compute the same sums in
// the same order: bitwise equal.
TEST(CudaChunk, WgmmaAndMmaSyncStateProductsAgree) {
  FLASHDELTA_REQUIRE_GPU();
  std::vector<std::pair<std::string, CaseConfig>> cases = {
      {"kda, fused transforms, lower bound", gate_form_case(Mechanism::kda, 1, 150, 5800)},
      {"gated deltanet, K = V = 64, varlen", {.mechanism = Mechanism::gated_deltanet, .T = 267,
                                              .HV = 4, .K = 64, .V = 64, .dtype = DType::bf16,
                                              .seqlens = {0, 1, 130, 64, 65, 7}, .seed = 5801}},
      {"deltanet, K = 40, V = 200", {.mechanism = Mechanism::deltanet, .B = 2, .T = 130, .K = 40,
                                     .V = 200, .dtype = DType::f32, .seed = 5802}},
      {"linear attention", {.mechanism = Mechanism::linear_attention, .T = 200, .HV = 2,
                            .K = 128, .V = 128, .dtype = DType::bf16, .seed = 5803}},
      {"kda, 3 segments", {.T = 700, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
                           .qk_l2norm = true, .gate_min = -0.05, .seed = 5804}},
  };
  for (const auto& [what, cfg] : cases) {
    const ScopedEnv split(kSegments, what.find("segments") != std::string::npos ? "3" : nullptr);
    const Case c = make_case(cfg);
    ChunkStatesRun wgmma, one_stage, mma_sync;
    {
      const ScopedEnv automatic(kStateProducts, nullptr);
      const ScopedEnv two(kStateStages, "2");
      wgmma = run_with_chunk_states(c, DType::f32, kChunk);
    }
    {
      const ScopedEnv one(kStateStages, "1");
      one_stage = run_with_chunk_states(c, DType::f32, kChunk);
    }
    EXPECT_EQ(one_stage.o, wgmma.o) << what << ": outputs, one stage";
    EXPECT_EQ(one_stage.state, wgmma.state) << what << ": final states, one stage";
    EXPECT_EQ(one_stage.chunks, wgmma.chunks) << what << ": chunk states, one stage";
    {
      const ScopedEnv forced(kStateProducts, "mma_sync");
      mma_sync = run_with_chunk_states(c, DType::f32, kChunk);
    }
    // A float32 difference can flip a bfloat16 rounding of S^T here and there (2^-9 of an
    // element), which the recurrence carries on.
    expect_runs_close(wgmma, mma_sync, 1e-3, what);
    expect_forward_matches_reference(c, what, kChunk);
  }
}

// c's outputs, final states and chunk states (float32) with `setting` set to `value` (null:
// unset), the run also checked against the reference (labelled what + ", " + label).
ChunkStatesRun run_with_setting(const Case& c, const std::string& what, const char* setting,
                                const char* value, const std::string& label) {
  const ScopedEnv set(setting, value);
  ChunkStatesRun run = run_with_chunk_states(c, DType::f32, kChunk);
  expect_forward_matches_reference(c, what + ", " + label, kChunk);
  return run;
}

// The same with `setting` unset and set to `forced`.
std::pair<ChunkStatesRun, ChunkStatesRun> run_default_and_forced(
    const Case& c, const std::string& what, const char* setting,
    const std::pair<const char*, const char*>& labels, const char* forced) {
  return {run_with_setting(c, what, setting, nullptr, labels.first),
          run_with_setting(c, what, setting, forced, labels.second)};
}

// The prepare kernel's two orders of T's blocks off the diagonal (cuda/chunk_inverse.cuh): by
// column blocks on tf32 tensor cores in three products (the default) and by distances on the
// CUDA cores (FLASHDELTA_CHUNK_INVERSE=distance). Both are float32 to a few ulp, but their
// T rounds to bfloat16 here and there differently, so outputs and states agree to far below
// the reference's tolerance, not bitwise; a misread fragment would be an error of order 1.
// Both gate forms and no gate, weak gates with beta one (A_kk entries near their bound, T's
// largest), K = 64, 128 and 256, varlen with partial chunks. Each form is checked against the
// reference. The column order in one tf32 product a step (FLASHDELTA_CHUNK_INVERSE=tf32)
// differs from float32 by ~2.5e-4 in T's blocks off the diagonal, and 6-10% of T's bfloat16
// entries then round the other way: in the rounding model of the first and last two cases
// its outputs stay within 1e-4 of the distance order's, with weak gates and beta one (float32
// inputs, T far from the identity) ~2.3e-3 (final states 2.7e-3), at K = 256 ~1.1e-3
// (bench/NOTES.md (at)); it is asked 6e-3, still far below a misread fragment's error.
TEST(CudaChunk, InverseOrdersAgree) {
  FLASHDELTA_REQUIRE_GPU();
  std::vector<std::pair<std::string, CaseConfig>> cases = {
      {"kda, fused transforms, lower bound", gate_form_case(Mechanism::kda, 1, 150, 5900)},
      {"kda, weak gates, beta one", {.T = 200, .HV = 2, .K = 128, .V = 64, .dtype = DType::f32,
                                     .qk_l2norm = true, .gate_min = -0.01, .beta_value = 1.0,
                                     .seed = 5901}},
      {"gated deltanet, K = V = 64, varlen", {.mechanism = Mechanism::gated_deltanet, .T = 267,
                                              .HV = 4, .K = 64, .V = 64, .dtype = DType::bf16,
                                              .seqlens = {0, 1, 130, 64, 65, 7}, .seed = 5902}},
      {"deltanet, K = 256, V = 120", {.mechanism = Mechanism::deltanet, .T = 130, .K = 256,
                                      .V = 120, .dtype = DType::bf16, .qk_l2norm = true,
                                      .seed = 5903}},
  };
  for (const auto& [what, cfg] : cases) {
    const Case c = make_case(cfg);
    const auto [columns, distance] =
        run_default_and_forced(c, what, kInverse, {"by columns", "by distance"}, "distance");
    expect_runs_close(columns, distance, 1e-3, what);
    // Not built with the A_qk pair (the host refuses the two): skipped in ctest's split_aqk.
    // pass, which runs this test with FLASHDELTA_CHUNK_AQK=split.
    if (const char* aqk = std::getenv(kAqk); aqk && std::string(aqk) == "split") continue;
    const ScopedEnv one_product(kInverse, "tf32");
    const ChunkStatesRun tf32 = run_with_chunk_states(c, DType::f32, kChunk);
    expect_forward_matches_reference(c, what + ", by columns in one tf32 product", kChunk);
    constexpr double kTolOneProduct = 6e-3;
    EXPECT_LT(rel_error(tf32.o, distance.o), kTolOneProduct) << what << ": outputs, tf32";
    EXPECT_LT(rel_error(tf32.state, distance.state), kTolOneProduct)
        << what << ": final states, tf32";
    EXPECT_LT(rel_error(tf32.chunks, distance.chunks), kTolOneProduct)
        << what << ": chunk states, tf32";
  }
}

// A_qk as a bfloat16 pair hi + lo (FLASHDELTA_CHUNK_AQK=split) against single bfloat16 (the
// default; the pair costs +15% of the KDA forward, bench/NOTES.md (bk)): its operands' and its own rounding are the output's
// largest errors with a vector gate. In the rounding model (bench/NOTES.md (f), (as), (bf)) the
// pair, with the column operands' low parts on the diagonal blocks only, takes KDA's output
// error from 3.8e-3 to 2.54e-3 (0.665), and the partial forms a bug would leave stay above
// 0.78 of it (the state kernel's low product, the row or the column operands' low parts
// missing), so the first case asks 0.75 with float32 output (its own rounding would
// hide the difference), on both state products (wgmma, mma.sync). A misread low part would
// move the output away instead. Strong gates (most channels too steep to factorise over a
// block: the low parts' zeros on their diagonal blocks, where a factor is up to 2^120),
// the key tiles (dense bfloat16 without a vector gate: exact operands, only the stored pair)
// and float32 inputs must be no worse than single bfloat16 (2% for the noise of the other
// roundings), and all within the reference's tolerance.
TEST(CudaChunk, SplitAqkBringsTheOutputCloser) {
  FLASHDELTA_REQUIRE_GPU();
  struct SplitCase {
    std::string what;
    CaseConfig cfg;
    double most;  // the pair's error over single bfloat16's, at most
  };
  CaseConfig kda = gate_form_case(Mechanism::kda, 1, 1024, 6000);
  kda.B = 1;
  const std::vector<SplitCase> cases = {
      {"kda, fused transforms, lower bound, T = 1024", kda, 0.75},
      {"kda, precomputed gate, K = 64, varlen", {.T = 267, .HV = 2, .K = 64, .V = 64,
                                                 .dtype = DType::bf16,
                                                 .seqlens = {0, 1, 130, 64, 65, 7},
                                                 .qk_l2norm = true, .seed = 6001}, 1.02},
      {"kda, strong gates", {.T = 150, .K = 128, .V = 64, .dtype = DType::bf16,
                             .gate_min = -12.0, .seed = 6004}, 1.02},
      {"gated deltanet (key tiles)", gate_form_case(Mechanism::gated_deltanet, 1, 300, 6002),
       1.02},
      {"deltanet, K = 256, float32", {.mechanism = Mechanism::deltanet, .T = 130, .K = 256,
                                      .V = 120, .dtype = DType::f32, .qk_l2norm = true,
                                      .seed = 6003}, 1.02},
  };
  for (const auto& [what, cfg, most] : cases) {
    const Case c = make_case(cfg);
    const Outputs ref = run_reference(c);
    for (const char* products : {static_cast<const char*>(nullptr), "mma_sync"}) {
      const ScopedEnv state_products(kStateProducts, products);
      const std::string label = what + (products ? ", mma.sync" : "");
      Outputs pair, single;
      {
        const ScopedEnv set(kAqk, "split");
        pair = run_cuda(c, DType::f32, kChunk);
      }
      {
        const ScopedEnv automatic(kAqk, nullptr);
        single = run_cuda(c, DType::f32, kChunk);
      }
      const double e_pair = rel_error(pair.o, ref.o), e_single = rel_error(single.o, ref.o);
      std::printf("  %s: output error %.3e with the pair, %.3e single\n", label.c_str(), e_pair,
                  e_single);
      const double tol = cuda_tolerance(cfg.dtype, kChunk);
      EXPECT_LT(e_pair, tol) << label;
      EXPECT_LT(e_single, tol) << label;
      EXPECT_LT(rel_error(pair.state, ref.state), tol) << label << ": final state";
      EXPECT_LE(e_pair, most * e_single) << label;
    }
  }
}

// One case with A_qk in float16 and in bfloat16 (FLASHDELTA_CHUNK_AQK_DTYPE), float32 output:
// both within the reference's tolerance (the float16 run's final state too) and the float16
// run's output error at most `most` of the bfloat16 run's; the two runs' outputs returned.
std::pair<Outputs, Outputs> expect_f16_aqk_closer(const Case& c, const Outputs& ref,
                                                  const std::string& label, double most) {
  Outputs f16, bf16;
  {
    const ScopedEnv set(kAqkDtype, "f16");
    f16 = run_cuda(c, DType::f32, kChunk);
  }
  {
    const ScopedEnv set(kAqkDtype, "bf16");
    bf16 = run_cuda(c, DType::f32, kChunk);
  }
  const double e_f16 = rel_error(f16.o, ref.o), e_bf16 = rel_error(bf16.o, ref.o);
  std::printf("  %s: output error %.3e with float16 A_qk, %.3e with bfloat16\n", label.c_str(),
              e_f16, e_bf16);
  const double tol = cuda_tolerance(c.cfg.dtype, kChunk);
  EXPECT_LT(e_f16, tol) << label;
  EXPECT_LT(e_bf16, tol) << label;
  EXPECT_LT(rel_error(f16.state, ref.state), tol) << label << ": final state";
  EXPECT_LE(e_f16, most * e_bf16) << label;
  return {f16, bf16};
}

// A_qk in float16 and A_qk v_new on float16 operands (FLASHDELTA_CHUNK_AQK_DTYPE=f16,
// ChunkParams::aqk_f16) against bfloat16, single and as the pair (FLASHDELTA_CHUNK_AQK=split):
// three more mantissa bits for two of the output's bfloat16-sized roundings. In the rounding
// model (bench/NOTES.md (cc), KDA with the gate activated in the kernel and dense bfloat16
// inputs, float32 output) single bfloat16 3.74e-3 -> 2.90e-3 (0.78) and the pair 2.37e-3 ->
// 1.70e-3 (0.72); a v_new or A_qk read with the wrong type or scale would move the output away
// instead. Asked: 0.85 of the bfloat16 form's error, on both state products (wgmma, mma.sync),
// and within the reference's tolerance. Where the host cannot bound A_qk (no L2 norm, a
// precomputed gate) the setting changes nothing: bitwise the bfloat16 run.
TEST(CudaChunk, F16AqkBringsTheOutputCloser) {
  FLASHDELTA_REQUIRE_GPU();
  CaseConfig kda = gate_form_case(Mechanism::kda, 1, 1024, 6100);
  kda.B = 1;
  const Case c = make_case(kda);
  const Outputs ref = run_reference(c);
  for (const char* products : {static_cast<const char*>(nullptr), "mma_sync"}) {
    const ScopedEnv state_products(kStateProducts, products);
    for (const char* pair : {"bf16", "split"}) {
      const ScopedEnv aqk(kAqk, pair);
      const std::string label =
          std::string(pair) + (products ? ", mma.sync" : ", default products");
      expect_f16_aqk_closer(c, ref, label, 0.85);
    }
  }
  CaseConfig large_scale = gate_form_case(Mechanism::kda, 1, 150, 6103);
  large_scale.scale = 0x1p13;
  CaseConfig small_scale = gate_form_case(Mechanism::kda, 2, 150, 6104);
  small_scale.scale = 0x1p-9;
  const std::vector<std::pair<std::string, CaseConfig>> unbounded = {
      {"kda, precomputed gate", {.T = 150, .HV = 2, .K = 128, .V = 64, .dtype = DType::bf16,
                                 .qk_l2norm = true, .seed = 6101}},
      {"kda, gate in the kernel, no L2 norm",
       {.T = 150, .HV = 2, .K = 128, .V = 64, .dtype = DType::bf16, .gate_in_kernel = true,
        .lower_bound = -5.0, .seed = 6102}},
      {"kda, scale 2^13", large_scale},
      {"kda, scale 2^-9", small_scale},
      {"deltanet, K = 256", {.mechanism = Mechanism::deltanet, .T = 130, .K = 256, .V = 120,
                             .dtype = DType::bf16, .qk_l2norm = true, .seed = 6105}},
  };
  for (const auto& [what, cfg] : unbounded) {
    const Case u = make_case(cfg);
    HostTensor o1 = u.make_output(DType::f32), s1 = u.make_state();
    HostTensor o2 = u.make_output(DType::f32), s2 = u.make_state();
    {
      const ScopedEnv set(kAqkDtype, "f16");
      forward_on_device(u.args(o1, &s1), u.options, kChunk);
    }
    {
      const ScopedEnv set(kAqkDtype, "bf16");
      forward_on_device(u.args(o2, &s2), u.options, kChunk);
    }
    EXPECT_EQ(o1.bytes, o2.bytes) << what;
    EXPECT_EQ(s1.bytes, s2.bytes) << what;
  }
}

// The float16 form wherever it applies beside the first test's case: K = 64 with varlen
// (empty, one-token and partial chunks) in both state layouts, the key tiles (a scalar gate
// activated in the kernel, and no gate: A_qk's rows from the tokens' n_q), GVA. Each within
// the reference's tolerance, no worse than bfloat16 (2% for the other roundings' noise), and
// not bitwise bfloat16's (the form ran); both state products.
TEST(CudaChunk, F16AqkMatchesTheReferenceWhereItApplies) {
  FLASHDELTA_REQUIRE_GPU();
  CaseConfig k64 = gate_form_case(Mechanism::kda, 1, 267, 6120);
  k64.B = 1;
  k64.K = k64.V = 64;
  k64.seqlens = {0, 1, 130, 64, 65, 7};
  CaseConfig k64_vf = gate_form_case(Mechanism::kda, 0, 200, 6121);
  k64_vf.K = k64_vf.V = 64;
  CaseConfig gdn = gate_form_case(Mechanism::gated_deltanet, 1, 300, 6122);
  gdn.H = 1;
  const CaseConfig deltanet{.mechanism = Mechanism::deltanet, .B = 2, .T = 150, .H = 2,
                            .HV = 4, .K = 128, .V = 96, .dtype = DType::bf16,
                            .qk_l2norm = true, .beta_sigmoid = true, .seed = 6123};
  const std::vector<std::pair<std::string, CaseConfig>> cases = {
      {"kda, K = 64, varlen", k64},
      {"kda, K = 64, V-first, no lower bound", k64_vf},
      {"gated deltanet, gate in the kernel, GVA (key tiles)", gdn},
      {"deltanet, no gate, V = 96 (key tiles)", deltanet},
  };
  for (const auto& [what, cfg] : cases) {
    const Case c = make_case(cfg);
    const Outputs ref = run_reference(c);
    for (const char* products : {static_cast<const char*>(nullptr), "mma_sync"}) {
      const ScopedEnv state_products(kStateProducts, products);
      const std::string label = what + (products ? ", mma.sync" : "");
      const auto [f16, bf16] = expect_f16_aqk_closer(c, ref, label, 1.02);
      EXPECT_NE(f16.o, bf16.o) << label << ": the float16 form did not run";
    }
  }
}

// The float16 form scales each row of v_new^T by a power of two from its own magnitude
// (ChunkParams::aqk_f16), so the forward stays linear in (v, initial state) to float32
// rounding: with both times 2^40 or 2^-40 (exact in bfloat16 and float32) the outputs and the
// final state are the unscaled run's times the same factor, where a fixed float16 scale
// would overflow (o infinite) or flush v_new to zero and subnormals. Both state products.
TEST(CudaChunk, F16AqkScalesWithTheValues) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv set(kAqkDtype, "f16");
  CaseConfig cfg = gate_form_case(Mechanism::kda, 1, 200, 6110);
  cfg.B = 1;
  const Case base = make_case(cfg);
  for (const char* products : {static_cast<const char*>(nullptr), "mma_sync"}) {
    const ScopedEnv state_products(kStateProducts, products);
    const Outputs unscaled = run_cuda(base, DType::f32, kChunk);
    for (const int exponent : {40, -40}) {
      const double factor = std::ldexp(1.0, exponent);
      Case c = base;
      for (HostTensor* t : {&c.v, &c.initial_state}) {
        std::vector<double> x = t->to_double();
        for (double& e : x) e *= factor;
        t->set(x);
      }
      const Outputs scaled = run_cuda(c, DType::f32, kChunk);
      std::vector<double> o = unscaled.o, state = unscaled.state;
      for (double& e : o) e *= factor;
      for (double& e : state) e *= factor;
      const std::string label = "2^" + std::to_string(exponent) + (products ? ", mma.sync" : "");
      EXPECT_LT(rel_error(scaled.o, o), 1e-5) << label;
      EXPECT_LT(rel_error(scaled.state, state), 1e-5) << label << ": final state";
    }
  }
}

// The prepare kernel's paths for dense bfloat16 inputs (contiguous q, k, v and vector gate, K and V
// multiples of 8, as in every case here; a precomputed gate is float32 in these cases, so the
// vector-gate ones compute theirs in the kernel) against its general ones, which every input layout
// takes (FLASHDELTA_CHUNK_TOKEN_RUNS=general). Without the delta rule the two compute the same sums
// in the same order, so outputs and states are bitwise equal where no L2 norm sums squares in
// another order. With the delta rule the dense path rounds w's and u's operands differently (k and
// v as given, exact, and T diag(n_k beta 2^Gamma) and T diag(beta) rounded once, against beta k
// 2^Gamma, beta v, T diag(n_k) and T rounded once each); where v_new = u - w S cancels, that moves
// outputs by ~2e-3 (measured, K = 256), so there the paths agree to 5e-3 (a misread fragment is an
// error of order 1) and the dense path must be about as close to the fp64 reference as the general
// one. Every gate form, K = 64, 128, 256 and K = 40 (tiles padded past K), V over one and two
// batches of value tiles, fused transforms, gates down to -1000 per step, varlen with partial
// chunks, GVA. Each path is checked against the reference. Both keep qg, kg and u in the
// records (FLASHDELTA_CHUNK_RECORDS=full): the state kernel's reading of q, k and v as given,
// which only the dense path allows, rounds differently again (TokenOperandsAndRecordsAgree).
TEST(CudaChunk, DenseAndGeneralPathsAgree) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv records(kRecords, "full");
  struct PathCase {
    std::string what;
    CaseConfig cfg;
    bool bitwise;
  };
  const std::vector<PathCase> cases = {
      {"kda, fused transforms, lower bound", gate_form_case(Mechanism::kda, 1, 150, 5600), false},
      {"kda, K = 64, V = 200, varlen", {.T = 267, .HV = 2, .K = 64, .V = 200,
                                        .dtype = DType::bf16, .seqlens = {0, 1, 130, 64, 65, 7},
                                        .gate_in_kernel = true, .seed = 5601}, false},
      {"gla, varlen", {.mechanism = Mechanism::gla, .T = 267, .HV = 4, .K = 128, .V = 128,
                       .dtype = DType::bf16, .seqlens = {0, 1, 130, 64, 65, 7},
                       .gate_in_kernel = true, .seed = 5602}, true},
      {"gla, K = 256, V = 120", {.mechanism = Mechanism::gla, .T = 70, .K = 256, .V = 120,
                                 .dtype = DType::bf16, .gate_in_kernel = true, .seed = 5603},
       true},
      {"gated deltanet, fused transforms, lower bound",
       gate_form_case(Mechanism::gated_deltanet, 1, 150, 5604), false},
      {"gated deltanet, K = V = 64, varlen", {.mechanism = Mechanism::gated_deltanet, .T = 267,
                                              .HV = 4, .K = 64, .V = 64, .dtype = DType::bf16,
                                              .seqlens = {0, 1, 130, 64, 65, 7}, .seed = 5605},
       false},
      {"gated deltanet, K = 40, V = 96, GVA", {.mechanism = Mechanism::gated_deltanet, .T = 200,
                                               .H = 1, .HV = 2, .K = 40, .V = 96,
                                               .dtype = DType::bf16, .qk_l2norm = true,
                                               .seed = 5606}, false},
      {"deltanet, K = 256, V = 120", {.mechanism = Mechanism::deltanet, .T = 130, .K = 256,
                                      .V = 120, .dtype = DType::bf16, .qk_l2norm = true,
                                      .seed = 5607}, false},
      {"simple gla, gates to -1000", {.mechanism = Mechanism::simple_gla, .T = 150, .K = 128,
                                      .V = 64, .dtype = DType::bf16, .gate_min = -1000.0,
                                      .seed = 5608}, true},
      {"linear attention, K = 40", {.mechanism = Mechanism::linear_attention, .T = 100,
                                    .HV = 2, .K = 40, .V = 64, .dtype = DType::bf16,
                                    .seed = 5609}, true},
  };
  for (const auto& [what, cfg, bitwise] : cases) {
    const Case c = make_case(cfg);
    const auto [dense, general] =
        run_default_and_forced(c, what, kTokenRuns, {"dense", "general"}, "general");
    if (bitwise) {
      EXPECT_EQ(dense.o, general.o) << what << ": outputs";
      EXPECT_EQ(dense.state, general.state) << what << ": final states";
      EXPECT_EQ(dense.chunks, general.chunks) << what << ": chunk states";
      continue;
    }
    expect_runs_close(dense, general, 5e-3, what);
    expect_about_as_accurate(c, dense, general, what, {"the dense path", "the general path"});
  }
}

// With dense bfloat16 inputs the state kernel reads v as given and takes u = T diag(beta) v
// itself, for every gate form (ChunkParams::v_from_tokens), and without a vector gate also q
// and k, applying the gate's per-token factors itself (qk_from_tokens): the default, also
// named FLASHDELTA_CHUNK_RECORDS=operands; with `qk` the records keep u, with `full` also qg
// and kg. The forms round differently (qg, kg and u in bfloat16 against q, k,
// v as given with float32 factors and u in float32; A_qk with or without n_q on its rows), so
// they agree to far below the reference's tolerance, not bitwise; a misread token row or a
// factor applied twice would be an error of order 1. Every form is checked against the
// reference, and the operands as given must be about as accurate. Both gate forms and none,
// fused transforms, gates to -1000, K = 40, 64, 128 and 256 (tiles padded past K), V over
// several tiles with a partial last one, varlen with empty, one-token and partial chunks,
// GVA, the linear write, 3 segments (the maps read k, the segments' value blocks v), both
// state layouts. The fused cases again with the default (bitwise the same as `operands`), with
// the operands on mma.sync and with one record stage (bitwise the same as two), Gated
// DeltaNet's with `qk` (for KDA that is the full records).
TEST(CudaChunk, TokenOperandsAndRecordsAgree) {
  FLASHDELTA_REQUIRE_GPU();
  std::vector<std::pair<std::string, CaseConfig>> cases = {
      {"kda, fused transforms, lower bound", gate_form_case(Mechanism::kda, 1, 150, 6000)},
      {"kda, K = 64, V = 200, varlen", {.T = 267, .HV = 2, .K = 64, .V = 200,
                                        .dtype = DType::bf16, .seqlens = {0, 1, 130, 64, 65, 7},
                                        .gate_in_kernel = true, .seed = 6001}},
      {"gla, K = 256, V = 120", {.mechanism = Mechanism::gla, .T = 70, .K = 256, .V = 120,
                                 .dtype = DType::bf16, .gate_in_kernel = true, .seed = 6002}},
      {"gated deltanet, fused transforms, lower bound",
       gate_form_case(Mechanism::gated_deltanet, 1, 150, 6003)},
      {"gated deltanet, K = V = 64, varlen", {.mechanism = Mechanism::gated_deltanet, .T = 267,
                                              .HV = 4, .K = 64, .V = 64, .dtype = DType::bf16,
                                              .seqlens = {0, 1, 130, 64, 65, 7}, .seed = 6004}},
      {"gated deltanet, K = 40, V = 96, GVA", {.mechanism = Mechanism::gated_deltanet, .T = 200,
                                               .H = 1, .HV = 2, .K = 40, .V = 96,
                                               .dtype = DType::bf16, .qk_l2norm = true,
                                               .seed = 6005}},
      {"deltanet, K = 256, V = 120", {.mechanism = Mechanism::deltanet, .T = 130, .K = 256,
                                      .V = 120, .dtype = DType::bf16, .qk_l2norm = true,
                                      .seed = 6006}},
      {"simple gla, gates to -1000", {.mechanism = Mechanism::simple_gla, .T = 150, .K = 128,
                                      .V = 64, .dtype = DType::bf16, .gate_min = -1000.0,
                                      .seed = 6007}},
      {"linear attention, K = 40", {.mechanism = Mechanism::linear_attention, .T = 100,
                                    .HV = 2, .K = 40, .V = 64, .dtype = DType::bf16,
                                    .seed = 6008}},
      {"gated deltanet, 3 segments", {.mechanism = Mechanism::gated_deltanet, .T = 700, .H = 2,
                                      .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
                                      .layout = StateLayout::v_first, .qk_l2norm = true,
                                      .gate_min = -0.05, .seed = 6009}},
      {"kda, 3 segments", {.T = 700, .H = 2, .HV = 4, .K = 128, .V = 128, .dtype = DType::bf16,
                           .qk_l2norm = true, .gate_in_kernel = true, .seed = 6010}},
  };
  auto run = [](const Case& c, const std::string& what, const char* records) {
    return run_with_setting(c, what, kRecords, records,
                            std::string("records ") + (records ? records : "auto"));
  };
  for (const auto& [what, cfg] : cases) {
    const ScopedEnv split(kSegments, what.find("segments") != std::string::npos ? "3" : nullptr);
    const Case c = make_case(cfg);
    const ChunkStatesRun operands = run(c, what, "operands"), full = run(c, what, "full");
    expect_runs_close(operands, full, 5e-3, what);
    expect_about_as_accurate(c, operands, full, what, {"the operands as given", "the records"});
    if (what.find("fused") == std::string::npos) continue;
    EXPECT_EQ(run(c, what, nullptr).o, operands.o) << what << ": the default against operands";
    if (cfg.mechanism == Mechanism::gated_deltanet)
      expect_runs_close(run(c, what, "qk"), full, 5e-3, what + ", records qk");
    const ScopedEnv set(kRecords, "operands");
    ChunkStatesRun one_stage, mma_sync;
    {
      const ScopedEnv one(kStateStages, "1");
      one_stage = run_with_chunk_states(c, DType::f32, kChunk);
    }
    {
      const ScopedEnv two(kStateStages, "2");
      EXPECT_EQ(run_with_chunk_states(c, DType::f32, kChunk).o, one_stage.o)
          << what << ": outputs, one stage against two";
    }
    {
      const ScopedEnv forced(kStateProducts, "mma_sync");
      mma_sync = run_with_chunk_states(c, DType::f32, kChunk);
      expect_forward_matches_reference(c, what + ", token operands on mma.sync", kChunk);
    }
    expect_runs_close(one_stage, mma_sync, 1e-3, what + ", mma.sync");
  }
}

}  // namespace
}  // namespace flashdelta::testing
