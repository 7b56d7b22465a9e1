// The recurrent CPU schedule: token by token, for prefill (forward) and serving (decode).
//
// Work items are (sequence, value head, group of value tiles), run with parallel_for. Every
// value column of the state evolves independently given the token's k, g, beta and q, so an
// item keeps each K x W tile of its state in a dense fp32 buffer (recurrent_tile.h) and runs
// a block of tokens over one tile at a time while the tile sits in L1. The block's token
// inputs are packed once per item (recurrent_pack-inl.h) and shared by its tiles; the pass
// (recurrent_pass-inl.h) loads and stores each state row once per token. Decode on a float32
// K-first pool skips the tiles and streams each slot in place (recurrent_stream-inl.h).
//
// SIMD: Highway with run-time dispatch. Compiled targets: AVX3 (AVX-512), AVX2, SSE4 and the
// scalar baseline. SSSE3 is dropped (SSE4 covers every x86-64 CPU of the last 15 years) and
// AVX3_DL adds nothing to fp32 FMA code, so four targets keep the compile short. This must
// precede every Highway header.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_AVX3_DL)
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/chunk_states.h"
#include "core/parallel.h"
#include "core/tensor_io.h"
#include "cpu/cpu.h"
#include "cpu/recurrent_tile.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/recurrent.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// Per-target code: foreach_target.h compiles this file once per target.
#include "cpu/recurrent_pack-inl.h"
#include "cpu/recurrent_pass-inl.h"
#include "cpu/recurrent_stream-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashdelta::detail::HWY_NAMESPACE {
namespace {

// Tokens packed per block: their coefficients (about 2.5 KB per token at K = V = 128) stay
// in L2 while every tile of the item runs through them.
inline constexpr size_t kBlockTokens = 32;
static_assert(kBlockTokens + 1 <= TokenBlock::kMaxSlots, "the block holds a look-ahead token");
// Bytes of one state tile at most: half of a 32 KB L1, leaving room for the streamed
// coefficients (K = 128: 128 x 32 floats; K = 256: 256 x 16).
inline constexpr size_t kTileBytes = 16 * 1024;

inline size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

// How V is cut into tiles and tiles into work items, for one problem on this target.
struct TilePlan {
  size_t nv = 1;      // vectors per tile row
  size_t width = 1;   // W: columns per tile (a whole number of vectors)
  size_t tiles = 1;   // tiles covering V (the last one zero-padded)
  size_t groups = 1;  // work items per (sequence, head), each a contiguous range of tiles
  size_t kp = 1;      // K rounded up to whole vectors (packed coefficient rows)
};

TilePlan MakeTilePlan(const Problem& p) {
  const size_t lanes = hn::Lanes(FloatTag());
  const size_t K = static_cast<size_t>(p.K), V = static_cast<size_t>(p.V);
  TilePlan plan;
  plan.kp = RoundUp(K, lanes);
  const size_t fit = std::max<size_t>(1, kTileBytes / (sizeof(float) * K * lanes));
  plan.nv = std::min({kMaxTileVectors, fit, RoundUp(V, lanes) / lanes});
  plan.width = plan.nv * lanes;
  plan.tiles = RoundUp(V, plan.width) / plan.width;
  // Split V across items only when (sequence, head) pairs cannot feed every thread; a
  // split repeats the token packing per group.
  const size_t heads = static_cast<size_t>(p.N * p.HV);
  const size_t wanted = 4 * static_cast<size_t>(resolve_threads(p.options.num_threads));
  if (heads > 0 && heads < wanted)
    plan.groups = std::min(plan.tiles, RoundUp(wanted, heads) / heads);
  return plan;
}

struct WorkItem {
  int64_t n, hv;
  size_t tile_begin, tile_end;
};

// Items ordered longest sequence first, so uneven varlen batches balance across threads.
std::vector<WorkItem> MakeWorkItems(const Problem& p, const TilePlan& plan) {
  std::vector<int64_t> order(static_cast<size_t>(p.N));
  for (int64_t n = 0; n < p.N; ++n) order[static_cast<size_t>(n)] = n;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return p.seqs[x].len > p.seqs[y].len; });
  std::vector<WorkItem> items;
  items.reserve(order.size() * static_cast<size_t>(p.HV) * plan.groups);
  for (const int64_t n : order)
    for (int64_t hv = 0; hv < p.HV; ++hv)
      for (size_t g = 0; g < plan.groups; ++g)
        items.push_back({n, hv, g * plan.tiles / plan.groups, (g + 1) * plan.tiles / plan.groups});
  return items;
}

// Calls f.template operator()<NV, kDelta>() with the plan's tile width and the mechanism's
// write rule as template arguments.
template <class F>
void WithTileKernel(size_t nv, bool delta, F&& f) {
  static_assert(kMaxTileVectors == 2, "one branch per tile width");
  auto with_delta = [&]<size_t NV>() {
    if (delta) return f.template operator()<NV, true>();
    return f.template operator()<NV, false>();
  };
  if (nv == 2) return with_delta.template operator()<2>();
  return with_delta.template operator()<1>();
}

// Runs every token of sequence n on one work item's tiles.
//   load(tile, col0, cols):        fills a tile with the initial state of those columns;
//   materialize(t):                whether the state after token t is stored;
//   store(t, tile, col0, cols):    stores it (called only when materialize(t)).
template <size_t NV, bool kDelta, class Load, class Materialize, class Store>
void RunItem(const Problem& p, const TilePlan& plan, const WorkItem& item, const TensorView& o,
             Load&& load, Materialize&& materialize, Store&& store) {
  const Sequence& seq = p.seqs[static_cast<size_t>(item.n)];
  if (seq.len == 0) return;
  const size_t K = static_cast<size_t>(p.K), W = plan.width, kp = plan.kp;
  const size_t tiles = item.tile_end - item.tile_begin;
  const int64_t col0 = static_cast<int64_t>(item.tile_begin * W);
  const int64_t cols = std::min<int64_t>(p.V, static_cast<int64_t>(item.tile_end * W)) - col0;
  const size_t vpad = tiles * W;
  auto tile_col0 = [&](size_t j) { return col0 + static_cast<int64_t>(j * W); };
  auto tile_cols = [&](size_t j) { return std::min<int64_t>(W, col0 + cols - tile_col0(j)); };

  // Workspace: tiles | predictions | the block's reads | prologue c | token block | packer.
  const size_t slots = std::min<size_t>(kBlockTokens, static_cast<size_t>(seq.len)) + 1;
  const size_t lanes = hn::Lanes(FloatTag());
  const size_t scratch = RoundUp(TokenPacker::scratch_floats(kp, p.V), lanes);
  float* states = thread_workspace(tiles * K * W + tiles * W + slots * vpad + kp +
                                   TokenBlock::floats(slots, kp, vpad) + scratch);
  float* preds = states + tiles * K * W;
  float* outs = preds + tiles * W;  // token s of the block: outs + s * vpad
  float* prologue = outs + slots * vpad;
  TokenBlock block(prologue + kp, slots, kp, vpad);
  TokenPacker packer(p, item.hv, seq, col0, cols, static_cast<int64_t>(vpad), kp,
                     prologue + kp + TokenBlock::floats(slots, kp, vpad));

  for (size_t j = 0; j < tiles; ++j) load(states + j * K * W, tile_col0(j), tile_cols(j));
  packer.pack(0, materialize(0), block.slot(0), prologue);
  if constexpr (kDelta)
    for (size_t j = 0; j < tiles; ++j)
      PredictPass<NV>(prologue, K, states + j * K * W, preds + j * W);

  for (int64_t t0 = 0; t0 < seq.len;) {
    const size_t nb = static_cast<size_t>(std::min<int64_t>(kBlockTokens, seq.len - t0));
    for (size_t s = 1; s < nb; ++s)
      packer.pack(t0 + static_cast<int64_t>(s), materialize(t0 + static_cast<int64_t>(s)),
                  block.slot(s), block.slot(s - 1).c);
    const int64_t next = t0 + static_cast<int64_t>(nb);
    if (next < seq.len) packer.pack(next, materialize(next), block.slot(nb), block.slot(nb - 1).c);

    for (size_t j = 0; j < tiles; ++j) {
      float* S = states + j * K * W;
      for (size_t s = 0; s < nb; ++s) {
        const PackedToken& tok = block.slot(s);
        const int64_t t = t0 + static_cast<int64_t>(s);
        TokenPassFor<NV, kDelta>(tok.rebase, t + 1 < seq.len, {tok.a, tok.b, tok.c, tok.f}, K,
                                 tok.v + j * W, tok.beta, preds + j * W, S,
                                 outs + s * vpad + j * W);
        if (materialize(t)) store(t, S, tile_col0(j), tile_cols(j));
      }
    }
    // The reads leave in whole rows once the block is done: a store that misses the cache
    // inside the pass would hold up the tile's own stores behind it.
    for (size_t s = 0; s < nb; ++s)
      store_output_row(
          o, offset_of(o, seq.batch, seq.t0 + t0 + static_cast<int64_t>(s), item.hv, col0), cols,
          outs + s * vpad);
    if (next < seq.len) block.move_to_front(nb);
    t0 = next;
  }
}

}  // namespace

void RecurrentForward(const Problem& p, const ForwardIO& io) {
  const TilePlan plan = MakeTilePlan(p);
  const std::vector<WorkItem> items = MakeWorkItems(p, plan);
  const int64_t K = p.K;
  const int64_t W = static_cast<int64_t>(plan.width);
  const bool keep_final = io.final_state.t.present();
  const bool keep_chunks = io.chunk_states.t.present();
  const ChunkStateEntries entries(p);
  WithTileKernel(plan.nv, p.delta, [&]<size_t NV, bool kDelta>() {
    parallel_for(static_cast<int64_t>(items.size()), p.options.num_threads, [&](int64_t i) {
      const WorkItem& item = items[static_cast<size_t>(i)];
      const int64_t n = item.n, hv = item.hv, len = p.seqs[static_cast<size_t>(n)].len;
      auto load = [&](float* tile, int64_t col0, int64_t cols) {
        if (io.initial_state.t.present())
          load_state_tile(io.initial_state, n, hv, K, col0, cols, W, tile);
        else
          std::fill(tile, tile + K * W, 0.0f);
        // The initial state is the one entering the first chunk.
        if (keep_chunks && len > 0)
          store_state_tile(io.chunk_states, entries.before(n, 0), hv, K, col0, cols, W, tile);
      };
      // The chunk-state entry the state after token t goes to (the one entering the chunk
      // that starts at t + 1), or -1.
      auto chunk_after = [&](int64_t t) {
        return keep_chunks && t + 1 < len ? entries.before(n, t + 1) : int64_t{-1};
      };
      auto materialize = [&](int64_t t) {
        return (keep_final && t + 1 == len) || chunk_after(t) >= 0;
      };
      auto store = [&](int64_t t, const float* tile, int64_t col0, int64_t cols) {
        const int64_t entry = chunk_after(t);
        if (entry >= 0)
          store_state_tile(io.chunk_states, entry, hv, K, col0, cols, W, tile);
        else
          store_state_tile(io.final_state, n, hv, K, col0, cols, W, tile);
      };
      if (len == 0) {  // an empty sequence passes its state through
        if (!keep_final) return;
        float* tile = thread_workspace(static_cast<size_t>(K * W));
        for (size_t j = item.tile_begin; j < item.tile_end; ++j) {
          const int64_t col0 = static_cast<int64_t>(j) * W;
          load(tile, col0, std::min(W, p.V - col0));
          store_state_tile(io.final_state, n, hv, K, col0, std::min(W, p.V - col0), W, tile);
        }
        return;
      }
      RunItem<NV, kDelta>(p, plan, item, io.o, load, materialize, store);
    });
  });
}

namespace {

// Whether decode can update the pool slots in place (recurrent_stream-inl.h): float32
// K-first slots with dense rows of whole vectors, each row reading and writing one slot.
bool DecodesInPlace(const DecodeProblem& d) {
  const size_t lanes = hn::Lanes(FloatTag());
  return d.pool.t.dtype == DType::f32 && d.pool.layout == StateLayout::k_first &&
         d.pool.value_step() == 1 && !d.per_token_slots && static_cast<size_t>(d.p.V) % lanes == 0;
}

// Consecutive (row, head) pairs one in-place work item decodes, each prefetching the next.
inline constexpr size_t kDecodePairsPerItem = 8;

// Pool slot `slot` of value head hv as a K x V matrix with row stride key_step().
float* SlotState(const DecodeProblem& d, int64_t slot, int64_t hv) {
  return static_cast<float*>(d.pool.t.data) + d.pool.offset(slot, hv, 0, 0);
}

// All tokens of decode row n for value head hv, in place on pool slot `slot`; `next` is the
// state to prefetch during the last token (null for none).
template <bool kDelta>
void DecodeInPlace(const DecodeProblem& d, const TensorView& o, int64_t n, int64_t hv, int64_t slot,
                   const float* next) {
  const Problem& p = d.p;
  const Sequence& seq = p.seqs[static_cast<size_t>(n)];
  if (seq.len == 0) return;
  const size_t K = static_cast<size_t>(p.K), V = static_cast<size_t>(p.V);
  const size_t kp = RoundUp(K, hn::Lanes(FloatTag()));
  float* S = SlotState(d, slot, hv);
  const size_t ld = static_cast<size_t>(d.pool.key_step());

  // Workspace: prediction | r | one token's read | prologue c | two packed tokens | packer.
  float* pred = thread_workspace(3 * V + kp + TokenBlock::floats(2, kp, V) +
                                 TokenPacker::scratch_floats(kp, p.V));
  float* r = pred + V;
  float* out = r + V;
  float* prologue = out + V;
  TokenBlock block(prologue + kp, 2, kp, V);
  TokenPacker packer(p, hv, seq, 0, p.V, p.V, kp, prologue + kp + TokenBlock::floats(2, kp, V));

  packer.pack(0, true, block.slot(0), prologue);
  if constexpr (kDelta) StreamPredict(prologue, K, V, ld, S, pred);
  for (int64_t t = 0; t < seq.len; ++t) {
    const bool more = t + 1 < seq.len;
    if (more) packer.pack(t + 1, true, block.slot(1), block.slot(0).c);
    const PackedToken& tok = block.slot(0);
    StreamTokenPassFor<kDelta>(p.gate != GateKind::none, more, {tok.a, tok.b, tok.c, tok.f}, K, V,
                               ld, tok.v, tok.beta, pred, r, S, out, more ? nullptr : next);
    store_output_row(o, offset_of(o, seq.batch, seq.t0 + t, hv, 0), p.V, out);
    if (more) block.move_to_front(1);
  }
}

}  // namespace

void RecurrentDecode(const DecodeProblem& d, const TensorView& o) {
  const Problem& p = d.p;
  const bool in_place = DecodesInPlace(d);
  TilePlan plan = MakeTilePlan(p);
  if (in_place) plan.groups = 1;  // whole rows per item
  const std::vector<WorkItem> items = MakeWorkItems(p, plan);
  const int64_t K = p.K;
  const int64_t W = static_cast<int64_t>(plan.width);
  // In place, a work item is a run of pairs, so each knows which state it streams next.
  const size_t per_item = in_place ? kDecodePairsPerItem : 1;
  const int64_t num_items = static_cast<int64_t>((items.size() + per_item - 1) / per_item);
  WithTileKernel(plan.nv, p.delta, [&]<size_t NV, bool kDelta>() {
    parallel_for(num_items, p.options.num_threads, [&](int64_t i) {
      const size_t first = static_cast<size_t>(i) * per_item;
      const size_t last = std::min(items.size(), first + per_item);
      for (size_t e = first; e < last; ++e) {
        const WorkItem& item = items[e];
        const int64_t n = item.n, hv = item.hv;
        const int64_t start = decode_start_slot(d, n);
        if (start < 0) {  // padding row: zero outputs, pool untouched
          static const float kZeros[256] = {};
          const Sequence& seq = p.seqs[static_cast<size_t>(n)];
          const int64_t col0 = static_cast<int64_t>(item.tile_begin) * W;
          const int64_t cols = std::min(p.V, static_cast<int64_t>(item.tile_end) * W) - col0;
          for (int64_t t = seq.t0; t < seq.t0 + seq.len; ++t)
            store_output_row(o, offset_of(o, seq.batch, t, hv, col0), cols, kZeros);
          continue;
        }
        if (in_place) {
          const float* next = nullptr;
          if (e + 1 < last && decode_start_slot(d, items[e + 1].n) >= 0)
            next = SlotState(d, decode_start_slot(d, items[e + 1].n), items[e + 1].hv);
          DecodeInPlace<kDelta>(d, o, n, hv, start, next);
          continue;
        }
        auto load = [&](float* tile, int64_t col0, int64_t cols) {
          load_state_tile(d.pool, start, hv, K, col0, cols, W, tile);
        };
        auto materialize = [&](int64_t t) { return decode_slot_after(d, n, t) >= 0; };
        auto store = [&](int64_t t, const float* tile, int64_t col0, int64_t cols) {
          store_state_tile(d.pool, decode_slot_after(d, n, t), hv, K, col0, cols, W, tile);
        };
        RunItem<NV, kDelta>(p, plan, item, o, load, materialize, store);
      }
    });
  });
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace flashdelta::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashdelta::detail {

HWY_EXPORT(RecurrentForward);
HWY_EXPORT(RecurrentDecode);
HWY_EXPORT(TargetName);

void cpu_recurrent_forward(const Problem& p, const ForwardIO& io) {
  HWY_DYNAMIC_DISPATCH(RecurrentForward)(p, io);
}

void cpu_recurrent_decode(const DecodeProblem& d, const TensorView& o) {
  HWY_DYNAMIC_DISPATCH(RecurrentDecode)(d, o);
}

const char* cpu_simd_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace flashdelta::detail
#endif  // HWY_ONCE
