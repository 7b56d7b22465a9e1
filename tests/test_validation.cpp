// Bad input through the library API: every case raises flashdelta::Error whose message
// names the argument, and nothing is written.
#include <gtest/gtest.h>

#include <cstring>

#include <functional>

#include "test_util.h"

namespace flashdelta::testing {
namespace {

constexpr double kPoison = 12345.0;

// Runs forward on a mutated copy of a valid case and asserts that it throws an Error
// mentioning every string of `needles`, leaving o and the final state untouched.
void expect_forward_error(const CaseConfig& cfg, const std::function<void(Case&, ForwardArgs&, Options&)>& mutate,
                          std::vector<std::string> needles, Schedule schedule = Schedule::chunk) {
  Case c = make_case(cfg);
  HostTensor o = c.make_output(DType::f32);
  HostTensor s = c.make_state();
  o.fill(kPoison);
  s.fill(kPoison);
  ForwardArgs a = c.args(o, &s);
  Options opt = c.options;
  mutate(c, a, opt);
  try {
    forward(a, opt, schedule);
    FAIL() << "expected an error mentioning '" << needles.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nmissing: " << n;
  }
  for (double x : o.to_double()) ASSERT_EQ(x, kPoison) << "o was written on error";
  for (double x : s.to_double()) ASSERT_EQ(x, kPoison) << "final_state was written on error";
}

CaseConfig kda() {
  CaseConfig c;
  c.H = 2;
  c.HV = 4;
  c.T = 9;
  c.K = 8;
  c.V = 6;
  return c;
}

TEST(Validation, WrongRank) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.q.rank = 3; },
                       {"'q'", "rank 4", "rank 3"});
}

// An empty batch of 2^40 rows is refused with a message, not an allocation failure.
TEST(Validation, HugeEmptyBatch) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) {
    for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.o}) {
      t->shape[0] = int64_t{1} << 40;
      t->shape[1] = 0;
    }
  }, {"'q'", "batch size"});
}

TEST(Validation, KeyShapeMismatch) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.k.shape[3] = 7; },
                       {"'k'", "[1, 9, 2, 8]", "[1, 9, 2, 7]"});
}

TEST(Validation, HVNotAMultipleOfH) {
  CaseConfig cfg = kda();
  cfg.H = 3;
  cfg.HV = 4;
  expect_forward_error(cfg, [](Case&, ForwardArgs&, Options&) {}, {"'v'", "multiple of H = 3", "HV = 4"});
}

TEST(Validation, GateMissingForGatedMechanism) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.g = TensorView{}; },
                       {"'g'", "required", "kda"});
}

TEST(Validation, GateGivenForUngatedMechanism) {
  CaseConfig cfg = kda();
  cfg.mechanism = Mechanism::deltanet;
  expect_forward_error(cfg, [](Case& c, ForwardArgs& a, Options&) {
    c.g = HostTensor(DType::f32, {1, 9, 4, 8});
    a.g = c.g.view;
  }, {"'g'", "absent", "deltanet"});
}

TEST(Validation, VectorGateGivenAsScalar) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.g.rank = 3; },
                       {"'g'", "[B, T, HV, K]"});
}

TEST(Validation, BetaMissingOrMisshaped) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.beta = TensorView{}; },
                       {"'beta'", "required"});
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.beta.shape[2] = 2; },
                       {"'beta'", "[B, T, HV]"});
}

TEST(Validation, HeadDimensionAbove256) {
  CaseConfig cfg = kda();
  cfg.K = 257;
  expect_forward_error(cfg, [](Case&, ForwardArgs&, Options&) {}, {"'q'", "1..256", "K = 257"});
  cfg = kda();
  cfg.V = 300;
  expect_forward_error(cfg, [](Case&, ForwardArgs&, Options&) {}, {"'v'", "1..256", "V = 300"});
}

TEST(Validation, CuSeqlens) {
  CaseConfig cfg = kda();
  cfg.seqlens = {4, 5};
  auto set_cu = [](std::vector<int64_t> values) {
    return [values](Case& c, ForwardArgs& a, Options&) {
      c.cu_seqlens = HostTensor(DType::i64, {static_cast<int64_t>(values.size())});
      std::copy(values.begin(), values.end(), static_cast<int64_t*>(c.cu_seqlens.view.data));
      a.cu_seqlens = c.cu_seqlens.view;
    };
  };
  expect_forward_error(cfg, set_cu({0, 6, 4, 9}), {"'cu_seqlens'", "non-decreasing"});
  expect_forward_error(cfg, set_cu({0, 4, 8}), {"'cu_seqlens'", "T = 9", "got 8"});
  expect_forward_error(cfg, set_cu({1, 4, 9}), {"'cu_seqlens'", "= 0"});
  expect_forward_error(cfg, set_cu({0, 4, 12}), {"'cu_seqlens'", "exceeds T = 9"});
  expect_forward_error(cfg, [](Case& c, ForwardArgs& a, Options&) {
    c.cu_seqlens = HostTensor(DType::f32, {3});
    a.cu_seqlens = c.cu_seqlens.view;
  }, {"'cu_seqlens'", "int32 or int64", "float32"});
  // 2^62 sequences from one broadcast offset: N x HV and the chunk count would wrap int64 in
  // the kernels' sizes, so N is bounded as B is, before the offsets are read.
  expect_forward_error(cfg, [](Case&, ForwardArgs& a, Options&) {
    a.cu_seqlens.shape[0] = (int64_t{1} << 62) + 1;
    a.cu_seqlens.stride[0] = 0;
  }, {"'cu_seqlens'", "at most 2^24 sequences", "N = 4611686018427387904"});
}

TEST(Validation, CuSeqlensNeedsBatchOne) {
  CaseConfig cfg = kda();
  cfg.B = 2;
  expect_forward_error(cfg, [](Case& c, ForwardArgs& a, Options&) {
    c.cu_seqlens = HostTensor(DType::i64, {2});
    static_cast<int64_t*>(c.cu_seqlens.view.data)[1] = 9;
    a.cu_seqlens = c.cu_seqlens.view;
  }, {"'cu_seqlens'", "B = 1", "B = 2"});
}

TEST(Validation, StateOfTheWrongSize) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.initial_state.shape[2] = 7; },
                       {"'initial_state'", "[N, HV, K, V]", "[1, 4, 8, 6]"});
  expect_forward_error(kda(), [](Case&, ForwardArgs&, Options& o) { o.state_layout = StateLayout::v_first; },
                       {"'initial_state'", "V-first", "[1, 4, 6, 8]"});
}

TEST(Validation, IntegerQuery) {
  expect_forward_error(kda(), [](Case& c, ForwardArgs& a, Options&) {
    c.q = HostTensor(DType::i32, {1, 9, 2, 8});
    a.q = c.q.view;
  }, {"'q'", "float", "int32"});
}

TEST(Validation, OutputOverlappingAnInput) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) {
    a.o = a.v;
    a.o.dtype = DType::f32;
  }, {"'o'", "overlaps", "'v'"});
}

TEST(Validation, BroadcastOutput) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.o.stride[1] = 0; },
                       {"'o'", "stride 0"});
}

// Outputs whose elements would share an address (the order of writing would decide the
// result) are refused; an interleaved view whose elements stay apart is accepted.
TEST(Validation, SelfOverlappingOutput) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) {
    for (int d = 0; d < 4; ++d) a.o.stride[d] = 1;  // o [1, 9, 4, 6]: 19 addresses
  }, {"'o'", "elements overlap"});
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) {
    a.final_state.stride[2] = 3;  // [1, 4, 8, 6]: keys 3 apart, values 1 apart, 6 of them
  }, {"'final_state'", "elements overlap", "stride 3 of dimension 2"});
  const Case c = make_case(kda());
  HostTensor buffer(DType::f32, {1, 9, 4, 12});  // o's rows 12 apart with 6 values each
  ForwardArgs a = c.args(buffer, nullptr);
  a.o.shape[3] = 6;
  forward(a, c.options, Schedule::reference);
}

TEST(Validation, GateOptions) {
  expect_forward_error(kda(), [](Case&, ForwardArgs&, Options& o) { o.lower_bound = -5.0; },
                       {"'lower_bound'", "gate_in_kernel"});
  expect_forward_error(kda(), [](Case&, ForwardArgs&, Options& o) {
    o.gate_in_kernel = true;
    o.lower_bound = 0.5;
  }, {"'lower_bound'", "< 0", "0.5"});
  expect_forward_error(kda(), [](Case&, ForwardArgs&, Options& o) { o.gate_in_kernel = true; },
                       {"'A_log'", "required"});
  CaseConfig cfg = kda();
  cfg.gate_in_kernel = true;
  expect_forward_error(cfg, [](Case&, ForwardArgs& a, Options&) { a.dt_bias.shape[0] = 5; },
                       {"'dt_bias'", "[HV * K]", "[5]"});
  CaseConfig lin = kda();
  lin.mechanism = Mechanism::deltanet;
  expect_forward_error(lin, [](Case&, ForwardArgs&, Options& o) { o.gate_in_kernel = true; },
                       {"'gate_in_kernel'", "gated mechanism"});
}

TEST(Validation, ScaleAndChunkSize) {
  expect_forward_error(kda(), [](Case&, ForwardArgs&, Options& o) { o.scale = INFINITY; },
                       {"'scale'", "finite"});
  expect_forward_error(kda(), [](Case&, ForwardArgs&, Options& o) { o.chunk_size = 48; },
                       {"'chunk_size'", "48"});
}

TEST(Validation, NullData) {
  expect_forward_error(kda(), [](Case&, ForwardArgs& a, Options&) { a.k.data = nullptr; },
                       {"'k'", "null"});
}

TEST(Validation, UnknownNames) {
  EXPECT_THROW(parse_mechanism("mamba"), Error);
  EXPECT_EQ(parse_mechanism("gated_deltanet"), Mechanism::gated_deltanet);
  EXPECT_EQ(parse_schedule("chunk"), Schedule::chunk);
  try {
    parse_schedule("fast");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fast'"), std::string::npos);
  }
}

// ForwardArgs::chunk_states: one state per 64-token chunk of every sequence, any float
// dtype, memory of its own; a refused call leaves it untouched too.
TEST(Validation, ChunkStates) {
  CaseConfig cfg = kda();
  cfg.T = 130;  // 3 chunks
  HostTensor h;
  using Mutation = std::function<void(Case&, ForwardArgs&, Options&)>;
  auto with = [&h](std::vector<int64_t> shape, const Mutation& also = {}) -> Mutation {
    return [&h, shape, also](Case& c, ForwardArgs& a, Options& o) {
      h = HostTensor(DType::f32, shape);
      h.fill(kPoison);
      a.chunk_states = h.view;
      if (also) also(c, a, o);
    };
  };
  auto expect = [&](const CaseConfig& config, const Mutation& mutate,
                    std::vector<std::string> needles) {
    expect_forward_error(config, mutate, needles);
    if (h.view.dtype != DType::f32) return;
    for (double x : h.to_double()) ASSERT_EQ(x, kPoison) << "chunk_states written on error";
  };
  const std::string per_chunk = "C = the 64-token chunks of all sequences, ";
  expect(cfg, with({2, 4, 8, 6}),
         {"'chunk_states'", per_chunk + "3", "[3, 4, 8, 6]", "got [2, 4, 8, 6]"});
  expect(cfg, with({3, 4, 8, 6}, [](Case&, ForwardArgs& a, Options&) { a.chunk_states.rank = 3; }),
         {"'chunk_states'", "rank 4", "rank 3"});
  expect(cfg, with({3, 4, 8, 6}, [](Case& c, ForwardArgs& a, Options& o) {
           o.state_layout = StateLayout::v_first;
           c.initial_state = HostTensor(DType::f32, {1, 4, 6, 8});
           a.initial_state = c.initial_state.view;
           a.final_state = TensorView{};
         }),
         {"'chunk_states'", "V-first", "[3, 4, 6, 8]", "got [3, 4, 8, 6]"});
  expect(cfg, with({3, 4, 8, 6}, [&h](Case&, ForwardArgs& a, Options&) {
           h = HostTensor(DType::i32, {3, 4, 8, 6});
           a.chunk_states = h.view;
         }),
         {"'chunk_states'", "float", "int32"});
  expect(cfg, with({3, 4, 8, 6}, [](Case&, ForwardArgs& a, Options&) {
           a.chunk_states.stride[0] = 0;
         }),
         {"'chunk_states'", "stride 0"});
  expect(cfg, with({3, 4, 8, 6}, [](Case&, ForwardArgs& a, Options&) {
           a.chunk_states.device = Device::cuda;
         }),
         {"'chunk_states'", "expected device cpu", "got cuda"});
  CaseConfig three_rows = kda();  // 3 states and 3 chunk states of the same size
  three_rows.B = 3;
  three_rows.T = 64;
  const char* others[] = {"q", "o", "initial_state", "final_state"};
  for (const char* other : others)
    expect(three_rows, with({3, 4, 8, 6}, [other](Case&, ForwardArgs& a, Options&) {
             const std::string name = other;
             const TensorView& t = name == "q" ? a.q : name == "o" ? a.o
                                 : name == "initial_state" ? a.initial_state : a.final_state;
             a.chunk_states.data = t.data;
           }),
           {"'chunk_states'", "overlaps", std::string("'") + other + "'"});

  // Varlen: empty sequences have no entry, each other one ceil(L / 64).
  CaseConfig varlen = cfg;
  varlen.seqlens = {0, 1, 64, 65};  // 0 + 1 + 1 + 2 entries
  expect(varlen, with({3, 4, 8, 6}), {"'chunk_states'", per_chunk + "4", "got [3, 4, 8, 6]"});
  // Device-resident offsets are not read: C must lie in ceil(T / 64) .. T / 64 + N.
  expect(varlen, with({7, 4, 8, 6}, [](Case&, ForwardArgs& a, Options&) {
           for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.initial_state, &a.cu_seqlens,
                                 &a.o, &a.final_state, &a.chunk_states})
             t->device = Device::cuda;
         }),
         {"'chunk_states'", "3 to 6 for device-resident cu_seqlens", "got [7, 4, 8, 6]"});
}

// --- decode ---

struct DecodeCase {
  Case c;
  HostTensor pool, indices, accepted, o;
  DecodeArgs args() {
    DecodeArgs a;
    a.q = c.q.view;
    a.k = c.k.view;
    a.v = c.v.view;
    a.g = c.g.view;
    a.beta = c.beta.view;
    a.state_pool = pool.view;
    a.state_indices = indices.view;
    a.o = o.view;
    return a;
  }
};

DecodeCase make_decode(int64_t N, int64_t T, int64_t P, std::vector<int64_t> idx, std::vector<int64_t> shape) {
  CaseConfig cfg = kda();
  cfg.B = N;
  cfg.T = T;
  DecodeCase d{make_case(cfg), HostTensor(DType::f32, {P, cfg.HV, cfg.K, cfg.V}),
               HostTensor(DType::i64, shape), HostTensor(), HostTensor()};
  std::copy(idx.begin(), idx.end(), static_cast<int64_t*>(d.indices.view.data));
  d.pool.fill(kPoison);
  d.o = d.c.make_output(DType::f32);
  d.o.fill(kPoison);
  return d;
}

void expect_decode_error(DecodeCase& d, const DecodeArgs& a, std::vector<std::string> needles) {
  try {
    decode(a, d.c.options);
    FAIL() << "expected an error mentioning " << needles.front();
  } catch (const Error& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
  for (double x : d.pool.to_double()) ASSERT_EQ(x, kPoison);
  for (double x : d.o.to_double()) ASSERT_EQ(x, kPoison);
}

TEST(DecodeValidation, SlotOutOfRange) {
  DecodeCase d = make_decode(2, 1, 4, {1, 4}, {2});
  expect_decode_error(d, d.args(), {"'state_indices'", "slot 4", "P = 4"});
}

TEST(DecodeValidation, DuplicateSlots) {
  DecodeCase d = make_decode(3, 1, 4, {2, -1, 2}, {3});
  expect_decode_error(d, d.args(), {"'state_indices'", "slot 2", "rows 0 and 2"});
}

// Rows run concurrently, so a row may not start from a slot another row writes.
TEST(DecodeValidation, StartSlotWrittenByAnotherRow) {
  DecodeCase d = make_decode(2, 1, 8, {4, 1, 1, 5}, {2, 2});
  d.accepted = HostTensor(DType::i64, {2});
  static_cast<int64_t*>(d.accepted.view.data)[0] = 2;  // row 0 starts from slot 1
  static_cast<int64_t*>(d.accepted.view.data)[1] = 1;  // row 1 writes slot 1
  DecodeArgs a = d.args();
  a.num_accepted_tokens = d.accepted.view;
  expect_decode_error(d, a, {"'state_indices'", "row 0 starts from slot 1", "row 1 writes"});
}

TEST(DecodeValidation, AcceptedTokensNeedPerTokenSlots) {
  DecodeCase d = make_decode(2, 1, 4, {0, 1}, {2});
  d.accepted = HostTensor(DType::i32, {2});
  DecodeArgs a = d.args();
  a.num_accepted_tokens = d.accepted.view;
  expect_decode_error(d, a, {"'num_accepted_tokens'", "[N, S]"});
}

TEST(DecodeValidation, AcceptedTokensInRange) {
  DecodeCase d = make_decode(2, 2, 8, {0, 1, 2, 3}, {2, 2});
  d.accepted = HostTensor(DType::i64, {2});
  static_cast<int64_t*>(d.accepted.view.data)[0] = 1;
  static_cast<int64_t*>(d.accepted.view.data)[1] = 3;
  DecodeArgs a = d.args();
  a.num_accepted_tokens = d.accepted.view;
  expect_decode_error(d, a, {"'num_accepted_tokens'", "1..2", "got 3"});
}

TEST(DecodeValidation, NoSlotsPerRow) {
  DecodeCase d = make_decode(2, 1, 4, {}, {2, 0});
  expect_decode_error(d, d.args(), {"'state_indices'", "at least 1 slot"});
}

TEST(DecodeValidation, OutputOverlappingTheIndices) {
  DecodeCase d = make_decode(1, 1, 2, {0}, {1});
  DecodeArgs a = d.args();
  const int64_t slot = 0;
  std::memcpy(d.o.view.data, &slot, sizeof slot);  // a valid index stored inside o
  a.state_indices.data = d.o.view.data;
  const std::vector<unsigned char> o_before = d.o.bytes;
  try {
    decode(a, d.c.options);
    FAIL() << "expected an overlap error";
  } catch (const Error& e) {
    for (const char* n : {"'o'", "overlaps", "'state_indices'"})
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
  EXPECT_EQ(d.o.bytes, o_before);
  for (double x : d.pool.to_double()) ASSERT_EQ(x, kPoison);
}

TEST(DecodeValidation, TooFewSlotsPerRow) {
  DecodeCase d = make_decode(2, 3, 8, {0, 1, 2, 3}, {2, 2});
  expect_decode_error(d, d.args(), {"'state_indices'", "at least 3"});
}

TEST(DecodeValidation, PoolDtypeAndChunkSchedule) {
  DecodeCase d = make_decode(1, 1, 2, {0}, {1});
  DecodeArgs a = d.args();
  a.state_pool.dtype = DType::f16;
  expect_decode_error(d, a, {"'state_pool'", "float32 or bfloat16", "float16"});
  try {
    decode(d.args(), d.c.options, Schedule::chunk);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'schedule'"), std::string::npos);
  }
}

// --- backward ---

// A float64 KDA problem of T tokens (the kda() sizes) and the backward's inputs over it:
// q, k, v, g, beta and d_o, no gradient asked for.
struct BackwardProblem {
  Case c;
  HostTensor d_o;
  BackwardArgs args;

  explicit BackwardProblem(int64_t T = 9)
      : c(make_case(config(T))), d_o(c.make_output(DType::f64)) {
    args.q = c.q.view;
    args.k = c.k.view;
    args.v = c.v.view;
    args.g = c.g.view;
    args.beta = c.beta.view;
    args.d_o = d_o.view;
  }
  BackwardProblem(const BackwardProblem&) = delete;  // the views point into the members

 private:
  static CaseConfig config(int64_t T) {
    CaseConfig cfg = kda();
    cfg.T = T;
    cfg.dtype = DType::f64;
    return cfg;
  }
};

TEST(BackwardValidation, GradientShapeAndPresence) {
  const BackwardProblem bp;
  const Case& c = bp.c;
  HostTensor dq(DType::f64, {1, 9, 2, 7});
  HostTensor dA(DType::f64, {4});
  BackwardArgs a = bp.args;
  a.dq = dq.view;
  try {
    backward(a, c.options);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'dq'"), std::string::npos) << e.what();
  }
  a.dq = TensorView{};
  a.dA_log = dA.view;
  try {
    backward(a, c.options);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'A_log' is absent"), std::string::npos) << e.what();
  }
}

// The backward's workspace query validates as backward does and needs nothing on the CPU.
TEST(BackwardValidation, WorkspaceBytes) {
  const BackwardProblem bp;
  const Case& c = bp.c;
  BackwardArgs a = bp.args;
  EXPECT_EQ(backward_workspace_bytes(a, c.options, Schedule::reference), 0u);
  EXPECT_EQ(backward_workspace_bytes(a, c.options), 0u);
  a.d_o = TensorView{};
  try {
    backward_workspace_bytes(a, c.options);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'d_o'"), std::string::npos) << e.what();
  }
}

// BackwardArgs::chunk_states, the kept forward states: ForwardArgs::chunk_states' shape, any
// float dtype, and no gradient output on its memory; nothing is written on error.
TEST(BackwardValidation, KeptChunkStates) {
  const BackwardProblem bp(70);  // two chunks
  const Case& c = bp.c;
  HostTensor dq = c.q;  // float64, q's shape
  BackwardArgs a = bp.args;
  a.dq = dq.view;
  auto expect_error = [&](const BackwardArgs& bad, std::vector<std::string> needles) {
    constexpr double kPoison = 777.0;
    dq.fill(kPoison);
    try {
      backward(bad, c.options);
      ADD_FAILURE() << "no error for " << needles[0];
    } catch (const Error& e) {
      for (const std::string& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
    for (double x : dq.to_double()) ASSERT_EQ(x, kPoison) << "dq written on error";
  };
  HostTensor h = c.make_chunk_states(DType::f32);
  ASSERT_EQ(h.view.shape[0], 2);
  h.fill(0.0);
  a.chunk_states = h.view;
  backward(a, c.options);  // valid
  BackwardArgs bad = a;
  bad.chunk_states.shape[0] = 1;
  expect_error(bad, {"'chunk_states'", "2)", "got [1, 4, 8, 6]"});
  HostTensor ints(DType::i32, {2, 4, 8, 6});
  bad.chunk_states = ints.view;
  expect_error(bad, {"'chunk_states'", "float", "int32"});
  bad = a;
  bad.chunk_states.data = dq.view.data;  // states inside a gradient's memory
  expect_error(bad, {"'dq'", "overlaps 'chunk_states'"});
}

}  // namespace
}  // namespace flashdelta::testing
