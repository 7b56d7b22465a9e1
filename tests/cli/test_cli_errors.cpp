// `flashdelta run` on bad input: every case exits non-zero with one message naming the
// problem, and leaves a pre-existing --out file byte for byte as it was.
#include <gtest/gtest.h>
#ifdef FLASHDELTA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "cli_harness.h"

namespace flashdelta::testing {
namespace {

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
const std::string kPreviousOutput = std::string("previous output\0\x01\x02\xff", 19);

class RunRejects : public CliTest {
 protected:
  // A valid small problem of `mechanism` (T = 9, H = 2, HV = 4, K = V = 8).
  static Case base(Mechanism mechanism) {
    CaseConfig cfg;
    cfg.mechanism = mechanism;
    cfg.T = 9;
    cfg.H = 2;
    cfg.HV = 4;
    cfg.K = 8;
    cfg.V = 8;
    return make_case(cfg);
  }

  std::string in() const { return path("in.safetensors").string(); }
  std::string out() const { return path("out.safetensors").string(); }

  // Runs `args` with an --out file already in place; expects exit status `code`, stderr
  // naming each of `words`, and the --out file and the directory unchanged.
  void expect_rejected(const std::vector<std::string>& args, int code,
                       const std::vector<std::string>& words) {
    write_file(out(), kPreviousOutput);
    const std::set<std::string> before = listing();
    const CliResult r = cli(args);
    EXPECT_EQ(r.exit_code, code) << "stderr: " << r.err;
    for (const std::string& w : words)
      EXPECT_NE(r.err.find(w), std::string::npos) << "stderr should name '" << w << "': " << r.err;
    if (code == kExitError) {
      EXPECT_EQ(r.err.rfind("flashdelta: error: ", 0), 0u) << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
    }
    EXPECT_EQ(read_file(out()), kPreviousOutput) << "--out was modified";
    EXPECT_EQ(listing(), before) << "files appeared or vanished";
  }

  // Writes `tensors` as the input file and runs the given mechanism on it.
  void expect_rejected(const io::TensorMap& tensors, Mechanism mechanism,
                       const std::vector<std::string>& words,
                       const std::vector<std::string>& flags = {}) {
    io::write_safetensors(in(), tensors);
    std::vector<std::string> args = {
        "run", "--in", in(), "--out", out(), "--mechanism", mechanism_name(mechanism)};
    args.insert(args.end(), flags.begin(), flags.end());
    expect_rejected(args, kExitError, words);
  }
};

// A float32 tensor of the given shape with random values.
io::OwnedTensor random_f32(std::vector<int64_t> shape, uint64_t seed = 5) {
  io::OwnedTensor t(DType::f32, std::move(shape));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  float* p = reinterpret_cast<float*>(t.bytes.data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(rng);
  return t;
}

io::OwnedTensor offsets(std::vector<int64_t> values) {
  io::OwnedTensor t(DType::i64, {static_cast<int64_t>(values.size())});
  std::memcpy(t.bytes.data(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

TEST_F(RunRejects, WrongRank) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["q"].shape = {9, 2, 8};  // [T, H, K]: the batch dimension is missing
  expect_rejected(t, Mechanism::kda, {"argument 'q'", "rank 4"});
}

TEST_F(RunRejects, WrongShape) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["k"] = random_f32({1, 9, 2, 7});
  expect_rejected(t, Mechanism::kda, {"argument 'k'", "[1, 9, 2, 7]"});
}

TEST_F(RunRejects, ValueHeadsNotAMultipleOfKeyHeads) {
  io::TensorMap t = case_tensors(base(Mechanism::deltanet));
  t["v"] = random_f32({1, 9, 3, 8});
  t["beta"] = random_f32({1, 9, 3});
  expect_rejected(t, Mechanism::deltanet, {"argument 'v'", "multiple of H = 2", "HV = 3"});
}

TEST_F(RunRejects, GateMissing) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t.erase("g");
  expect_rejected(t, Mechanism::kda, {"argument 'g'", "required", "kda"});
}

TEST_F(RunRejects, VectorGateWithScalarShape) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["g"] = random_f32({1, 9, 4});
  expect_rejected(t, Mechanism::kda, {"argument 'g'", "[B, T, HV, K]"});
}

TEST_F(RunRejects, ScalarGateWithVectorShape) {
  io::TensorMap t = case_tensors(base(Mechanism::gated_deltanet));
  t["g"] = random_f32({1, 9, 4, 8});
  expect_rejected(t, Mechanism::gated_deltanet, {"argument 'g'", "[B, T, HV]"});
}

TEST_F(RunRejects, GateForAMechanismWithoutGate) {
  io::TensorMap t = case_tensors(base(Mechanism::deltanet));
  t["g"] = random_f32({1, 9, 4});
  expect_rejected(t, Mechanism::deltanet, {"argument 'g'", "must be absent", "deltanet"});
}

TEST_F(RunRejects, BetaMissing) {
  io::TensorMap t = case_tensors(base(Mechanism::gated_deltanet));
  t.erase("beta");
  expect_rejected(t, Mechanism::gated_deltanet, {"argument 'beta'", "required"});
}

TEST_F(RunRejects, BetaMisShaped) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["beta"] = random_f32({1, 9, 2});
  expect_rejected(t, Mechanism::kda, {"argument 'beta'", "[1, 9, 2]"});
}

TEST_F(RunRejects, KeyDimensionAbove256) {
  io::TensorMap t = case_tensors(base(Mechanism::deltanet));
  t["q"] = random_f32({1, 9, 2, 257});
  t["k"] = random_f32({1, 9, 2, 257});
  expect_rejected(t, Mechanism::deltanet, {"argument 'q'", "K = 257"});
}

TEST_F(RunRejects, ValueDimensionAbove256) {
  io::TensorMap t = case_tensors(base(Mechanism::linear_attention));
  t["v"] = random_f32({1, 9, 4, 300});
  t.erase("initial_state");
  expect_rejected(t, Mechanism::linear_attention, {"argument 'v'", "V = 300"});
}

TEST_F(RunRejects, NonMonotonicCuSeqlens) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["cu_seqlens"] = offsets({0, 5, 3, 9});
  t["initial_state"] = random_f32({3, 4, 8, 8});
  expect_rejected(t, Mechanism::kda, {"argument 'cu_seqlens'", "non-decreasing"});
}

TEST_F(RunRejects, CuSeqlensNotSummingToT) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["cu_seqlens"] = offsets({0, 3, 8});
  t["initial_state"] = random_f32({2, 4, 8, 8});
  expect_rejected(t, Mechanism::kda, {"argument 'cu_seqlens'", "T = 9", "got 8"});
}

TEST_F(RunRejects, InitialStateOfTheWrongSize) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["initial_state"] = random_f32({1, 4, 8, 9});
  expect_rejected(t, Mechanism::kda, {"argument 'initial_state'", "[1, 4, 8, 9]"});
}

TEST_F(RunRejects, IntegerQuery) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  io::OwnedTensor q(DType::i32, {1, 9, 2, 8});
  t["q"] = q;
  expect_rejected(t, Mechanism::kda, {"argument 'q'", "float", "int32"});
}

TEST_F(RunRejects, GateActivationWithoutItsParameters) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  expect_rejected(t, Mechanism::kda, {"argument 'A_log'", "gate_in_kernel"}, {"--gate-in-kernel"});
}

TEST_F(RunRejects, UnknownTensorName) {
  io::TensorMap t = case_tensors(base(Mechanism::kda));
  t["qq"] = t["q"];
  t["betta"] = t["beta"];
  expect_rejected(t, Mechanism::kda, {"unknown tensor", "'qq'", "'betta'"});
}

// Without a CUDA build, or without a GPU, --device cuda fails with a message naming cuda.
TEST_F(RunRejects, CudaDeviceWithoutGpu) {
#ifdef FLASHDELTA_WITH_CUDA
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0)
    GTEST_SKIP() << "this machine runs --device cuda (tests/cuda, scripts/device-run.sh)";
#endif
  expect_rejected(case_tensors(base(Mechanism::kda)), Mechanism::kda, {"cuda"},
                  {"--device", "cuda"});
}

TEST_F(RunRejects, MissingInputFile) {
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "kda"}, kExitError, {in()});
}

TEST_F(RunRejects, EmptyInputFile) {
  write_file(in(), "");
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "kda"}, kExitError, {in()});
}

TEST_F(RunRejects, TruncatedInputFile) {
  io::write_safetensors(in(), case_tensors(base(Mechanism::kda)));
  const std::string whole = read_file(in());
  write_file(in(), whole.substr(0, whole.size() - 100));
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "kda"}, kExitError, {in()});
}

TEST_F(RunRejects, MalformedHeader) {
  const std::string header = "{\"q\": {\"dtype\": \"F32\", \"shape\": [1, 2";  // cut JSON
  std::string file(8, '\0');
  file[0] = static_cast<char>(header.size());
  write_file(in(), file + header);
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "kda"}, kExitError, {in()});
}

TEST_F(RunRejects, UnknownMechanism) {
  io::write_safetensors(in(), case_tensors(base(Mechanism::kda)));
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "mamba"}, kExitUsage,
                  {"mechanism", "'mamba'", "gated_deltanet"});
}

TEST_F(RunRejects, UnknownSchedule) {
  io::write_safetensors(in(), case_tensors(base(Mechanism::kda)));
  expect_rejected(
      {"run", "--in", in(), "--out", out(), "--mechanism", "kda", "--schedule", "parallel"},
      kExitUsage, {"schedule", "'parallel'"});
}

TEST_F(RunRejects, NotANumber) {
  io::write_safetensors(in(), case_tensors(base(Mechanism::kda)));
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "kda", "--scale", "big"},
                  kExitUsage, {"--scale", "big"});
}

TEST_F(RunRejects, InputWithoutOutput) {
  io::write_safetensors(in(), case_tensors(base(Mechanism::kda)));
  expect_rejected({"run", "--in", in(), "--mechanism", "kda"}, kExitUsage, {"--out"});
}

TEST_F(RunRejects, UnknownOption) {
  expect_rejected({"run", "--in", in(), "--out", out(), "--mechanism", "kda", "--fast"}, kExitUsage,
                  {"--fast"});
}

TEST_F(RunRejects, BadChunkSizeFromTheLibrary) {
  expect_rejected(case_tensors(base(Mechanism::kda)), Mechanism::kda,
                  {"argument 'chunk_size'", "got 48"}, {"--chunk-size", "48"});
}

}  // namespace
}  // namespace flashdelta::testing
