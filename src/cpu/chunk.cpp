// The chunkwise CPU schedule (prefill): the recurrence of flashdelta.h in the matrix form of
// DESIGN.md section 3. Per (sequence, value head) and chunk of C tokens, with Gamma the
// cumulative log2 decay from the chunk start:
//   1-3. Gamma, A_kk, A_qk and T = (I + A_kk)^-1 (cpu/chunk_prepare-inl.h; independent
//        across chunks)
//   4.   v_new = T (beta v - (beta k 2^Gamma) S),
//        S <- diag(2^G_end) S + (k 2^(G_end - Gamma))^T v_new            (sequential)
//   5.   o = (scale q 2^Gamma) S + A_qk v_new
// Linear attention and the GLAs skip the solve (v_new = v).
//
// Work split: an item is a sequence and a group of adjacent value heads, run chunk by chunk
// in lockstep so their token rows are read together; items run in parallel, each with its
// working set in L2 (the fused order). With fewer (sequence, head) pairs than threads, a
// window of chunks runs steps 1-3 in parallel over chunks, step 4 per head, then step 5 in
// parallel over chunks (the phased order). Both orders run the same kernels on the same
// data, so results are bitwise identical whatever the thread count.
//
// SIMD: Highway, runtime dispatch over AVX-512 (AVX3), AVX2 and scalar.

// Compiled targets: AVX-512 and AVX2 (FMA), and the portable fallback for older CPUs;
// each target compiles the whole pipeline, so fewer targets keep the build short.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/chunk_states.h"
#include "core/parallel.h"
#include "core/problem.h"
#include "core/tensor_io.h"
#include "core/token_inputs.h"
#include "cpu/chunk_layout.h"
#include "cpu/chunk_rows.h"
#include "cpu/cpu.h"
#include "hwy/aligned_allocator.h"

// Re-includes this file once per target; the per-target headers must follow it.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/chunk.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/chunk_kernels-inl.h"
#include "cpu/chunk_prepare-inl.h"
#include "cpu/token_transforms-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::chunk::HWY_NAMESPACE {

// The fused input transforms, vectorised (float and double rows alike).
using Transforms = detail::HWY_NAMESPACE::VectorTransforms;

// Step 5 for state columns [n0, n0 + ns): o = q S + A_qk v_new. S is the chunk-start state
// and v_new the chunk's corrected values, both with rows Vp apart.
template <class T>
void ChunkOutput(const Dims& dm, const ChunkData<T>& cd, const T* S, const T* v_new, T* out,
                 int64_t n0, int64_t ns) {
  Gemm<T> qs;
  qs.M = cd.rows;
  qs.N = ns;
  qs.P = dm.Kp;
  qs.a = cd.q;
  qs.a_row = dm.Kp;
  qs.a_col = 1;
  qs.b = S + n0;
  qs.ldb = dm.Vp;
  qs.c = out + n0;
  qs.ldc = dm.Vp;
  RunGemm<false>(qs);
  Gemm<T> av;
  av.M = cd.rows;
  av.N = ns;
  av.P = cd.rows;
  av.causal = true;
  av.a = cd.a_qk;
  av.a_row = dm.C;
  av.a_col = 1;
  av.b = v_new + n0;
  av.ldb = dm.Vp;
  av.c = out + n0;
  av.ldc = dm.Vp;
  av.init = out + n0;
  av.ld_init = dm.Vp;
  RunGemm<false>(av);
}

// Step 4 (and 5 when kFuseOutput) on the state S [Kp, Vp], kStripCols columns at a time
// so each strip stays in L1 while it is read and rewritten. y is a [C, Vp] work buffer.
// Without kFuseOutput the chunk-start state is copied to saved_state for a later
// ChunkOutput.
template <class T, class M, bool kFuseOutput>
void AdvanceState(const Dims& dm, const ChunkData<T>& cd, T* S, T* y, T* v_new, T* out,
                  T* saved_state) {
  const int64_t Kp = dm.Kp, Vp = dm.Vp;
  const T* v = M::delta ? v_new : cd.u;  // linear: v_new = v
  for (int64_t n0 = 0; n0 < Vp; n0 += kStripCols) {
    const int64_t ns = std::min(kStripCols, Vp - n0);
    if constexpr (M::delta) {
      Gemm<T> ws;  // y = beta v - (beta k 2^Gamma) S
      ws.M = cd.rows;
      ws.N = ns;
      ws.P = Kp;
      ws.a = cd.w;
      ws.a_row = Kp;
      ws.a_col = 1;
      ws.b = S + n0;
      ws.ldb = Vp;
      ws.c = y + n0;
      ws.ldc = Vp;
      ws.init = cd.u + n0;
      ws.ld_init = Vp;
      RunGemm<true>(ws);
      Gemm<T> ty;  // v_new = T y
      ty.M = cd.rows;
      ty.N = ns;
      ty.P = cd.rows;
      ty.causal = true;
      ty.a = cd.t_inv;
      ty.a_row = dm.C;
      ty.a_col = 1;
      ty.b = y + n0;
      ty.ldb = Vp;
      ty.c = v_new + n0;
      ty.ldc = Vp;
      RunGemm<false>(ty);
    }
    if constexpr (kFuseOutput) {
      ChunkOutput(dm, cd, S, v, out, n0, ns);
    } else {
      for (int64_t i = 0; i < Kp; ++i)
        std::memcpy(saved_state + i * Vp + n0, S + i * Vp + n0, sizeof(T) * ns);
    }
    Gemm<T> up;  // S <- diag(decay) S + k^T v_new
    up.M = Kp;
    up.N = ns;
    up.P = cd.rows;
    up.a = cd.k;
    up.a_row = 1;
    up.a_col = Kp;
    up.b = v + n0;
    up.ldb = Vp;
    up.c = S + n0;
    up.ldc = Vp;
    up.init = S + n0;
    up.ld_init = Vp;
    up.row_scale = M::gate == GateKind::none ? nullptr : cd.decay;
    RunGemm<false>(up);
  }
}

// Zero-initialised aligned memory for one worker.
template <class T>
hwy::AlignedFreeUniquePtr<T[]> ZeroedBuffer(int64_t n) {
  n = std::max<int64_t>(n, 1);
  auto buf = hwy::AllocateAligned<T>(static_cast<size_t>(n));
  if (!buf)
    throw Error(ErrorCode::runtime, "chunk schedule: cannot allocate " +
                                        std::to_string(n * static_cast<int64_t>(sizeof(T))) +
                                        " bytes of work memory");
  std::fill(buf.get(), buf.get() + n, T(0));
  return buf;
}

template <class T>
void LoadState(const Problem& p, const StateView& sv, int64_t n, int64_t hv, const Dims& dm, T* S) {
  std::fill(S, S + dm.state_size(), T(0));
  if (!sv.t.present()) return;
  for (int64_t i = 0; i < p.K; ++i)
    load_row(sv.t, sv.offset(n, hv, i, 0), p.V, sv.value_step(), S + i * dm.Vp);
}

template <class T>
void StoreState(const Problem& p, const StateView& sv, int64_t n, int64_t hv, const Dims& dm,
                const T* S) {
  if (!sv.t.present()) return;
  for (int64_t i = 0; i < p.K; ++i)
    store_row(sv.t, sv.offset(n, hv, i, 0), p.V, sv.value_step(), S + i * dm.Vp);
}

// Output rows [t0, t0 + len) of sequence seq for value heads [hv0, hv0 + heads), token by
// token; head h's rows are at out + h * out_head_step, Vp apart.
template <class T>
void StoreOutputs(const Problem& p, const TensorView& o, const Sequence& seq, int64_t hv0,
                  int64_t heads, int64_t t0, int64_t len, const Dims& dm, const T* out,
                  int64_t out_head_step) {
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < heads; ++h)
      store_row(o, offset_of(o, seq.batch, seq.t0 + t0 + t, hv0 + h, 0), p.V, o.stride[3],
                out + h * out_head_step + t * dm.Vp);
}

template <class T>
std::vector<GateParams<T>> LoadGateParams(const Problem& p, int64_t hv0, int64_t heads) {
  std::vector<GateParams<T>> gp;
  for (int64_t h = 0; h < heads; ++h) gp.push_back(load_gate_params<T>(p, hv0 + h));
  return gp;
}

// Work split of the fused order (one place): an item is a sequence and a group of adjacent
// value heads, which run chunk by chunk in lockstep so their token rows are read together.
struct FusedSplit {
  int64_t heads = 1;   // value heads per item
  int64_t tokens = 0;  // tokens read per round (a multiple of C)

  FusedSplit(const Problem& p, const Dims& dm, int threads, int64_t elem_size) {
    // As many heads as keep every thread busy, up to 8 and about 1 MB of states.
    const int64_t state_bytes = dm.state_size() * elem_size;
    const int64_t cap = std::clamp<int64_t>((int64_t{1} << 20) / state_bytes, 1, 8);
    heads = std::clamp<int64_t>(p.N * p.HV / threads, 1, std::min(cap, p.HV));
    // About 256 KB of token rows per round.
    const int64_t row_bytes = (3 * dm.Kp + dm.Vp + 1) * elem_size;
    const int64_t chunks = (int64_t{256} << 10) / (heads * dm.C * row_bytes);
    tokens = dm.C * std::max<int64_t>(1, chunks);
  }
  int64_t groups_per_sequence(const Problem& p) const { return (p.HV + heads - 1) / heads; }
};

// One item start to end: per round, read the rows of all its heads, then per head steps 1-5
// chunk by chunk, then write the outputs of all its heads.
template <class T, class M>
void RunGroup(const Problem& p, const ForwardIO& io, const ChunkStateEntries& entries, int64_t n,
              int64_t hv0, int64_t heads, const FusedSplit& split, const Dims& dm) {
  const Sequence& seq = p.seqs[n];
  const int64_t state = dm.state_size(), cvp = dm.C * dm.Vp, out_step = split.tokens * dm.Vp;
  const int64_t staging_size = RowStaging<T>::size(dm, heads, split.tokens);
  auto buf = ZeroedBuffer<T>(heads * (state + out_step) + 2 * cvp + staging_size +
                             ChunkData<T>::size(dm) + PrepareScratch<T>::size(dm));
  Carver<T> carver(buf.get());
  T* states = carver.take(heads * state);
  T* out = carver.take(heads * out_step);
  T* y = carver.take(cvp);
  T* v_new = carver.take(cvp);
  RowStaging<T> rows(carver.take(staging_size), dm, p.gate, heads, split.tokens);
  ChunkData<T> cd = ChunkData<T>::carve(carver, dm);
  ChunkPreparer<T, M> prepare(
      p.scale, dm, PrepareScratch<T>::carve(carver.take(PrepareScratch<T>::size(dm)), dm));

  for (int64_t h = 0; h < heads; ++h)
    LoadState(p, io.initial_state, n, hv0 + h, dm, states + h * state);
  const std::vector<GateParams<T>> gp = LoadGateParams<T>(p, hv0, heads);
  for (int64_t s0 = 0; s0 < seq.len; s0 += split.tokens) {
    const int64_t len = std::min(split.tokens, seq.len - s0);
    rows.template load<Transforms>(p, gp, seq, hv0, s0, len, round_up(len, kBlock));
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t0 = 0; t0 < len; t0 += dm.C) {
        if (const int64_t entry = entries.before(n, s0 + t0); entry >= 0)
          StoreState(p, io.chunk_states, entry, hv0 + h, dm, states + h * state);
        prepare.run(rows.rows(h, t0), std::min(dm.C, len - t0), cd);
        AdvanceState<T, M, true>(dm, cd, states + h * state, y, v_new,
                                 out + h * out_step + t0 * dm.Vp, nullptr);
      }
    }
    StoreOutputs(p, io.o, seq, hv0, heads, s0, len, dm, out, out_step);
  }
  for (int64_t h = 0; h < heads; ++h)
    StoreState(p, io.final_state, n, hv0 + h, dm, states + h * state);
}

// Few items: windows of chunks, steps 1-3 and 5 parallel over chunks, 4 over items.
template <class T, class M>
void RunPhased(const Problem& p, const ForwardIO& io, const ChunkStateEntries& entries,
               const std::vector<int64_t>& items, int threads, const Dims& dm) {
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t state = dm.state_size(), cvp = dm.C * dm.Vp;
  // A slot holds one chunk between the phases: its ChunkData, v_new, start state, output.
  const int64_t slot = ChunkData<T>::size(dm) + 2 * cvp + state;
  int64_t max_chunks = 0;
  for (int64_t it : items)
    max_chunks = std::max(max_chunks, (p.seqs[it / p.HV].len + dm.C - 1) / dm.C);
  // Enough chunks per window for every thread, within about 64 MB of slots.
  const int64_t budget = std::max<int64_t>(
      1, (int64_t{64} << 20) / (slot * static_cast<int64_t>(sizeof(T)) * n_items));
  const int64_t window = std::max<int64_t>(1, std::min({max_chunks, int64_t{8} * threads, budget}));

  auto states = ZeroedBuffer<T>(n_items * (state + cvp));  // and y per item
  auto slots = ZeroedBuffer<T>(n_items * window * slot);
  struct Slot {
    ChunkData<T> cd;
    T *v_new, *start, *out;
  };
  std::vector<Slot> slot_of(static_cast<size_t>(n_items * window));
  for (int64_t s = 0; s < n_items * window; ++s) {
    Carver<T> c(slots.get() + s * slot);
    Slot& sl = slot_of[static_cast<size_t>(s)];
    sl.cd = ChunkData<T>::carve(c, dm);
    sl.v_new = c.take(cvp);
    sl.start = c.take(state);
    sl.out = c.take(cvp);
  }
  auto seq_of = [&](int64_t i) -> const Sequence& { return p.seqs[items[i] / p.HV]; };
  auto hv_of = [&](int64_t i) { return items[i] % p.HV; };
  auto len_of = [&](int64_t i, int64_t chunk) {
    return std::clamp<int64_t>(seq_of(i).len - chunk * dm.C, 0, dm.C);
  };
  for (int64_t i = 0; i < n_items; ++i)
    LoadState(p, io.initial_state, items[i] / p.HV, hv_of(i), dm, states.get() + i * state);

  for (int64_t w0 = 0; w0 < max_chunks; w0 += window) {
    std::vector<int64_t> tasks;  // slot index i * window + w of every chunk in this window
    for (int64_t i = 0; i < n_items; ++i)
      for (int64_t w = 0; w < window; ++w)
        if (len_of(i, w0 + w) > 0) tasks.push_back(i * window + w);
    const int64_t n_tasks = static_cast<int64_t>(tasks.size());
    const int64_t groups = std::min<int64_t>(n_tasks, threads);
    // Steps 1-3: contiguous runs of tasks per group, each with its own buffers.
    parallel_for(groups, threads, [&](int64_t g) {
      const int64_t staging_size = RowStaging<T>::size(dm, 1, dm.C);
      auto buf = ZeroedBuffer<T>(staging_size + PrepareScratch<T>::size(dm));
      RowStaging<T> rows(buf.get(), dm, p.gate, 1, dm.C);
      ChunkPreparer<T, M> prepare(p.scale, dm,
                                  PrepareScratch<T>::carve(buf.get() + staging_size, dm));
      std::vector<GateParams<T>> gp;
      int64_t gp_hv = -1;
      for (int64_t k = g * n_tasks / groups; k < (g + 1) * n_tasks / groups; ++k) {
        const int64_t s = tasks[static_cast<size_t>(k)], i = s / window, chunk = w0 + s % window;
        if (hv_of(i) != gp_hv) gp = LoadGateParams<T>(p, gp_hv = hv_of(i), 1);
        const int64_t len = len_of(i, chunk);
        rows.template load<Transforms>(p, gp, seq_of(i), hv_of(i), chunk * dm.C, len,
                                       round_up(len, kBlock));
        prepare.run(rows.rows(0, 0), len, slot_of[static_cast<size_t>(s)].cd);
      }
    });
    // Step 4: sequential over the window's chunks of each item.
    parallel_for(n_items, threads, [&](int64_t i) {
      for (int64_t w = 0; w < window && len_of(i, w0 + w) > 0; ++w) {
        Slot& sl = slot_of[static_cast<size_t>(i * window + w)];
        AdvanceState<T, M, false>(dm, sl.cd, states.get() + i * state,
                                  states.get() + n_items * state + i * cvp, sl.v_new, nullptr,
                                  sl.start);
      }
    });
    // Step 5, and the chunk-start states that are recorded.
    parallel_for(n_tasks, threads, [&](int64_t k) {
      const int64_t s = tasks[static_cast<size_t>(k)], i = s / window, chunk = w0 + s % window;
      Slot& sl = slot_of[static_cast<size_t>(s)];
      if (const int64_t entry = entries.before(items[i] / p.HV, chunk * dm.C); entry >= 0)
        StoreState(p, io.chunk_states, entry, hv_of(i), dm, sl.start);
      ChunkOutput(dm, sl.cd, sl.start, M::delta ? sl.v_new : sl.cd.u, sl.out, 0, dm.Vp);
      StoreOutputs(p, io.o, seq_of(i), hv_of(i), 1, chunk * dm.C, len_of(i, chunk), dm, sl.out, 0);
    });
  }
  for (int64_t i = 0; i < n_items; ++i)
    StoreState(p, io.final_state, items[i] / p.HV, hv_of(i), dm, states.get() + i * state);
}

template <class T, class M>
void Run(const Problem& p, const ForwardIO& io) {
  const Dims dm(p);
  const int threads = resolve_threads(p.options.num_threads);
  const ChunkStateEntries entries(p);
  if (threads > 1 && p.N * p.HV < threads) {
    std::vector<int64_t> items(static_cast<size_t>(p.N * p.HV));
    for (int64_t i = 0; i < p.N * p.HV; ++i) items[static_cast<size_t>(i)] = i;
    return RunPhased<T, M>(p, io, entries, items, threads, dm);
  }
  const FusedSplit split(p, dm, threads, sizeof(T));
  // Items (sequence, head group), longest sequences first so the dynamic schedule
  // balances mixed lengths.
  const int64_t per_seq = split.groups_per_sequence(p);
  std::vector<int64_t> items(static_cast<size_t>(p.N * per_seq));
  for (int64_t i = 0; i < p.N * per_seq; ++i) items[static_cast<size_t>(i)] = i;
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) {
    return p.seqs[a / per_seq].len > p.seqs[b / per_seq].len;
  });
  parallel_for(p.N * per_seq, threads, [&](int64_t i) {
    const int64_t item = items[static_cast<size_t>(i)], n = item / per_seq;
    const int64_t hv0 = item % per_seq * split.heads;
    RunGroup<T, M>(p, io, entries, n, hv0, std::min(split.heads, p.HV - hv0), split, dm);
  });
}

// The one switch from run-time flags to template arguments.
template <class T>
void RunMechanism(const Problem& p, const ForwardIO& io) {
  switch (p.gate) {
    case GateKind::none:
      return p.delta ? Run<T, Mech<GateKind::none, true>>(p, io)
                     : Run<T, Mech<GateKind::none, false>>(p, io);
    case GateKind::scalar:
      return p.delta ? Run<T, Mech<GateKind::scalar, true>>(p, io)
                     : Run<T, Mech<GateKind::scalar, false>>(p, io);
    case GateKind::vector:
      return p.delta ? Run<T, Mech<GateKind::vector, true>>(p, io)
                     : Run<T, Mech<GateKind::vector, false>>(p, io);
  }
}

// float64 inputs compute in double; every other dtype in float.
void ChunkForward(const Problem& p, const ForwardIO& io) {
  // Chunk states are recorded at chunk starts, which 128-token chunks have only at every
  // other 64-token boundary: such a call runs 64-token chunks (the same function).
  if (io.chunk_states.t.present() && p.options.chunk_size > kChunkStateTokens) {
    Problem at64 = p;
    at64.options.chunk_size = kChunkStateTokens;
    return ChunkForward(at64, io);
  }
  const TensorView* inputs[] = {&p.in.q, &p.in.k, &p.in.v, &p.in.g, &p.in.beta};
  bool f64 = false;
  for (const TensorView* t : inputs) f64 = f64 || (t->present() && t->dtype == DType::f64);
  if (f64)
    RunMechanism<double>(p, io);
  else
    RunMechanism<float>(p, io);
}

}  // namespace flashdelta::detail::chunk::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashdelta::detail {
namespace chunk {
HWY_EXPORT(ChunkForward);
void Forward(const Problem& p, const ForwardIO& io) { HWY_DYNAMIC_DISPATCH(ChunkForward)(p, io); }
}  // namespace chunk

void cpu_chunk_forward(const Problem& p, const ForwardIO& io) { chunk::Forward(p, io); }

}  // namespace flashdelta::detail
#endif  // HWY_ONCE
