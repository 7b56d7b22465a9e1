// The two sequential scans of the CUDA backward (stages `states` and `dstates`,
// cuda/backward_params.h) in the forward state kernel's form (cuda/chunk_state.cuh), for
// K <= 128: one block per (sequence, value head, 64 or 128 value columns), each pair of warps
// carrying 16 columns of the state or its gradient, transposed, in float32 tensor-core
// accumulators through the chunks: one warp the first KP / 2 keys, its partner the rest.
// Sums over the keys (S^T w^T, dS'^T kg^T) are added across the pair through shared memory.
// Halving each warp's chain of dependent products per chunk and doubling the warps per SM is
// what the scans' per-chunk latency (the whole of their time at B = 1) asks for; a block
// takes one SM (its shared memory), so where 64-column blocks would be more than one per SM
// 128-column blocks of 16 warps run them as one wave (BackwardParams::mma_cols). While a
// chunk is computed, the next chunk's record is prefetched into L2. `states`, first to last:
//     v_new^T = u^T - S^T w^T                  S^T = S^T diag(decay) + v_new^T kg
// `dstates`, last to first:
//     dv_new^T = dO^T A_qk + dS'^T kg^T        dS^T = dS'^T diag(decay) + dO^T qg - dv_new^T w
// They write what the tile scans (cuda/backward_scan.cu) write: the state entering every
// chunk and v_new; dS' (the gradient of the state leaving every chunk), dv_new and the initial
// state's gradient. A chunk's float32 record rows are staged in shared memory once and read
// by every warp; a warp's products read only the stage and its own registers. Products are
// m16n8k8 tf32 (rounded to nearest) with float32 sums, as everywhere in the backward.
//
// Split sequences (BackwardParams::segments > 1, when the blocks above are too few to fill the
// GPU, DESIGN.md section 3): over a segment a column of the state (or of its gradient) moves
// by an affine map, x_out = P x_in + e, the same P for every column. A first kernel
// (kEnds) runs every segment from a zero state, giving e for the V columns, and from the
// identity with no inhomogeneous terms (u, dO zero), giving P's K columns; the second runs
// every segment from its true entry, which it first carries across the segments before it
// (S^T <- S^T P^T + e^T, in the same tensor-core form as the chunks' products). The
// critical path goes from the chunks of a sequence to those of a segment, twice, plus one
// carry per earlier segment. Where both scans are split, the dstates scan's P is the states
// scan's transposed (BackwardParams::transposed_maps): its maps kernel forms only e.
//
// A left operand taken from accumulators: m16n8k8 gives a lane the A elements at k-slots c
// and c + 4 (c = lane % 4), while an n8 accumulator tile holds its columns 2c and 2c + 1. So
// every product here maps k-slot c to index 2c and slot c + 4 to index 2c + 1 of its 8-wide
// k-step, in the right operand too: the same terms summed, with no shuffles.
#include <cuda_runtime.h>

#include "cuda/backward_common.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kKeyHalves = 2;  // warps per 16 columns, each over its share of the keys
constexpr int kTokenTiles = kC / 8;

// A block of kCols value columns (BackwardParams::mma_cols), 16 per pair of warps: 64
// columns in 8 warps, or 128 in 16 (two 64-column blocks' work on one stage of the record's
// key rows, for one wave where 64-column blocks would take two).
template <int kCols>
struct ScanShape {
  static_assert(kCols == 64 || kCols == 128, "the scans' block widths");
  static constexpr int kColumnWarps = kCols / 16;  // warp w's partner is w ^ kColumnWarps
  static constexpr int kWarps = kColumnWarps * kKeyHalves;
  static constexpr int kThreads = 32 * kWarps;
};

// kWarps warps' partial sums of their 16-column x kC-token tiles, for the partners to add.
template <int kWarps>
using WarpSums = float4[kWarps][kTokenTiles][32];
template <int kCols>
using Exchange = WarpSums<ScanShape<kCols>::kWarps>;
constexpr int kExchangeSlice = kTokenTiles * 32 * sizeof(float4);  // bytes per warp

__host__ __device__ inline int64_t mma_column_tiles(int64_t V, int cols = 64) {
  return (V + cols - 1) / cols;
}

// One chunk's operands. Row lengths are 4 mod 32 floats where a lane reads rows 2c and 2c + 1
// at column g (the 32 lanes in distinct banks), 8 mod 32 where it reads a float2 at (row g,
// column 2c).
template <int KP, int kCols>
struct alignas(16) StatesShared {
  float w[kC][KP + 8];     // [token][key]
  float kg[kC][KP + 4];    // [token][key]
  float u[kC][kCols + 4];  // [token][column]
  float decay[KP];
  Exchange<kCols> xch;
};

// dO rows of a block's columns.
template <int kCols>
using DoutTile = float[kC][kCols + 4];  // [token][column]

template <int KP, int kCols>
struct alignas(16) DstatesShared {
  float kg[kC][KP + 8];   // [token][key]
  float qg[kC][KP + 4];   // [token][key]
  float w[kC][KP + 4];    // [token][key]
  float aqk[kC][kC + 4];  // [r][i], zero right of the diagonal
  DoutTile<kCols> dout;
  float decay[KP];
  Exchange<kCols> xch;
};

// Queues the record's decay per key into dst (zeros past K), with the stage's copies.
template <int KP>
__device__ void stage_decay(const BackwardParams& b, int64_t rec, float* dst) {
  for (int e = threadIdx.x; e < KP; e += blockDim.x) {
    if (e < b.p.K)
      copy_async<4>(dst + e, b.ws.decay + rec * b.p.K + e, 4);
    else
      dst[e] = 0.f;
  }
}

// The A fragment of dO^T (the warp's 16 columns from `col0` x tokens 8 kt ..) in the
// permuted k order.
template <int kCols>
__device__ __forceinline__ void dout_fragment(const DoutTile<kCols>& dout, int kt, int col0,
                                              uint32_t (&a)[4]) {
  const int g = threadIdx.x % 32 / 4, c = threadIdx.x % 4, t = 8 * kt + 2 * c;
  a[0] = to_tf32(dout[t][col0 + g]);
  a[1] = to_tf32(dout[t][col0 + g + 8]);
  a[2] = to_tf32(dout[t + 1][col0 + g]);
  a[3] = to_tf32(dout[t + 1][col0 + g + 8]);
}

// The A fragment of an accumulator tile (sign = -1 for its negative), in the permuted order.
__device__ __forceinline__ void acc_fragment(const Acc& x, float sign, uint32_t (&a)[4]) {
  a[0] = to_tf32(sign * x.d[0]);
  a[1] = to_tf32(sign * x.d[2]);
  a[2] = to_tf32(sign * x.d[1]);
  a[3] = to_tf32(sign * x.d[3]);
}

// acc[nt] += a . B(k-step kt, n-tile nt) for a row-major [k][n] operand x (row length ld).
template <int kTiles>
__device__ __forceinline__ void times_kn(Acc (&acc)[kTiles], const uint32_t (&a)[4],
                                         const float* x, int ld, int kt) {
  const int g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
  const float* r0 = x + (8 * kt + 2 * c) * ld + g;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt)
    mma_tf32(acc[nt], a, to_tf32(r0[8 * nt]), to_tf32(r0[ld + 8 * nt]));
}

// Column tiles of the segment-ends kernel: V's, then the identity's K.
__host__ __device__ inline int64_t map_column_tiles(int64_t K, int64_t V) {
  return mma_column_tiles(V) + mma_column_tiles(K);
}
// ... of the dstates scan's: V's alone where P comes from the states scan's maps.
__host__ __device__ inline int64_t dstates_ends_tiles(const BackwardParams& b) {
  return b.transposed_maps ? mma_column_tiles(b.p.V) : map_column_tiles(b.p.K, b.p.V);
}

// The scans' block: sequence n, value head hv, segment seg (its chunks [c0, c1)), `columns`
// columns (ScanShape) from j0 of V or, in the segment-ends kernel, of the identity (`map`);
// this warp's 16 from jw, and its share `half` of the keys. Warps w and w ^ (columns / 16)
// carry the same columns. Blocks are numbered ((n * HV + hv) * segments + seg) * tiles + tile.
struct MmaScanBlock : ScanChunks {
  static_assert(kKeyHalves == 2, "a warp and its partner");
  int64_t j0, jw;
  int columns;  // the block's width, a compile-time constant where the kernel inlines this
  int wc;       // the warp's first column in the block's tile
  int half;     // 0: keys [0, KP / 2), 1: the rest
  bool map;     // the identity's columns: P of the segment map
  int64_t width;  // V, or K for the identity's columns
  int64_t seg, c0, c1;
  int64_t used;  // segments of the sequence that hold chunks

  __device__ MmaScanBlock(const BackwardParams& b, int64_t tiles, int block_columns)
      : ScanChunks(b, tiles * b.segments), columns(block_columns) {
    const int warp = static_cast<int>(threadIdx.x / 32), column_warps = columns / 16;
    const int64_t tile = blockIdx.x % tiles, value_tiles = mma_column_tiles(b.p.V, columns);
    map = tile >= value_tiles;
    width = map ? b.p.K : b.p.V;
    j0 = (map ? tile - value_tiles : tile) * columns;
    wc = 16 * (warp % column_warps);
    half = warp / column_warps;
    jw = j0 + wc;
    seg = blockIdx.x / tiles % b.segments;
    const int64_t per = b.segments > 1 ? b.segment_chunks : chunks.count;
    used = per > 0 ? (chunks.count + per - 1) / per : 0;
    c0 = seg * per;
    c1 = chunks.count < c0 + per ? chunks.count : c0 + per;
  }
  // Columns of the block's tile inside its width.
  __device__ int cols() const {
    return static_cast<int>(width - j0 < columns ? width - j0 : columns);
  }
  // Segment s's map: K rows of V + K floats.
  __device__ float* segment_map(const BackwardParams& b, int64_t s) const {
    return b.ws.segment_maps + ((n * b.p.HV + hv) * b.segments + s) * b.p.K * (b.p.V + b.p.K);
  }
};

// A warp's 16 columns x KP / 2 keys of a K x V state, transposed: acc[nt].d[e] is element
// (key key0 + 8 nt + acc_col(e), column jw + acc_row(e)).
template <int KP>
struct MmaState {
  static constexpr int kKeys = KP / kKeyHalves;  // per warp
  Acc acc[kKeys / 8];
  int key0;

  __device__ explicit MmaState(const MmaScanBlock& blk) : key0(blk.half * kKeys) {}

  // f(value, key, column) for each of this lane's elements inside K x the block's width.
  template <class F>
  __device__ void for_each(const BackwardParams& b, const MmaScanBlock& blk, F&& f) {
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * nt + acc_col(e);
        const int64_t col = blk.jw + acc_row(e);
        if (key < b.p.K && col < blk.width) f(acc[nt].d[e], key, col);
      }
  }
  // Entry (n, hv) of a state the caller gave (any layout and float dtype; zeros if absent).
  __device__ void load(const BackwardParams& b, const StateTensor& s, DType dtype,
                       const MmaScanBlock& blk) {
    if (s.data)
      for_each(b, blk, [&](float& x, int key, int64_t col) {
        x = load_float(s.data, dtype, state_offset(s, blk.n, blk.hv, key, col));
      });
  }
  __device__ void store(const BackwardParams& b, const StateTensor& s, DType dtype,
                        const MmaScanBlock& blk) {
    if (s.data)
      for_each(b, blk, [&](float& x, int key, int64_t col) {
        store_float(s.data, dtype, state_offset(s, blk.n, blk.hv, key, col), x);
      });
  }
  // To a record's K x V K-first slab of the workspace (none if `store` is false), while the
  // chunk's stage (its copies queued by every thread) lands; returns once it has landed for
  // every thread. A lane's float32 stores are whole 32-byte sectors with its quad's; its
  // bfloat16 ones would be half sectors (states 0.758 -> 0.844 ms a B8 step, bench/NOTES.md
  // (ao)), so those pass through the warp's slice of the exchange, free here (the chunk's
  // barrier is behind, vn's exchange ahead), and leave as 16-byte runs.
  template <int kWarps>
  __device__ void store_record_while_staging(const BackwardParams& b, const MmaScanBlock& blk,
                                             bool store, const StateSlab& out,
                                             WarpSums<kWarps>& xch) {
    commit_async();
    const int64_t V = b.p.V;
    if (store && out.b16)
      store_bf16_by_runs(b, blk, out.b16, reinterpret_cast<uint16_t*>(&xch[threadIdx.x / 32]));
    else if (store)
      for_each(b, blk, [&](float& x, int key, int64_t col) { out.f32[key * V + col] = x; });
    wait_async<0>();
    __syncthreads();
  }
  // The warp's 16 columns x kKeys keys into a bfloat16 slab through tile, [key][16] with the
  // two 16-byte runs of a row swapped by key bit 2 (the lanes' 2-byte writes in distinct words
  // or sharing one, the reads conflict-free); element by element where V leaves a run short
  // or misaligned.
  __device__ void store_bf16_by_runs(const BackwardParams& b, const MmaScanBlock& blk,
                                     uint16_t* slab, uint16_t* tile) {
    static_assert(kKeys * 16 * 2 <= kExchangeSlice, "a warp's slice");
    const int64_t V = b.p.V;
    if (V % 8 != 0 || blk.jw + 16 > V) {
      for_each(b, blk, [&](float& x, int key, int64_t col) { slab[key * V + col] = bf16_bits(x); });
      return;
    }
    const auto run_at = [](int key, int run) { return key * 16 + (run ^ (key >> 2 & 1)) * 8; };
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 8 * nt + acc_col(e), col = acc_row(e);
        tile[run_at(key, col / 8) + col % 8] = bf16_bits(acc[nt].d[e]);
      }
    __syncwarp();
#pragma unroll
    for (int q = threadIdx.x % 32; q < 2 * kKeys; q += 32) {
      const int key = q / 2, run = q % 2;
      if (key0 + key < b.p.K)
        *reinterpret_cast<uint4*>(slab + (key0 + key) * V + blk.jw + 8 * run) =
            *reinterpret_cast<const uint4*>(tile + run_at(key, run));
    }
    __syncwarp();
  }
  // The identity's columns (a map block's start), or zeros.
  __device__ void start(const BackwardParams& b, const MmaScanBlock& blk) {
    if (blk.map) for_each(b, blk, [](float& x, int key, int64_t col) { x = key == col; });
  }
  // The segment's end, into its map (columns V .. V + K - 1 for the identity's).
  __device__ void store_segment_end(const BackwardParams& b, const MmaScanBlock& blk) {
    const int64_t ld = b.p.V + b.p.K;
    float* m = blk.segment_map(b, blk.seg) + (blk.map ? b.p.V : 0);
    for_each(b, blk, [&](float& x, int key, int64_t col) { m[key * ld + col] = x; });
  }
  // acc *= decay along the keys (d indexed by key).
  __device__ void decay(const float* d) {
    const int c = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
      const float2 x = *reinterpret_cast<const float2*>(&d[key0 + 8 * nt + 2 * c]);
      acc[nt].d[0] *= x.x, acc[nt].d[1] *= x.y, acc[nt].d[2] *= x.x, acc[nt].d[3] *= x.y;
    }
  }
};

// state^T += sign * tokens^T . x over the chunk's tokens, for a row-major [token][key] operand
// x (row length ld, 4 mod 32) at the warp's keys: the state updates whose left operand is a
// token tile held in accumulators (v_new, dv_new).
template <int KP>
__device__ __forceinline__ void add_tokens_times_rows(MmaState<KP>& S,
                                                      const Acc (&tokens)[kTokenTiles],
                                                      float sign, const float* x, int ld) {
#pragma unroll
  for (int kt = 0; kt < kTokenTiles; ++kt) {
    uint32_t a[4];
    acc_fragment(tokens[kt], sign, a);
    times_kn(S.acc, a, x + S.key0, ld, kt);
  }
}

// tokens[nt] += state^T . x^T over the warp's keys for a row-major [token][key] operand x
// (row length ld, 8 mod 32): the products that take the state as their left operand.
template <int KP>
__device__ __forceinline__ void state_times_rows(Acc (&tokens)[kTokenTiles],
                                                 const MmaState<KP>& S, const float* x, int ld) {
  const int g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
  x += S.key0;
#pragma unroll
  for (int kt = 0; kt < MmaState<KP>::kKeys / 8; ++kt) {
    uint32_t a[4];
    acc_fragment(S.acc[kt], 1.f, a);
#pragma unroll
    for (int nt = 0; nt < kTokenTiles; ++nt) {
      const float2 v = *reinterpret_cast<const float2*>(&x[(8 * nt + g) * ld + 8 * kt + 2 * c]);
      mma_tf32(tokens[nt], a, to_tf32(v.x), to_tf32(v.y));
    }
  }
}

// Adds the partner warp's partial sums (the other keys) to a 16-column x kC-token tile; both
// warps end with the same sums (a + b == b + a in floating point).
template <int kWarps>
__device__ void add_partner(Acc (&t)[kTokenTiles], WarpSums<kWarps>& xch) {
  constexpr int kPairs = kWarps / kKeyHalves;  // warp w's partner is w ^ kPairs
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < kTokenTiles; ++nt)
    xch[warp][nt][lane] = make_float4(t[nt].d[0], t[nt].d[1], t[nt].d[2], t[nt].d[3]);
  // The pair's own barrier (ids 1 .. kPairs; 0 is __syncthreads): 64 threads.
  static_assert(kPairs < 16, "named barriers");
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp % kPairs) : "memory");
#pragma unroll
  for (int nt = 0; nt < kTokenTiles; ++nt) {
    const float4 p = xch[warp ^ kPairs][nt][lane];
    t[nt].d[0] += p.x, t[nt].d[1] += p.y, t[nt].d[2] += p.z, t[nt].d[3] += p.w;
  }
}

// The rounds both carries below share: kC keys of the result at a time, their operand staged
// into the scan's stage by stage_round(map, r) (cp.async), formed over the warp's keys by
// product(t) and summed with the partner's; each warp keeps the rows of its own keys, then
// adds e (the map's first V columns). Starts and ends with a block barrier: the stage and
// the exchange are free after.
template <int KP, int kWarps, class StageRound, class Product>
__device__ void carry_rounds(const BackwardParams& b, const MmaScanBlock& blk, int64_t s,
                             MmaState<KP>& S, WarpSums<kWarps>& xch, StageRound stage_round,
                             Product product) {
  constexpr int kTiles = MmaState<KP>::kKeys / 8;
  const int64_t ld = b.p.V + b.p.K;
  const float* m = blk.segment_map(b, s);
  Acc next[kTiles];
#pragma unroll
  for (int r = 0; r * kC < KP; ++r) {
    __syncthreads();
    stage_round(m, r);
    commit_async();
    wait_async<0>();
    __syncthreads();
    Acc t[kTokenTiles];
    product(t);
    add_partner(t, xch);
#pragma unroll
    for (int nt = 0; nt < kTokenTiles; ++nt)
#pragma unroll
      for (int kt = 0; kt < kTiles; ++kt)
        if (r * kC + 8 * nt == S.key0 + 8 * kt) next[kt] = t[nt];
  }
#pragma unroll
  for (int kt = 0; kt < kTiles; ++kt) S.acc[kt] = next[kt];
  S.for_each(b, blk, [&](float& x, int key, int64_t col) { x += m[key * ld + col]; });
  __syncthreads();
}

// S^T = S^T P^T + e^T: the state carried across segment s by its map (P, e). P's rows (the
// result's keys) go through `stage` (kC rows of KP + 8 floats) kC at a time, as the
// left-operand products of the chunks do with w or kg.
template <int KP, int kWarps>
__device__ void carry_across_segment(const BackwardParams& b, const MmaScanBlock& blk, int64_t s,
                                     MmaState<KP>& S, float* stage, WarpSums<kWarps>& xch) {
  const int64_t K = b.p.K, ld = b.p.V + K;
  carry_rounds<KP>(
      b, blk, s, S, xch,
      [&](const float* m, int r) {
        const int rows = static_cast<int>(K - r * kC < kC ? K - r * kC : kC);
        stage_rows(stage, KP + 8, kC, KP, m + r * kC * ld + b.p.V, ld, rows, static_cast<int>(K));
      },
      [&](Acc (&t)[kTokenTiles]) { state_times_rows(t, S, stage, KP + 8); });
}

// dS^T = dS^T P + e^T: the gradient carried back across segment s by the transpose of the
// states scan's map P of the segment (BackwardParams::transposed_maps) and its own e. P's
// columns (the result's keys) go through `stage` kC at a time as KP rows (every source key)
// of kC + 4 floats: the right operand of the warp's own keys, as in the state updates.
template <int KP, int kWarps>
__device__ void carry_by_transposed_map(const BackwardParams& b, const MmaScanBlock& blk,
                                        int64_t s, MmaState<KP>& S, float* stage,
                                        WarpSums<kWarps>& xch) {
  constexpr int kTiles = MmaState<KP>::kKeys / 8, kLd = kC + 4;
  const int64_t K = b.p.K, ld = b.p.V + K;
  carry_rounds<KP>(
      b, blk, s, S, xch,
      [&](const float* m, int r) {
        const int cols = static_cast<int>(K - r * kC < kC ? K - r * kC : kC);
        stage_rows(stage, kLd, KP, kC, m + b.p.V + r * kC, ld, static_cast<int>(K), cols);
      },
      [&](Acc (&t)[kTokenTiles]) {
#pragma unroll
        for (int kt = 0; kt < kTiles; ++kt) {
          uint32_t a[4];
          acc_fragment(S.acc[kt], 1.f, a);
          times_kn(t, a, stage + S.key0 * kLd, kLd, kt);
        }
      });
}

// Calls f(value, token, column) for this lane's elements of the warp's half of a 16 x kC
// token tile (the partner writes the other) that lie inside the chunk (token < len) and V.
template <class F>
__device__ void for_each_token(const Acc (&t)[kTokenTiles], const BackwardParams& b, int len,
                               const MmaScanBlock& blk, F&& f) {
  constexpr int kHalf = kTokenTiles / kKeyHalves;
#pragma unroll
  for (int nt = 0; nt < kTokenTiles; ++nt) {
    if (nt / kHalf != blk.half) continue;  // constant register indices: no local memory
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 8 * nt + acc_col(e);
      const int64_t col = blk.jw + acc_row(e);
      if (i < len && col < b.p.V) f(t[nt].d[e], i, col);
    }
  }
}

// Queues a record's kC x K float32 [token][key] rows (`len` of them) into a stage, zeros past
// len and K.
template <int kCols, int KP, int kLd>
__device__ __forceinline__ void stage_key_rows(const float* src, int64_t K, int len,
                                               float (*dst)[kLd]) {
  stage_row_runs<ScanShape<kCols>::kThreads, KP, kC>(src, K, len, static_cast<int>(K), 0, dst);
}

// Queues the states scan's operands of chunk ci (len tokens): those of v_new (w, u) and
// those of the update (kg, decay).
template <int KP, int kCols>
__device__ void stage_states_operands(const BackwardParams& b, const MmaScanBlock& blk,
                                      int64_t ci, int len, StatesShared<KP, kCols>& sh) {
  const int64_t K = b.p.K, V = b.p.V, rec = blk.record(b, ci);
  if (b.p.delta) stage_key_rows<kCols, KP>(b.ws.w + rec * kC * K, K, len, sh.w);
  if (!blk.map)
    stage_row_runs<ScanShape<kCols>::kThreads, kCols, kC>(b.ws.u + rec * kC * V + blk.j0, V,
                                                          len, blk.cols(), 0, sh.u);
  stage_key_rows<kCols, KP>(b.ws.kg + rec * kC * K, K, len, sh.kg);
  stage_decay<KP>(b, rec, sh.decay);
}
// L2 prefetches of chunk ci's operands (none past the segment).
__device__ void prefetch_states_operands(const BackwardParams& b, const MmaScanBlock& blk,
                                         int64_t ci) {
  const int len = ci < blk.c1 ? blk.len(ci) : 0;
  if (len == 0) return;
  const int64_t K = b.p.K, V = b.p.V, r = blk.record(b, ci);
  if (b.p.delta) prefetch_rows(b.ws.w + r * kC * K, K, len, K);
  prefetch_rows(b.ws.kg + r * kC * K, K, len, K);
  if (!blk.map) prefetch_rows(b.ws.u + r * kC * V + blk.j0, V, len, blk.cols());
}

// v_new^T = u^T - S^T w^T (the linear rule: v_new = u; u is zero for a map's columns), summed
// over the pair's keys.
template <int KP, int kCols>
__device__ void vn_phase(const BackwardParams& b, const MmaScanBlock& blk, const MmaState<KP>& S,
                         StatesShared<KP, kCols>& sh, Acc (&vn)[kTokenTiles]) {
  if (b.p.delta) {
    state_times_rows(vn, S, &sh.w[0][0], KP + 8);
    add_partner(vn, sh.xch);
  }
#pragma unroll
  for (int nt = 0; nt < kTokenTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      vn[nt].d[e] = (blk.map ? 0.f : sh.u[8 * nt + acc_col(e)][blk.wc + acc_row(e)]) - vn[nt].d[e];
}

// v_new out (kStore); S^T = S^T diag(decay) + v_new^T kg.
template <bool kStore, int KP, int kCols>
__device__ void state_update_phase(const BackwardParams& b, const MmaScanBlock& blk, int len,
                                   int64_t rec, MmaState<KP>& S,
                                   const StatesShared<KP, kCols>& sh,
                                   const Acc (&vn)[kTokenTiles]) {
  const int64_t V = b.p.V;
  float* out = b.ws.vn + rec * kC * V;
  if (kStore)
    for_each_token(vn, b, len, blk, [&](float x, int i, int64_t col) { out[i * V + col] = x; });
  S.decay(sh.decay);
  add_tokens_times_rows(S, vn, 1.f, &sh.kg[0][0], KP + 4);
}

// kEnds: the maps of every segment but a sequence's last, and with transposed_maps the last
// one's P too (nothing else written); otherwise the states of every segment's chunks, from
// its true entry.
template <int KP, int kCols, bool kEnds>
__global__ void __launch_bounds__(ScanShape<kCols>::kThreads, 1)
    states_mma_kernel(const BackwardParams b) {
  static_assert(!kEnds || kCols == 64, "the segment maps' tiles are 64 columns wide");
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sh = *reinterpret_cast<StatesShared<KP, kCols>*>(smem);
  const MmaScanBlock blk(
      b, kEnds ? map_column_tiles(b.p.K, b.p.V) : mma_column_tiles(b.p.V, kCols), kCols);
  // The maps of a sequence's last segment are not needed here; its P is by the dstates scan.
  const bool last_wanted = b.transposed_maps && blk.map;
  if (kEnds ? blk.seg >= blk.used || (blk.seg + 1 == blk.used && !last_wanted)
            : blk.seg > 0 && blk.seg >= blk.used)
    return;
  MmaState<KP> S(blk);
  if (kEnds) {
    S.start(b, blk);
  } else {
    S.load(b, b.p.state_in, b.state_in_dtype, blk);
    for (int64_t s = 0; s < blk.seg; ++s) carry_across_segment(b, blk, s, S, &sh.w[0][0], sh.xch);
  }
  for (int64_t ci = blk.c0; ci < blk.c1; ++ci) {
    const int len = blk.len(ci);
    if (len == 0) continue;  // defensive, as in the tile scan
    const int64_t rec = blk.record(b, ci);
    stage_states_operands(b, blk, ci, len, sh);
    prefetch_states_operands(b, blk, ci + 1);
    // The state entering the chunk, written while the stage lands.
    S.store_record_while_staging(b, blk, !kEnds, states_slab(b, rec), sh.xch);
    Acc vn[kTokenTiles];
    vn_phase(b, blk, S, sh, vn);
    state_update_phase<!kEnds>(b, blk, len, rec, S, sh, vn);
    __syncthreads();  // every warp is done with the stage before the next chunk's copies
  }
  if (kEnds) S.store_segment_end(b, blk);
}

// Queues the dstates scan's operands of chunk ci (len tokens): those of dv_new (kg, A_qk,
// dO) and those of the update (qg, w, decay).
template <int KP, int kCols>
__device__ void stage_dstates_operands(const BackwardParams& b, const MmaScanBlock& blk,
                                       int64_t ci, int len, DstatesShared<KP, kCols>& sh) {
  constexpr int kThreads = ScanShape<kCols>::kThreads;
  const int64_t K = b.p.K, V = b.p.V, HV = b.p.HV, rec = blk.record(b, ci);
  stage_key_rows<kCols, KP>(b.ws.kg + rec * kC * K, K, len, sh.kg);
  if (!blk.map) {  // the dO terms; a map's columns have none
    stage_row_runs<kThreads, kC, kC>(b.ws.aqk + rec * kC * kC, kC, len, kC, 0, sh.aqk);
    stage_row_runs<kThreads, kCols, kC>(b.ws.dout + (blk.row0(b, ci) * HV + blk.hv) * V + blk.j0,
                                        HV * V, len, blk.cols(), 0, sh.dout);
    stage_key_rows<kCols, KP>(b.ws.qg + rec * kC * K, K, len, sh.qg);
  }
  if (b.p.delta) stage_key_rows<kCols, KP>(b.ws.w + rec * kC * K, K, len, sh.w);
  stage_decay<KP>(b, rec, sh.decay);
}
// L2 prefetches of chunk ci's operands (none before the segment).
__device__ void prefetch_dstates_operands(const BackwardParams& b, const MmaScanBlock& blk,
                                          int64_t ci) {
  const int len = ci >= blk.c0 ? blk.len(ci) : 0;
  if (len == 0) return;
  const int64_t K = b.p.K, V = b.p.V, HV = b.p.HV, r = blk.record(b, ci);
  prefetch_rows(b.ws.kg + r * kC * K, K, len, K);
  if (b.p.delta) prefetch_rows(b.ws.w + r * kC * K, K, len, K);
  if (blk.map) return;
  prefetch_rows(b.ws.qg + r * kC * K, K, len, K);
  prefetch_rows(b.ws.aqk + r * kC * kC, kC, len, kC);
  prefetch_rows(b.ws.dout + (blk.row0(b, ci) * HV + blk.hv) * V + blk.j0, HV * V, len,
                blk.cols());
}

// dv_new^T = dO^T A_qk + dS'^T kg^T, the first term (none for a map's columns) by the first
// warp of the pair, the second summed over the pair's keys. A_qk[r][i] is zero for i > r:
// k-step kt (tokens 8 kt ..) reaches token tiles nt <= kt. (Splitting the first term's
// k-steps 18/18 tiles over the pair measured 4% slower: bench/NOTES.md (ab).)
template <int KP, int kCols>
__device__ void dv_phase(const MmaScanBlock& blk, const MmaState<KP>& S,
                         DstatesShared<KP, kCols>& sh, Acc (&dv)[kTokenTiles]) {
  const int c = threadIdx.x % 4, g = threadIdx.x % 32 / 4;
  if (blk.half == 0 && !blk.map) {
#pragma unroll
    for (int kt = 0; kt < kTokenTiles; ++kt) {
      uint32_t a[4];
      dout_fragment<kCols>(sh.dout, kt, blk.wc, a);
      const float* r = &sh.aqk[8 * kt + 2 * c][g];
#pragma unroll
      for (int nt = 0; nt <= kt; ++nt)
        mma_tf32(dv[nt], a, to_tf32(r[8 * nt]), to_tf32(r[kC + 4 + 8 * nt]));
    }
  }
  state_times_rows(dv, S, &sh.kg[0][0], KP + 8);
  add_partner(dv, sh.xch);
}

// dv_new out (kStore); dS^T = dS'^T diag(decay) + dO^T qg (none for a map's columns)
// - dv_new^T w.
template <bool kStore, int KP, int kCols>
__device__ void dstate_update_phase(const BackwardParams& b, const MmaScanBlock& blk, int len,
                                    int64_t rec, MmaState<KP>& S,
                                    const DstatesShared<KP, kCols>& sh,
                                    const Acc (&dv)[kTokenTiles]) {
  const int64_t V = b.p.V;
  float* out = b.ws.dvn + rec * kC * V;
  if (kStore)
    for_each_token(dv, b, len, blk, [&](float x, int i, int64_t col) { out[i * V + col] = x; });
  S.decay(sh.decay);
  if (!blk.map)
#pragma unroll
    for (int kt = 0; kt < kTokenTiles; ++kt) {
      uint32_t a[4];
      dout_fragment<kCols>(sh.dout, kt, blk.wc, a);
      times_kn(S.acc, a, &sh.qg[0][S.key0], KP + 4, kt);
    }
  if (b.p.delta) add_tokens_times_rows(S, dv, -1.f, &sh.w[0][0], KP + 4);
}

// kEnds: the maps of every segment but a sequence's first, only their e with transposed_maps
// (nothing else written); otherwise dS' and dv_new of every segment's chunks, from its true
// exit, and the initial state's gradient from the first segment.
template <int KP, int kCols, bool kEnds>
__global__ void __launch_bounds__(ScanShape<kCols>::kThreads, 1)
    dstates_mma_kernel(const BackwardParams b) {
  static_assert(!kEnds || kCols == 64, "the segment maps' tiles are 64 columns wide");
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sh = *reinterpret_cast<DstatesShared<KP, kCols>*>(smem);
  const MmaScanBlock blk(b, kEnds ? dstates_ends_tiles(b) : mma_column_tiles(b.p.V, kCols),
                         kCols);
  if (kEnds ? blk.seg == 0 || blk.seg >= blk.used : blk.seg > 0 && blk.seg >= blk.used) return;
  MmaState<KP> S(blk);  // dS^T
  if (kEnds) {
    S.start(b, blk);
  } else {
    S.load(b, b.d_final, b.d_final_dtype, blk);
    static_assert(sizeof(sh.kg) >= sizeof(float) * KP * (kC + 4), "the transposed carry's stage");
    for (int64_t s = blk.used - 1; s > blk.seg; --s) {
      if (b.transposed_maps)
        carry_by_transposed_map(b, blk, s, S, &sh.kg[0][0], sh.xch);
      else
        carry_across_segment(b, blk, s, S, &sh.kg[0][0], sh.xch);
    }
  }
  for (int64_t ci = blk.c1 - 1; ci >= blk.c0; --ci) {
    const int len = blk.len(ci);
    if (len == 0) continue;  // defensive, as in the tile scan
    const int64_t rec = blk.record(b, ci);
    stage_dstates_operands(b, blk, ci, len, sh);
    prefetch_dstates_operands(b, blk, ci - 1);
    // dS', the gradient of the state leaving the chunk, written while the stage lands.
    S.store_record_while_staging(b, blk, !kEnds, dstates_slab(b, rec), sh.xch);
    Acc dv[kTokenTiles];
    dv_phase(blk, S, sh, dv);
    dstate_update_phase<!kEnds>(b, blk, len, rec, S, sh, dv);
    __syncthreads();  // every warp is done with the stage before the next chunk's copies
  }
  if (kEnds)
    S.store_segment_end(b, blk);
  else if (blk.seg == 0)
    S.store(b, b.d_initial, b.d_initial_dtype, blk);
}

// One block per (sequence, value head, segment, tile of kCols columns) of kernel, with shared
// memory Shared.
template <int kCols, class Shared>
void launch_mma_scan(void (*kernel)(BackwardParams), const BackwardParams& b, int64_t tiles,
                     void* stream) {
  const int64_t blocks = b.p.N * b.p.HV * b.segments * tiles;
  if (blocks == 0) return;
  set_shared_bytes(kernel, sizeof(Shared));
  kernel<<<static_cast<unsigned>(blocks), ScanShape<kCols>::kThreads, sizeof(Shared),
           static_cast<cudaStream_t>(stream)>>>(b);
}

// The segments' maps first (ends_tiles column tiles of 64) where the sequences are split;
// then the scan, in blocks of b.mma_cols columns (a segment's map is the same whatever
// the tiles that carry it).
template <int KP, template <int, int> class Shared>
void launch_mma_scans(void (*ends)(BackwardParams), void (*scan)(BackwardParams),
                      void (*wide)(BackwardParams), const BackwardParams& b, int64_t ends_tiles,
                      void* stream) {
  if (b.segments > 1) launch_mma_scan<64, Shared<KP, 64>>(ends, b, ends_tiles, stream);
  if (b.mma_cols == 128)
    return launch_mma_scan<128, Shared<KP, 128>>(wide, b, mma_column_tiles(b.p.V, 128), stream);
  launch_mma_scan<64, Shared<KP, 64>>(scan, b, mma_column_tiles(b.p.V), stream);
}

template <int KP>
void launch_states_mma(const BackwardParams& b, void* stream) {
  launch_mma_scans<KP, StatesShared>(states_mma_kernel<KP, 64, true>,
                                     states_mma_kernel<KP, 64, false>,
                                     states_mma_kernel<KP, 128, false>, b,
                                     map_column_tiles(b.p.K, b.p.V), stream);
}

template <int KP>
void launch_dstates_mma(const BackwardParams& b, void* stream) {
  launch_mma_scans<KP, DstatesShared>(dstates_mma_kernel<KP, 64, true>,
                                      dstates_mma_kernel<KP, 64, false>,
                                      dstates_mma_kernel<KP, 128, false>, b,
                                      dstates_ends_tiles(b), stream);
}

}  // namespace

int64_t backward_scans_mma_shared_bytes(int64_t K, int cols) {
  // dstates' is the larger.
  if (cols == 128)
    return K <= 64 ? sizeof(DstatesShared<64, 128>) : sizeof(DstatesShared<128, 128>);
  return K <= 64 ? sizeof(DstatesShared<64, 64>) : sizeof(DstatesShared<128, 64>);
}

void launch_backward_states_mma(const BackwardParams& b, void* stream) {
  if (b.p.K <= 64) return launch_states_mma<64>(b, stream);
  launch_states_mma<128>(b, stream);
}

void launch_backward_dstates_mma(const BackwardParams& b, void* stream) {
  if (b.p.K <= 64) return launch_dstates_mma<64>(b, stream);
  launch_dstates_mma<128>(b, stream);
}

}  // namespace flashdelta::detail::cuda
