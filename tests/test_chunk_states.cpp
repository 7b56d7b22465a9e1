// ForwardArgs::chunk_states (the state entering every 64-token chunk) on the CPU: the
// reference's entries against independent runs over each sequence's prefixes (entry c of a
// sequence is its final state after 64 c tokens), then the recurrent and chunk schedules
// against the reference: fixed length and varlen with empty and one-token sequences,
// lengths that are not multiples of 64, both state layouts, with and without an initial
// state, every chunk size and both orders of the chunk schedule, every output dtype.
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace flashdelta::testing {
namespace {

// Marks entries a schedule failed to write (representable in every float dtype).
constexpr double kUnwritten = 12345.0;

struct Outputs {
  std::vector<double> o, state, chunks;
};

struct RunConfig {
  Schedule schedule = Schedule::chunk;
  int chunk_size = 64;
  int num_threads = 0;
  DType chunk_dtype = DType::f32;
  DType state_dtype = DType::f32;
};

Outputs run(const Case& c, const RunConfig& rc) {
  HostTensor o = c.make_output(DType::f64), s(rc.state_dtype, c.state_shape());
  HostTensor h = c.make_chunk_states(rc.chunk_dtype);
  h.fill(kUnwritten);
  ForwardArgs a = c.args(o, &s);
  a.chunk_states = h.view;
  Options options = c.options;
  options.chunk_size = rc.chunk_size;
  options.num_threads = rc.num_threads;
  forward(a, options, rc.schedule);
  return {o.to_double(), s.to_double(), h.to_double()};
}

Outputs run_reference(const Case& c) {
  return run(c, {.schedule = Schedule::reference, .chunk_dtype = DType::f64,
                 .state_dtype = DType::f64});
}

std::string describe(const Case& c, const RunConfig& rc) {
  const CaseConfig& cfg = c.cfg;
  std::string s = std::string(mechanism_name(cfg.mechanism)) + " " +
                  schedule_name(rc.schedule) + " C=" + std::to_string(rc.chunk_size) +
                  " threads=" + std::to_string(rc.num_threads) + " B=" + std::to_string(cfg.B) +
                  " T=" + std::to_string(cfg.T) + " chunk dtype " + dtype_name(rc.chunk_dtype);
  if (!cfg.seqlens.empty()) {
    s += " seqlens=";
    for (int64_t l : cfg.seqlens) s += std::to_string(l) + ",";
  }
  if (cfg.layout == StateLayout::v_first) s += " v_first";
  if (!cfg.initial_state) s += " no_initial_state";
  return s;
}

// Sequence n's final state after its first `tokens` tokens, from the reference run on views
// of that sequence's rows alone, without cu_seqlens: another path to chunk entry tokens / 64.
std::vector<double> prefix_state(const Case& c, int64_t n, int64_t tokens) {
  int64_t row = n, t0 = 0;
  if (!c.cfg.seqlens.empty()) {
    row = 0;
    for (int64_t m = 0; m < n; ++m) t0 += c.cfg.seqlens[m];
  }
  HostTensor o(DType::f64, {1, tokens, c.cfg.HV, c.cfg.V});
  std::vector<int64_t> one = c.state_shape();
  one[0] = 1;
  HostTensor s(DType::f64, one);
  ForwardArgs a = c.args(o, &s);
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta}) {
    if (!t->present()) continue;
    t->data = detail::element_address(*t, row * t->stride[0] + t0 * t->stride[1]);
    t->shape[0] = 1;
    t->shape[1] = tokens;
  }
  a.cu_seqlens = TensorView{};
  if (a.initial_state.present()) {
    a.initial_state.data = detail::element_address(a.initial_state, n * a.initial_state.stride[0]);
    a.initial_state.shape[0] = 1;
  }
  forward(a, c.options, Schedule::reference);
  return s.to_double();
}

std::vector<int64_t> lengths_of(const Case& c) {
  return c.cfg.seqlens.empty() ? std::vector<int64_t>(c.cfg.B, c.cfg.T) : c.cfg.seqlens;
}

// Fixed-length and varlen problems whose lengths straddle the 64-token boundaries.
std::vector<CaseConfig> shapes(Mechanism m, uint64_t seed) {
  std::vector<CaseConfig> out;
  CaseConfig fixed{.mechanism = m, .B = 2, .T = 150, .H = 1, .HV = 2, .K = 33, .V = 20,
                   .seed = seed};
  out.push_back(fixed);
  CaseConfig varlen{.mechanism = m, .T = 268, .H = 2, .HV = 2, .K = 16, .V = 24,
                    .seqlens = {0, 1, 64, 65, 130, 0, 8}, .initial_state = false,
                    .layout = StateLayout::v_first, .seed = seed + 1};
  out.push_back(varlen);
  CaseConfig exact{.mechanism = m, .B = 1, .T = 128, .H = 1, .HV = 1, .K = 8, .V = 8,
                   .layout = StateLayout::v_first, .seed = seed + 2};
  out.push_back(exact);
  return out;
}

TEST(ChunkStates, ReferenceEntriesAreTheStatesAfterEachPrefix) {
  uint64_t seed = 300;
  for (const Mechanism m : kAllMechanisms)
    for (const CaseConfig& cfg : shapes(m, seed += 3)) {
      const Case c = make_case(cfg);
      const Outputs ref = run_reference(c);
      const std::vector<int64_t> lengths = lengths_of(c);
      const size_t per_entry = static_cast<size_t>(cfg.HV * cfg.K * cfg.V);
      ASSERT_EQ(ref.chunks.size(), static_cast<size_t>(c.chunk_count()) * per_entry);
      size_t entry = 0;
      for (size_t n = 0; n < lengths.size(); ++n)
        for (int64_t t = 0; t < lengths[n]; t += kChunkStateTokens, ++entry) {
          const std::vector<double> want = prefix_state(c, static_cast<int64_t>(n), t);
          const std::vector<double> got(ref.chunks.begin() + entry * per_entry,
                                        ref.chunks.begin() + (entry + 1) * per_entry);
          EXPECT_EQ(got, want) << describe(c, {.schedule = Schedule::reference}) << ": sequence "
                               << n << ", state before token " << t;
        }
      EXPECT_EQ(entry, static_cast<size_t>(c.chunk_count()));
    }
}

// Every fast schedule against the reference, within the f32 tolerance, on the three
// outputs: chunk states, o and the final state.
void expect_matches_reference(const Case& c, const RunConfig& rc, double tol) {
  const Outputs ref = run_reference(c);
  const Outputs got = run(c, rc);
  EXPECT_LE(rel_error(got.chunks, ref.chunks), tol) << "chunk states, " << describe(c, rc);
  EXPECT_LE(rel_error(got.o, ref.o), tol) << "output, " << describe(c, rc);
  EXPECT_LE(rel_error(got.state, ref.state), tol) << "final state, " << describe(c, rc);
}

TEST(ChunkStates, RecurrentScheduleMatchesReference) {
  uint64_t seed = 400;
  for (const Mechanism m : kAllMechanisms)
    for (const CaseConfig& cfg : shapes(m, seed += 3))
      expect_matches_reference(make_case(cfg), {.schedule = Schedule::recurrent},
                               tolerance(DType::f32));
}

// Chunk sizes 16 and 32 record at every 4th and 2nd chunk start, 128 runs 64-token chunks;
// one or two threads take the fused order (except on the one-item shape), sixteen the
// phased one (fewer items than threads) on every shape, varlen included.
TEST(ChunkStates, ChunkScheduleMatchesReference) {
  uint64_t seed = 500;
  for (const Mechanism m : kAllMechanisms)
    for (const CaseConfig& cfg : shapes(m, seed += 3))
      for (const int chunk : {16, 32, 64, 128})
        for (const int threads : {1, 2, 16})
          expect_matches_reference(make_case(cfg),
                                   {.chunk_size = chunk, .num_threads = threads},
                                   tolerance(DType::f32));
}

// The phased order over several windows of chunks (a window holds 8 per thread): with two
// threads and 16-token chunks a 300-token sequence takes two windows, recorded entries
// falling in both.
TEST(ChunkStates, PhasedOrderAcrossWindows) {
  uint64_t seed = 550;
  for (const Mechanism m : kAllMechanisms)
    expect_matches_reference(make_case({.mechanism = m, .B = 1, .T = 300, .H = 1, .HV = 1,
                                        .K = 8, .V = 8, .seed = seed++}),
                             {.chunk_size = 16, .num_threads = 2}, tolerance(DType::f32));
}

TEST(ChunkStates, EveryOutputDtype) {
  const Case c = make_case({.mechanism = Mechanism::kda, .B = 1, .T = 200, .H = 1, .HV = 2,
                            .K = 32, .V = 16, .seed = 600});
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (const Schedule schedule : {Schedule::recurrent, Schedule::chunk})
      expect_matches_reference(c, {.schedule = schedule, .chunk_size = 32, .chunk_dtype = dtype},
                               tolerance(dtype == DType::f64 ? DType::f32 : dtype));
  // float64 inputs on the chunk schedule compute in double.
  const Case wide = make_case({.mechanism = Mechanism::gated_deltanet, .B = 1, .T = 130, .H = 1,
                               .HV = 1, .K = 16, .V = 16, .dtype = DType::f64, .seed = 601});
  expect_matches_reference(wide, {.chunk_dtype = DType::f64, .state_dtype = DType::f64},
                           tolerance(DType::f64));
}

TEST(ChunkStates, EmptyBatchesHaveNoEntries) {
  for (const Schedule schedule : {Schedule::reference, Schedule::recurrent, Schedule::chunk}) {
    for (const CaseConfig& cfg :
         {CaseConfig{.B = 2, .T = 0, .K = 8, .V = 8},
          CaseConfig{.T = 0, .K = 8, .V = 8, .seqlens = {0, 0, 0}}}) {
      const Case c = make_case(cfg);
      ASSERT_EQ(c.chunk_count(), 0);
      const Outputs ref = run_reference(c);
      const Outputs got = run(c, {.schedule = schedule});
      EXPECT_TRUE(got.chunks.empty());
      EXPECT_EQ(got.state, ref.state) << "states pass through, " << schedule_name(schedule);
    }
  }
}

// Chunk states in a view whose rows (the last dimension) are `pad` elements apart beyond
// their length, starting `offset` elements into its buffer: the view's elements in shape
// order, and whether every buffer element outside it kept its value.
struct StridedRun {
  std::vector<double> entries;
  bool outside_untouched = true;
};

StridedRun run_strided(const Case& c, Schedule schedule, DType dtype, int64_t pad,
                       int64_t offset) {
  HostTensor o = c.make_output(DType::f32), s = c.make_state();
  std::vector<int64_t> shape = c.state_shape();
  shape[0] = c.chunk_count();
  const std::array<int64_t, 4> stride = {shape[1] * shape[2] * (shape[3] + pad),
                                         shape[2] * (shape[3] + pad), shape[3] + pad, 1};
  int64_t span = 1;
  for (int i = 0; i < 4; ++i) span += (shape[i] - 1) * stride[i];
  HostTensor buffer(dtype, {offset + span});
  std::vector<double> marks(static_cast<size_t>(offset + span));
  for (size_t i = 0; i < marks.size(); ++i) marks[i] = 1000.0 + static_cast<double>(i % 512);
  buffer.set(marks);
  const std::vector<double> before = buffer.to_double();
  ForwardArgs a = c.args(o, &s);
  a.chunk_states = buffer.view;
  a.chunk_states.data = detail::element_address(buffer.view, offset);
  for (int i = 0; i < 4; ++i) {
    a.chunk_states.shape[i] = shape[i];
    a.chunk_states.stride[i] = stride[i];
  }
  a.chunk_states.rank = 4;
  forward(a, c.options, schedule);
  const std::vector<double> after = buffer.to_double();
  StridedRun out;
  std::vector<bool> inside(after.size(), false);
  for (int64_t e = 0; e < shape[0]; ++e)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t i = 0; i < shape[2]; ++i)
        for (int64_t j = 0; j < shape[3]; ++j) {
          const auto at = static_cast<size_t>(offset + e * stride[0] + h * stride[1] +
                                              i * stride[2] + j);
          out.entries.push_back(after[at]);
          inside[at] = true;
        }
  for (size_t i = 0; i < after.size(); ++i)
    if (!inside[i] && after[i] != before[i]) out.outside_untouched = false;
  return out;
}

// Strided and offset views (the state tile stores of the recurrent schedule have paths for
// dense keys and dense values): the same entries, nothing written outside the view.
TEST(ChunkStates, StridedViews) {
  uint64_t seed = 650;
  for (const StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    const Case c = make_case({.mechanism = Mechanism::kda, .B = 2, .T = 150, .H = 1, .HV = 2,
                              .K = 16, .V = 24, .layout = layout, .seed = seed++});
    const Outputs ref = run_reference(c);
    for (const Schedule schedule : {Schedule::reference, Schedule::recurrent, Schedule::chunk})
      for (const DType dtype : {DType::f32, DType::bf16})
        for (const auto& [pad, offset] : {std::pair{0, 1}, std::pair{1, 0}, std::pair{3, 2}}) {
          const StridedRun got = run_strided(c, schedule, dtype, pad, offset);
          const std::string what = describe(c, {.schedule = schedule, .chunk_dtype = dtype}) +
                                   " pad " + std::to_string(pad) + " offset " +
                                   std::to_string(offset);
          EXPECT_LE(rel_error(got.entries, ref.chunks), tolerance(dtype)) << what;
          EXPECT_TRUE(got.outside_untouched) << what << ": written outside the view";
        }
  }
}

// Recording reads the state at chunk starts and changes nothing the chunk schedule computes.
TEST(ChunkStates, ChunkScheduleOutputsUnchangedByRecording) {
  const Case c = make_case({.mechanism = Mechanism::kda, .B = 2, .T = 150, .HV = 2, .K = 32,
                            .V = 32, .seed = 700});
  for (const int threads : {1, 8}) {
    HostTensor o = c.make_output(DType::f32), s = c.make_state();
    Options options = c.options;
    options.chunk_size = 16;
    options.num_threads = threads;
    forward(c.args(o, &s), options, Schedule::chunk);
    const Outputs with = run(c, {.chunk_size = 16, .num_threads = threads});
    EXPECT_EQ(with.o, o.to_double()) << threads << " threads";
    EXPECT_EQ(with.state, s.to_double()) << threads << " threads";
  }
}

}  // namespace
}  // namespace flashdelta::testing
