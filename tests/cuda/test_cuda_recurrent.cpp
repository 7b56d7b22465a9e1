// The CUDA recurrent schedule (forward and serving decode) against the fp64 reference on
// random inputs. Skipped on machines without a GPU; run on the device by
// scripts/device-run.sh, also under compute-sanitizer.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda.h"
#include "cuda/device_mirror.h"
#include "cuda/forward_check.h"
#include "cuda/host_params.h"
#include "cuda/recurrent_params.h"
#include "decode_case.h"
#include "scoped_env.h"
#include "test_util.h"

namespace flashdelta::testing {
namespace {

// Every mechanism over shapes covering each K bucket of the kernel (32/64/128/256), odd
// sizes (partial vector runs, unaligned strides: the scalar path), GVA, both layouts and
// every input dtype.
std::vector<CaseConfig> forward_grid() {
  const StateLayout kf = StateLayout::k_first, vf = StateLayout::v_first;
  return mechanism_grid({
      {2, 1, 128, 128, 2, 4, kf, DType::f32, true},
      {2, 1, 128, 128, 2, 2, vf, DType::bf16, true},
      {2, 2, 64, 64, 1, 4, kf, DType::f16, true},
      {2, 4, 60, 100, 2, 4, vf, DType::f32, true},
      {2, 8, 17, 33, 1, 2, kf, DType::f32, false},
      {2, 8, 17, 33, 1, 2, vf, DType::f32, true},
      {2, 15, 256, 256, 1, 1, kf, DType::f32, true},
      {2, 16, 256, 200, 1, 2, vf, DType::bf16, true},
      {2, 17, 100, 60, 2, 2, kf, DType::f64, true},
      {2, 65, 16, 16, 2, 8, vf, DType::f32, true},
      {2, 1000, 32, 48, 1, 1, kf, DType::f32, true},
      {2, 3, 1, 1, 1, 1, kf, DType::f32, true},
  }, 100);
}

class CudaRecurrentGrid : public ::testing::TestWithParam<CaseConfig> {};

TEST_P(CudaRecurrentGrid, MatchesReference) {
  FLASHDELTA_REQUIRE_GPU();
  expect_forward_matches_reference(make_case(GetParam()), describe(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Forward, CudaRecurrentGrid, ::testing::ValuesIn(forward_grid()),
                         [](const auto& info) { return describe(info.param); });

TEST(CudaRecurrent, VarlenWithEmptyAndOneTokenSequences) {
  FLASHDELTA_REQUIRE_GPU();
  // V-first: the warp kernel (V = 96, six 16-column tasks at K = 64).
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::gla}) {
      const CaseConfig c{.mechanism = m, .T = 63, .H = 2, .HV = 4, .K = 64, .V = 96,
                         .seqlens = {0, 1, 17, 0, 5, 40}, .layout = layout};
      expect_forward_matches_reference(
          make_case(c), std::string("varlen ") + mechanism_name(m) +
                            (layout == StateLayout::v_first ? " v_first" : " k_first"));
    }
}

TEST(CudaRecurrent, FusedTransformsAndGateForms) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 300;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet})
    for (int form = 0; form < 4; ++form)
      expect_forward_matches_reference(
          make_case(gate_form_case(m, form, 9, seed++)),
          std::string(mechanism_name(m)) + " gate form " + std::to_string(form));
}

TEST(CudaRecurrent, StrongGatesAndBetaZeroOne) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 400;
  for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet, Mechanism::simple_gla}) {
    const CaseConfig c{.mechanism = m, .T = 30, .K = 64, .V = 64, .gate_min = -1000,
                       .seed = seed++};
    expect_forward_matches_reference(make_case(c), std::string("strong gates ") + mechanism_name(m));
    for (const double b : {0.0, 1.0}) {
      CaseConfig d = c;
      d.gate_min = -1;
      d.beta_value = b;
      if (traits(m).delta)
        expect_forward_matches_reference(make_case(d), "beta " + std::to_string(b));
    }
  }
}

TEST(CudaRecurrent, InPlaceAndWithoutFinalState) {
  FLASHDELTA_REQUIRE_GPU();
  const Case c = make_case({.B = 3, .T = 5, .K = 128, .V = 64});
  const Outputs ref = run_reference(c);

  HostTensor state = c.initial_state, o = c.make_output(DType::f32);
  ForwardArgs a = c.args(o, nullptr);
  a.initial_state = state.view;
  a.final_state = state.view;  // in place
  forward_on_device(a, c.options);
  EXPECT_LT(rel_error(o.to_double(), ref.o), 2e-4);
  EXPECT_LT(rel_error(state.to_double(), ref.state), 2e-4);

  HostTensor o2 = c.make_output(DType::f32);
  forward_on_device(c.args(o2, nullptr), c.options);
  EXPECT_LT(rel_error(o2.to_double(), ref.o), 2e-4);
}

TEST(CudaRecurrent, DeterministicBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  const Case c = make_case({.B = 4, .T = 33, .HV = 4, .K = 128, .V = 128});
  HostTensor o1 = c.make_output(DType::f32), s1 = c.make_state();
  HostTensor o2 = c.make_output(DType::f32), s2 = c.make_state();
  forward_on_device(c.args(o1, &s1), c.options);
  forward_on_device(c.args(o2, &s2), c.options);
  EXPECT_EQ(o1.bytes, o2.bytes);
  EXPECT_EQ(s1.bytes, s2.bytes);
}

// ---------------------------------------------------------------------------------------
// Serving

TEST(CudaDecode, InPlaceSlotsWithPaddingRows) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 1;
  for (const Mechanism m : kAllMechanisms)
    for (const int64_t T : {1, 2, 4, 8}) {
      const CaseConfig cfg = decode_config(m, 4, T, 128, 128, seed++);
      const DecodeCase d = make_decode_case(cfg, 9, DType::f32, {{7}, {-1}, {2}, {4}});
      expect_decode_matches_reference(
          d, std::string(mechanism_name(m)) + " T=" + std::to_string(T), decode_on_device);
    }
}

TEST(CudaDecode, PerTokenSlotsWithAcceptedTokens) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 50;
  // V = 72 is a partial block tile; V = 64 lets the warp kernel take the case too.
  for (const Mechanism m : {Mechanism::gla, Mechanism::gated_deltanet, Mechanism::kda})
    for (const int64_t T : {2, 4, 8})
      for (const int64_t V : {72, 64}) {
        CaseConfig cfg = decode_config(m, 3, T, 64, V, seed++);
        cfg.layout = T == 4 ? StateLayout::v_first : StateLayout::k_first;
        std::vector<std::vector<int64_t>> slots = {{0, 1, 2, 3}, {4, -1, 5, 6}, {-1, 7, 8, 9}};
        for (size_t r = 0; r < slots.size(); ++r)
          for (int64_t t = 4; t < T; ++t) slots[r].push_back(10 + static_cast<int64_t>(r) * 8 + t);
        const DecodeCase d = make_decode_case(cfg, 40, DType::f32, slots, {2, 1, 1});
        expect_decode_matches_reference(
            d, std::string(mechanism_name(m)) + " per-token T=" + std::to_string(T) +
                   " V=" + std::to_string(V),
            decode_on_device);
      }
}

TEST(CudaDecode, BFloat16PoolOddSizesBothLayouts) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 80;
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    for (const Mechanism m : {Mechanism::gated_deltanet, Mechanism::kda, Mechanism::simple_gla})
      for (const DType pool : {DType::f32, DType::bf16}) {
        CaseConfig cfg = decode_config(m, 3, 2, 33, 47, seed++);
        cfg.layout = layout;
        const DecodeCase d = make_decode_case(cfg, 6, pool, {{5}, {0}, {3}});
        expect_decode_matches_reference(
            d, std::string(mechanism_name(m)) + " pool " + dtype_name(pool) +
                   (layout == StateLayout::v_first ? " v_first" : " k_first"),
            decode_on_device);
      }
}

TEST(CudaDecode, VarlenRowsFusedTransformsBFloat16Inputs) {
  FLASHDELTA_REQUIRE_GPU();
  const DecodeCase d = varlen_fused_decode_case();
  expect_decode_matches_reference(d, "varlen kda bf16 inputs", decode_on_device);
}

TEST(CudaDecode, GroupedValueHeadsAndLargeHeads) {
  FLASHDELTA_REQUIRE_GPU();
  uint64_t seed = 120;
  for (const int64_t kv : {256, 100}) {
    CaseConfig cfg = decode_config(Mechanism::kda, 3, 1, kv, kv, seed++);
    cfg.H = 2;
    cfg.HV = 8;
    const DecodeCase d = make_decode_case(cfg, 5, DType::f32, {{4}, {1}, {2}});
    expect_decode_matches_reference(d, "gva K=V=" + std::to_string(kv), decode_on_device);
  }
}

// Device-resident indices are not read by the host: an out-of-range slot (or accepted
// count) makes the row a padding row instead of an out-of-bounds access.
TEST(CudaDecode, OutOfRangeDeviceIndicesArePaddingRows) {
  FLASHDELTA_REQUIRE_GPU();
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    CaseConfig cfg = decode_config(Mechanism::kda, 3, 2, 64, 64, 5);
    cfg.layout = layout;
    const DecodeCase d = make_decode_case(cfg, 3, DType::f32, {{-1}, {-1}, {-1}});
    HostTensor pool = d.pool, o = d.c.make_output(DType::f32);
    HostTensor idx(DType::i64, {3});
    const int64_t bad[3] = {3, 1000000, -7};
    std::memcpy(idx.bytes.data(), bad, sizeof bad);
    o.fill(kPoison);
    DecodeArgs a = d.args(o, pool);
    a.state_indices = idx.view;
    decode_on_device(a, d.c.options);
    for (const double x : o.to_double()) ASSERT_EQ(x, 0.0);
    EXPECT_EQ(pool.bytes, d.pool.bytes);
  }
}

// Every token-type instantiation on one layout: all-bfloat16 tokens (the compile-time bf16
// instantiation) and bf16 / f16 inputs with other output or gate dtypes (the runtime-dtype
// one); float32 and bfloat16 pools; padding rows; T = 1 and a 3-token step; each (K, V) of
// `shapes`.
void expect_token_types_match(StateLayout layout,
                              std::initializer_list<std::pair<int64_t, int64_t>> shapes,
                              uint64_t seed) {
  struct Tokens {
    const char* name;
    DType inputs, o;
    bool fused;  // gate, L2 norm and beta sigmoid in the kernel (g in the input dtype)
  };
  // "f32 gate, bf16 o": bfloat16 everywhere but g, which alone rules out the bf16 form.
  const Tokens kTokens[] = {{"bf16 fused, bf16 o", DType::bf16, DType::bf16, true},
                            {"bf16, f32 gate and o", DType::bf16, DType::f32, false},
                            {"bf16, f32 gate, bf16 o", DType::bf16, DType::bf16, false},
                            {"f16 fused, f16 o", DType::f16, DType::f16, true}};
  for (const auto& [K, V] : shapes)
    for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet})
      for (const Tokens& tokens : kTokens)
        for (const DType pool : {DType::f32, DType::bf16})
          for (const int64_t T : {1, 3}) {
            CaseConfig cfg = decode_config(m, 3, T, K, V, seed++);
            cfg.layout = layout;
            cfg.dtype = tokens.inputs;
            cfg.qk_l2norm = cfg.beta_sigmoid = cfg.gate_in_kernel = tokens.fused;
            if (tokens.fused && m == Mechanism::kda) cfg.lower_bound = -5.0;
            const DecodeCase d = make_decode_case(cfg, 5, pool, {{3}, {-1}, {0}});
            expect_decode_matches_reference(
                d,
                std::string(mechanism_name(m)) + " K=" + std::to_string(K) + " V=" +
                    std::to_string(V) + " T=" + std::to_string(T) + " " + tokens.name +
                    ", pool " + dtype_name(pool),
                decode_on_device, tokens.o);
          }
}

// The warp kernel on V-first pools: K = 32 (four column lanes per warp), 64, 128 and 256 (8
// keys per lane), each V a few tasks wide.
TEST(CudaDecode, WarpKernelShapesAndTokenTypes) {
  FLASHDELTA_REQUIRE_GPU();
  expect_token_types_match(StateLayout::v_first, {{32, 64}, {64, 48}, {128, 24}, {256, 40}}, 500);
}

// The narrow tile on K-first pools (its bfloat16-token instantiation at K = 128), forced:
// 16-column tiles at K = 64 and 128, V one tile, a tile and a half, two; at K = 32 and 256
// the narrow tile is the wide one.
TEST(CudaDecode, NarrowTileKFirstTokenTypes) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv env("FLASHDELTA_RECURRENT_TILE", "narrow");
  expect_token_types_match(StateLayout::k_first,
                           {{32, 48}, {64, 16}, {128, 24}, {128, 32}, {256, 40}}, 700);
}

// Decode case d (bfloat16 output) once under each value of the environment variable `name`:
// every run matches the reference, and all are bitwise equal (outputs and pools).
void expect_settings_agree_bitwise(const DecodeCase& d, const std::string& what, const char* name,
                                   std::initializer_list<const char*> values) {
  HostTensor first_pool, first_o;
  for (const char* value : values) {
    const ScopedEnv env(name, value);
    expect_decode_matches_reference(d, what + " " + value, decode_on_device, DType::bf16);
    HostTensor pool = d.pool, o = d.c.make_output(DType::bf16);
    decode_on_device(d.args(o, pool), d.c.options);
    if (first_o.bytes.empty()) {
      first_pool = pool, first_o = o;
      continue;
    }
    EXPECT_EQ(o.bytes, first_o.bytes) << what << " " << value;
    EXPECT_EQ(pool.bytes, first_pool.bytes) << what << " " << value;
  }
}

// The two grids: (value tiles, HV, N) with the task in the block index, and
// the grid-stride loop over task numbers that problems past 65,535 sequences or heads run
// (FLASHDELTA_RECURRENT_GRID=loop). Bitwise equal, and equal to the reference, with
// value-head groups of 1, 2 and 3 (the key head by a multiply-shift division), a padding
// row, one-token and 3-token steps: the warp kernel (V-first) and the narrow tile (K-first,
// bfloat16 tokens); the wide tile (forced), which loops under both settings, as a guard.
TEST(CudaDecode, GridFormsAgreeBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  struct Kernel {
    const char* name;
    StateLayout layout;
    const char* tile;
  };
  const Kernel kKernels[] = {{"warp", StateLayout::v_first, "auto"},
                             {"narrow", StateLayout::k_first, "narrow"},
                             {"wide", StateLayout::k_first, "wide"}};
  uint64_t seed = 900;
  for (const Kernel& kernel : kKernels) {
    const ScopedEnv env("FLASHDELTA_RECURRENT_TILE", kernel.tile);
    for (const int64_t group : {1, 2, 3})
      for (const int64_t T : {1, 3}) {
        CaseConfig cfg = decode_config(Mechanism::kda, 3, T, 128, 24, seed++);
        cfg.H = 2;
        cfg.HV = 2 * group;
        cfg.layout = kernel.layout;
        cfg.dtype = DType::bf16;
        cfg.qk_l2norm = cfg.beta_sigmoid = cfg.gate_in_kernel = true;
        const DecodeCase d = make_decode_case(cfg, 5, DType::f32, {{3}, {-1}, {0}});
        expect_settings_agree_bitwise(d,
                                      std::string(kernel.name) + " group " +
                                          std::to_string(group) + " T=" + std::to_string(T),
                                      "FLASHDELTA_RECURRENT_GRID", {"auto", "loop"});
      }
  }
}

// The warp kernel's prefetch blocks, which queue a later row's states into L2
// (FLASHDELTA_RECURRENT_WARP_PREFETCH): a hint, so `off`, `half`, `one` and `double` are
// bitwise equal and match the reference. More tasks than two waves of a 132-SM GPU hold
// (160 rows x 8 heads x 8 tiles = 10,240; 25, 50 and 99 rows ahead), rows on shuffled slots
// with padding rows among them (a prefetch block whose later row is one prefetches nothing),
// float32 and bfloat16 pools, one-token and 3-token steps. A prefetch neither changes
// results nor faults: the distances are the host test's (RecurrentPrefetchRows).
TEST(CudaDecode, WarpKernelPrefetchFormsAgreeBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  constexpr int64_t kRows = 160, kSlots = 170;
  std::vector<std::vector<int64_t>> slots;
  for (int64_t n = 0; n < kRows; ++n) slots.push_back({n % 17 == 5 ? -1 : (n * 37 + 11) % kSlots});
  uint64_t seed = 980;
  for (const DType pool : {DType::f32, DType::bf16})
    for (const int64_t T : {1, 3}) {
      CaseConfig cfg = decode_config(Mechanism::kda, kRows, T, 128, 64, seed++);
      cfg.H = 4;
      cfg.HV = 8;
      cfg.layout = StateLayout::v_first;
      cfg.dtype = DType::bf16;
      cfg.qk_l2norm = cfg.beta_sigmoid = cfg.gate_in_kernel = true;
      const DecodeCase d = make_decode_case(cfg, kSlots, pool, slots);
      expect_settings_agree_bitwise(
          d, std::string("pool ") + dtype_name(pool) + " T=" + std::to_string(T),
          "FLASHDELTA_RECURRENT_WARP_PREFETCH", {"off", "half", "one", "double"});
    }
}

// The warp kernel at K = 128 with 8 keys per lane (FLASHDELTA_RECURRENT_WARP_KEYS=8:
// 16-column tasks, the K = 256 kernel's lane shape) against the reference: V two and three
// tasks wide, all-bf16 fused tokens and float32 inputs, float32 and bfloat16 pools, a
// padding row, one-token and 3-token steps.
TEST(CudaDecode, WarpKernelEightKeysPerLane) {
  FLASHDELTA_REQUIRE_GPU();
  const ScopedEnv env("FLASHDELTA_RECURRENT_WARP_KEYS", "8");
  uint64_t seed = 950;
  for (const int64_t V : {32, 48})
    for (const Mechanism m : {Mechanism::kda, Mechanism::gated_deltanet})
      for (const bool bf16_tokens : {true, false})
        for (const DType pool : {DType::f32, DType::bf16})
          for (const int64_t T : {1, 3}) {
            CaseConfig cfg = decode_config(m, 3, T, 128, V, seed++);
            cfg.layout = StateLayout::v_first;
            if (bf16_tokens) {
              cfg.dtype = DType::bf16;
              cfg.qk_l2norm = cfg.beta_sigmoid = cfg.gate_in_kernel = true;
            }
            const DecodeCase d = make_decode_case(cfg, 5, pool, {{3}, {-1}, {0}});
            expect_decode_matches_reference(
                d,
                std::string(mechanism_name(m)) + " V=" + std::to_string(V) + " T=" +
                    std::to_string(T) + (bf16_tokens ? " bf16 fused" : " f32") + ", pool " +
                    dtype_name(pool),
                decode_on_device, bf16_tokens ? DType::bf16 : DType::f32);
          }
}

TEST(CudaDecode, DeterministicBitwise) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig cfg = decode_config(Mechanism::kda, 4, 2, 128, 128, 7);
  const DecodeCase d = make_decode_case(cfg, 4, DType::f32, {{0}, {1}, {2}, {3}});
  HostTensor pool_a = d.pool, pool_b = d.pool;
  HostTensor o_a = d.c.make_output(DType::f32), o_b = d.c.make_output(DType::f32);
  decode_on_device(d.args(o_a, pool_a), d.c.options);
  decode_on_device(d.args(o_b, pool_b), d.c.options);
  EXPECT_EQ(o_a.bytes, o_b.bytes);
  EXPECT_EQ(pool_a.bytes, pool_b.bytes);
}

// A decode step captured in a CUDA graph and replayed twice equals two reference steps:
// the call neither synchronises nor reads device memory on the host.
TEST(CudaDecode, CapturedInCudaGraph) {
  FLASHDELTA_REQUIRE_GPU();
  const CaseConfig cfg = decode_config(Mechanism::kda, 2, 1, 128, 128, 11);
  const DecodeCase d = make_decode_case(cfg, 2, DType::f32, {{1}, {0}});
  HostTensor ref_pool = d.pool, ref_o = d.c.make_output(DType::f64);
  decode(d.args(ref_o, ref_pool), d.c.options, Schedule::reference);
  decode(d.args(ref_o, ref_pool), d.c.options, Schedule::reference);

  HostTensor pool = d.pool, o = d.c.make_output(DType::f32);
  cli::DeviceDecode device(d.args(o, pool));
  DecodeArgs& a = device.args;
  DeviceMirror& m = device.mirror;
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  a.stream = stream;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  decode(a, d.c.options, Schedule::recurrent);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check_cuda(cudaGraphLaunch(exec, stream), "replay 1");
  check_cuda(cudaGraphLaunch(exec, stream), "replay 2");
  check_cuda(cudaStreamSynchronize(stream), "sync");
  m.download(a.o, o.view);
  m.download(a.state_pool, pool.view);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  EXPECT_LT(rel_error(o.to_double(), ref_o.to_double()), 2e-4);
  EXPECT_LT(rel_error(pool.to_double(), ref_pool.to_double()), 2e-4);
}

// A decode step on two rows whose slots sit at the far end of a pool of more than 2^31
// elements (64-bit slot offsets), against the reference on the same two slots.
void expect_far_pool_slots_match_reference(StateLayout layout) {
  CaseConfig cfg = decode_config(Mechanism::gated_deltanet, 2, 1, 128, 128, 13);
  cfg.layout = layout;
  const DecodeCase d = make_decode_case(cfg, 2, DType::bf16, {{0}, {1}});
  HostTensor ref_pool = d.pool, ref_o = d.c.make_output(DType::f64);
  decode(d.args(ref_o, ref_pool), d.c.options, Schedule::reference);

  const int64_t slot_elems = cfg.HV * cfg.K * cfg.V;  // 65536
  const int64_t P = (int64_t{1} << 31) / slot_elems + 3;
  HostTensor pool = d.pool, o = d.c.make_output(DType::f32);
  cli::DeviceDecode device(d.args(o, pool));  // the pool and indices are replaced below
  DecodeArgs& a = device.args;
  DeviceMirror& m = device.mirror;
  a.state_pool.shape[0] = P;
  a.state_pool.data = m.allocate(static_cast<size_t>(P * slot_elems * 2));
  const size_t slot_bytes = static_cast<size_t>(slot_elems * 2);
  auto* base = static_cast<unsigned char*>(a.state_pool.data);
  // Host slot 0 -> device slot P - 1, host slot 1 -> device slot P - 2.
  check_cuda(cudaMemcpy(base + (P - 1) * slot_bytes, pool.bytes.data(), slot_bytes,
                        cudaMemcpyHostToDevice), "slot");
  check_cuda(cudaMemcpy(base + (P - 2) * slot_bytes, pool.bytes.data() + slot_bytes, slot_bytes,
                        cudaMemcpyHostToDevice), "slot");
  HostTensor idx(DType::i64, {2});
  const int64_t slots[2] = {P - 1, P - 2};
  std::memcpy(idx.bytes.data(), slots, sizeof slots);
  a.state_indices = m.upload(idx.view);
  decode(a, d.c.options, Schedule::recurrent);
  check_cuda(cudaDeviceSynchronize(), "decode");
  m.download(a.o, o.view);
  check_cuda(cudaMemcpy(pool.bytes.data(), base + (P - 1) * slot_bytes, slot_bytes,
                        cudaMemcpyDeviceToHost), "slot");
  check_cuda(cudaMemcpy(pool.bytes.data() + slot_bytes, base + (P - 2) * slot_bytes, slot_bytes,
                        cudaMemcpyDeviceToHost), "slot");
  EXPECT_LT(rel_error(o.to_double(), ref_o.to_double()), 1e-2);
  EXPECT_LT(rel_error(pool.to_double(), ref_pool.to_double()), 1e-2);
}

// 64-bit addressing: a pool of more than 2^31 elements (rows at its far end) and a launch
// of more than 65,535 blocks.
TEST(CudaDecode, PoolBeyond2To31ElementsAndManyBlocks) {
  FLASHDELTA_REQUIRE_GPU();
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    expect_far_pool_slots_match_reference(layout);

  // 1100 rows x 64 heads x 1 tile = 70,400 blocks.
  CaseConfig wide = decode_config(Mechanism::kda, 1100, 1, 16, 16, 17);
  wide.H = 16;
  wide.HV = 64;
  std::vector<std::vector<int64_t>> rows;
  for (int64_t n = 0; n < 1100; ++n) rows.push_back({n});
  const DecodeCase w = make_decode_case(wide, 1100, DType::f32, rows);
  expect_decode_matches_reference(w, "70,400 blocks", decode_on_device);
}

// The kernel choice (host only): under `auto` the warp kernel wherever it takes the
// problem, else the narrow tile below one wide block per SM; `warp` the same.
TEST(CudaRecurrentTile, FollowsTheEnvironmentVariable) {
  using detail::RecurrentKernel;
  using detail::cuda_recurrent_kernel;
  constexpr const char* kTile = "FLASHDELTA_RECURRENT_TILE";
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto", "warp"}) {
    const ScopedEnv env(kTile, automatic);
    EXPECT_EQ(cuda_recurrent_kernel(64, 132, 1024), RecurrentKernel::warp);
    EXPECT_EQ(cuda_recurrent_kernel(100000, 132, 1 << 20), RecurrentKernel::warp);
    EXPECT_EQ(cuda_recurrent_kernel(64, 132, 0), RecurrentKernel::narrow);
    EXPECT_EQ(cuda_recurrent_kernel(131, 132, 0), RecurrentKernel::narrow);
    EXPECT_EQ(cuda_recurrent_kernel(132, 132, 0), RecurrentKernel::wide);
    EXPECT_EQ(cuda_recurrent_kernel(2048, 132, 0), RecurrentKernel::wide);
  }
  for (const int64_t blocks : {1, 100000})
    for (const int64_t tasks : {int64_t{0}, int64_t{16}, int64_t{1} << 20}) {
      {
        const ScopedEnv env(kTile, "wide");
        EXPECT_EQ(cuda_recurrent_kernel(blocks, 132, tasks), RecurrentKernel::wide);
      }
      const ScopedEnv env(kTile, "narrow");
      EXPECT_EQ(cuda_recurrent_kernel(blocks, 132, tasks), RecurrentKernel::narrow);
    }
  expect_setting_rejected(kTile, "Narrow", [] { cuda_recurrent_kernel(64, 132, 0); });
}

// The multiply-shift division the kernels use for the key head of a value head (host
// only): every numerator below 4,096 for divisors 1-300, and numerators near 2^31 for
// divisors across the 32-bit range.
TEST(CudaFastDivisor, MatchesIntegerDivision) {
  using detail::cuda::fast_divide;
  using detail::cuda::make_fast_divisor;
  for (uint32_t d = 1; d <= 300; ++d) {
    const auto f = make_fast_divisor(d);
    for (uint32_t n = 0; n < 4096; ++n) ASSERT_EQ(fast_divide(n, f), n / d) << n << " / " << d;
  }
  const uint32_t kNear = (uint32_t{1} << 31) - 1;
  for (const uint32_t d : {1u, 2u, 3u, 7u, 641u, 65535u, 65536u, 1000003u, kNear - 1, kNear}) {
    const auto f = make_fast_divisor(d);
    for (uint32_t n = kNear - 5000; n < kNear; ++n)
      ASSERT_EQ(fast_divide(n, f), n / d) << n << " / " << d;
    for (uint32_t k = 0; k < 1000; ++k) {  // around multiples of d
      const uint64_t m = static_cast<uint64_t>(d) * (k * 2654435761u % (kNear / d + 1));
      for (const uint64_t n : {m, m + 1, m == 0 ? 0 : m - 1})
        if (n <= kNear) {
          ASSERT_EQ(fast_divide(static_cast<uint32_t>(n), f), n / d) << n << " / " << d;
        }
    }
  }
}

// The kernels' grid (host only): the task grid where N and HV fit a grid dimension,
// the loop otherwise or under `loop`.
TEST(CudaRecurrentTile, TaskGridFollowsTheEnvironmentVariable) {
  using detail::cuda_recurrent_task_grid;
  constexpr const char* kGrid = "FLASHDELTA_RECURRENT_GRID";
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv env(kGrid, automatic);
    EXPECT_TRUE(cuda_recurrent_task_grid(1, 1));
    EXPECT_TRUE(cuda_recurrent_task_grid(65535, 65535));
    EXPECT_FALSE(cuda_recurrent_task_grid(65536, 32));
    EXPECT_FALSE(cuda_recurrent_task_grid(4, 65536));
  }
  {
    const ScopedEnv env(kGrid, "loop");
    EXPECT_FALSE(cuda_recurrent_task_grid(256, 32));
  }
  expect_setting_rejected(kGrid, "grid", [] { cuda_recurrent_task_grid(256, 32); });
}

// The warp kernel's prefetch distance in rows (host only): the GPU test's 25, 50 and 99 rows
// on 132 SMs at 24 blocks each, at least one row, none past the last row or when off.
TEST(CudaRecurrentTile, RecurrentPrefetchRows) {
  using detail::cuda::recurrent_prefetch_rows;
  EXPECT_EQ(recurrent_prefetch_rows(4, 132, 24, 64, 160), 25);
  EXPECT_EQ(recurrent_prefetch_rows(8, 132, 24, 64, 160), 50);
  EXPECT_EQ(recurrent_prefetch_rows(16, 132, 24, 64, 160), 99);
  EXPECT_EQ(recurrent_prefetch_rows(4, 132, 24, 32 * 16, 256), 3);  // N = 256, HV = 32, V = 128
  EXPECT_EQ(recurrent_prefetch_rows(2, 132, 24, 1 << 20, 256), 1);   // at least one row
  EXPECT_EQ(recurrent_prefetch_rows(4, 132, 24, 64, 25), 0);         // none that far ahead
  EXPECT_EQ(recurrent_prefetch_rows(4, 132, 24, 64, 26), 25);
  EXPECT_EQ(recurrent_prefetch_rows(0, 132, 24, 64, 160), 0);        // off
  EXPECT_EQ(recurrent_prefetch_rows(4, 132, 24, 32 * 16, 1), 0);    // N = 1
}

// The warp kernel's prefetch distance in eighths of a resident wave (host only).
TEST(CudaRecurrentTile, WarpPrefetchFollowsTheEnvironmentVariable) {
  using detail::cuda_recurrent_warp_prefetch_eighths;
  constexpr const char* kPrefetch = "FLASHDELTA_RECURRENT_WARP_PREFETCH";
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv env(kPrefetch, automatic);
    // Measured: half a wave on fast memory (the H200), none on the H100.
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(true, true), 4);
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(true, false), 0);
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(false, true), 0);
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(false, false), 0);
  }
  const std::pair<const char*, int> kNamed[] = {
      {"off", 0}, {"quarter", 2}, {"half", 4}, {"one", 8}, {"double", 16}};
  for (const auto& [name, eighths] : kNamed) {
    const ScopedEnv env(kPrefetch, name);
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(true, true), eighths) << name;
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(false, false), eighths) << name;
  }
  for (const auto& [count, eighths] : std::initializer_list<std::pair<const char*, int>>{
           {"0", 0}, {"3", 3}, {"6", 6}, {"16", 16}}) {
    const ScopedEnv env(kPrefetch, count);
    EXPECT_EQ(cuda_recurrent_warp_prefetch_eighths(true, true), eighths) << count;
  }
  for (const char* bad : {"ahead", "17", "-1", "003", "3x"})
    expect_setting_rejected(kPrefetch, bad,
                            [] { cuda_recurrent_warp_prefetch_eighths(true, true); });
}

// The warp kernel's keys per lane (host only): 8 at K = 256; at K = 128 where the 16-column
// tasks fill kWarpWavesForEightKeys waves of 12 warps per SM and the state is bfloat16 or the
// memory is not fast, or under `8`.
TEST(CudaRecurrentTile, WarpKeysFollowTheEnvironmentVariable) {
  using detail::cuda_recurrent_warp_keys;
  constexpr const char* kKeys = "FLASHDELTA_RECURRENT_WARP_KEYS";
  const int64_t fill = detail::kWarpWavesForEightKeys * 12 * 132 / 8;  // pairs at V = 128
  for (const char* automatic : {static_cast<const char*>(nullptr), "", "auto"}) {
    const ScopedEnv env(kKeys, automatic);
    for (const bool fast : {false, true})
      for (const bool bf16 : {false, true}) {
        EXPECT_EQ(cuda_recurrent_warp_keys(256, 256, 1, bf16, 132, fast), 8);
        EXPECT_EQ(cuda_recurrent_warp_keys(64, 64, 1 << 20, bf16, 132, fast), 4);
        EXPECT_EQ(cuda_recurrent_warp_keys(128, 128, 1 << 20, bf16, 132, fast),
                  bf16 || !fast ? 8 : 4);
        EXPECT_EQ(cuda_recurrent_warp_keys(128, 128, 256 * 32, bf16, 132, fast),  // N = 256
                  bf16 || !fast ? 8 : 4);
        EXPECT_EQ(cuda_recurrent_warp_keys(128, 128, fill, bf16, 132, fast), bf16 || !fast ? 8 : 4);
        EXPECT_EQ(cuda_recurrent_warp_keys(128, 128, fill - 1, bf16, 132, fast), 4);
        EXPECT_EQ(cuda_recurrent_warp_keys(128, 24, 1 << 20, bf16, 132, fast), 4);  // V not of 16
      }
  }
  for (const char* forced : {"4", "8"}) {
    const ScopedEnv env(kKeys, forced);
    const int keys = forced[0] - '0';
    for (const bool fast : {false, true}) {
      EXPECT_EQ(cuda_recurrent_warp_keys(256, 256, 1, false, 132, fast), 8);
      EXPECT_EQ(cuda_recurrent_warp_keys(128, 128, 1, false, 132, fast), keys);
      EXPECT_EQ(cuda_recurrent_warp_keys(128, 128, 1 << 20, true, 132, fast), keys);
      EXPECT_EQ(cuda_recurrent_warp_keys(64, 64, 1, false, 132, fast), 4);
      EXPECT_EQ(cuda_recurrent_warp_keys(32, 32, 1, true, 132, fast), 4);
    }
  }
  expect_setting_rejected(kKeys, "16",
                          [] { cuda_recurrent_warp_keys(128, 128, 1, false, 132, true); });
}

// The memory class the decode defaults read (host, with a device): a positive peak bandwidth
// from the device's attributes, within what GPUs have (0.1-20 TB/s), and the same when asked
// again (cached).
TEST(CudaRecurrentTile, PeakMemoryBandwidthIsTheDevices) {
  FLASHDELTA_REQUIRE_GPU();
  const double bw = detail::peak_memory_bandwidth();
  EXPECT_GT(bw, 1e11);
  EXPECT_LT(bw, 2e13);
  EXPECT_EQ(detail::peak_memory_bandwidth(), bw);
}

TEST(CudaErrors, ClearMessagesAndNothingWritten) {
  FLASHDELTA_REQUIRE_GPU();
  const Case c = make_case(CaseConfig{});
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  const ForwardArgs host = c.args(o, &s);
  cli::DeviceForward device(host);
  const ForwardArgs& a = device.args;
  DeviceMirror& m = device.mirror;
  auto expect_error = [&](const ForwardArgs& args, Schedule schedule, const std::string& needle) {
    try {
      forward(args, c.options, schedule);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(a, Schedule::reference, "'schedule'");
  ForwardArgs mixed = a;
  mixed.k = host.k;  // a cpu tensor among cuda ones
  expect_error(mixed, Schedule::recurrent, "'k'");
  HostTensor s64(DType::f64, c.state_shape());
  ForwardArgs f64 = a;
  f64.final_state = m.upload(s64.view);
  expect_error(f64, Schedule::recurrent, "'final_state'");
  expect_error(f64, Schedule::chunk, "'final_state'");
}

}  // namespace
}  // namespace flashdelta::testing
