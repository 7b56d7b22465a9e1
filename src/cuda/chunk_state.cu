// Steps 4-5 of the chunkwise forward (DESIGN.md section 3): one block per (sequence, value
// head, tile of BV value columns) walks its chunks in order with the K x BV state tile in
// float32 registers (as tensor-core accumulators), and per chunk
//     v_new = u - w S                       (delta rule; linear: v_new = u = v)
//     o     = qg S + A_qk v_new
//     S     = diag(decay) S + kg^T v_new
// from the chunk's prepared record (cuda/chunk_params.h), which is copied into shared memory
// asynchronously one chunk ahead while the current chunk computes (KP <= 128). Warp w owns
// the state rows (keys) [w KP/4, (w + 1) KP/4) and the chunk rows (tokens) [16 w, 16 w + 16).
// The products read S as bfloat16, the precision of every tensor-core operand here; the state
// itself accumulates in float32.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/chunk_params.h"
#include "cuda/chunk_records.cuh"
#include "cuda/device_io.cuh"
#include "cuda/mma.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

template <int KP>
struct StateGeometry {
  static constexpr int BV = chunk_state_columns(KP);
  static constexpr int kStages = KP <= 128 ? 2 : 1;
  static constexpr int kKeyTiles = KP / kWarps / 16;  // m16 tiles of keys per warp
  static constexpr int kColTiles = BV / 8;             // n8 tiles of columns
  static constexpr int LK = KP + 8, LV = BV + 8, LC = kChunk + 8;
};

template <int KP>
struct Stage {
  using G = StateGeometry<KP>;
  bf16 qg[kChunk][G::LK], kg[kChunk][G::LK], w[kChunk][G::LK];
  bf16 u[kChunk][G::LV], a[kChunk][G::LC];
  float decay[KP];
};

template <int KP>
struct StateShared {
  using G = StateGeometry<KP>;
  Stage<KP> stage[G::kStages];
  bf16 s[KP][G::LV];       // the state tile as a bfloat16 operand
  bf16 vn[kChunk][G::LV];  // v_new
  float o[kChunk][G::BV + 4];  // the chunk's output rows, staged for vector stores
};

// Copies one record's rows (this block's columns of u) into a stage.
template <int KP>
__device__ void fetch_record(const ChunkParams& c, const Record& r, int64_t j0, bool delta,
                             Stage<KP>& st) {
  using G = StateGeometry<KP>;
  const int tid = threadIdx.x;
  constexpr int kRow = KP / 8;  // 16-byte pieces per row
  for (int e = tid; e < kChunk * kRow; e += kThreads) {
    const int t = e / kRow, x = 8 * (e % kRow);
    copy_async<16>(&st.qg[t][x], r.qg + t * KP + x, 16);
    copy_async<16>(&st.kg[t][x], r.kg + t * KP + x, 16);
    if (delta) copy_async<16>(&st.w[t][x], r.w + t * KP + x, 16);
  }
  for (int e = tid; e < kChunk * (G::BV / 8); e += kThreads) {
    const int t = e / (G::BV / 8), x = 8 * (e % (G::BV / 8));
    copy_async<16>(&st.u[t][x], r.u + t * c.VP + j0 + x, 16);
  }
  for (int e = tid; e < kChunk * (kChunk / 8); e += kThreads) {
    const int t = e / (kChunk / 8), x = 8 * (e % (kChunk / 8));
    copy_async<16>(&st.a[t][x], r.aqk + t * kChunk + x, 16);
  }
  for (int e = tid; e < KP / 4; e += kThreads) copy_async<16>(&st.decay[4 * e], r.decay + 4 * e, 16);
  commit_async();
}

template <int KP>
struct StateTile {
  using G = StateGeometry<KP>;
  Acc acc[G::kKeyTiles][G::kColTiles];

  __device__ static int key(int mt, int e) {
    return (threadIdx.x / 32) * (KP / kWarps) + 16 * mt + acc_row(e);
  }
  __device__ static int col(int nt, int e) { return 8 * nt + acc_col(e); }

  // Calls f(value, offset) for each of this thread's state values inside K x V, with its
  // element offset in the state tensor s.
  template <class F>
  __device__ void for_each_value(const RecurrentParams& p, const StateTensor& s, int64_t n,
                                 int64_t hv, int64_t j0, F&& f) {
#pragma unroll
    for (int mt = 0; mt < G::kKeyTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < G::kColTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t i = key(mt, e), j = j0 + col(nt, e);
          if (i < p.K && j < p.V)
            f(acc[mt][nt].d[e], n * s.slot_stride + hv * s.head_stride + i * s.key_stride +
                                    j * s.value_stride);
        }
  }

  // The initial state (zeros where absent and past K / V).
  __device__ void load(const RecurrentParams& p, int64_t n, int64_t hv, int64_t j0) {
    const auto* in = static_cast<const float*>(p.state_in.data);
    for (auto& tile : acc)
      for (Acc& a : tile) a = Acc{};
    if (in) for_each_value(p, p.state_in, n, hv, j0, [&](float& x, int64_t off) { x = in[off]; });
  }

  __device__ void store(const RecurrentParams& p, int64_t n, int64_t hv, int64_t j0) {
    auto* out = static_cast<float*>(p.state_out.data);
    if (out) for_each_value(p, p.state_out, n, hv, j0, [&](float& x, int64_t off) { out[off] = x; });
  }

  // The bfloat16 operand copy of the tile.
  __device__ void stage(bf16 (*s)[G::LV]) const {
#pragma unroll
    for (int mt = 0; mt < G::kKeyTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < G::kColTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *reinterpret_cast<__nv_bfloat162*>(&s[key(mt, e)][col(nt, e)]) =
              __floats2bfloat162_rn(acc[mt][nt].d[e], acc[mt][nt].d[e + 1]);
  }
};

// acc[16 rows of this warp][BV] += x[rows][0 .. depth) . y[0 .. depth)[BV] (y row-major).
template <int KP>
__device__ __forceinline__ void rows_times(Acc (&acc)[StateGeometry<KP>::kColTiles], const bf16* x,
                                           int ldx, const bf16* y, int depth) {
  using G = StateGeometry<KP>;
  const int r0 = 16 * (threadIdx.x / 32);
  for (int k0 = 0; k0 < depth; k0 += 16) {
    uint32_t a[4];
    load_a(a, x, ldx, r0, k0);
#pragma unroll
    for (int np = 0; np < G::kColTiles / 2; ++np) {
      uint32_t b[4];
      load_b_pair_kn(b, y, G::LV, 16 * np, k0);
      mma_bf16(acc[2 * np], a, b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

template <int KP>
__global__ void __launch_bounds__(kThreads) chunk_state_kernel(const ChunkParams c) {
  using G = StateGeometry<KP>;
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sh = *reinterpret_cast<StateShared<KP>*>(smem);
  const RecurrentParams& p = c.p;
  const int64_t tiles = (p.V + G::BV - 1) / G::BV;
  const int64_t blk = blockIdx.x, n = blk / (tiles * p.HV), hv = blk / tiles % p.HV;
  const int64_t j0 = blk % tiles * G::BV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = 16 * warp;
  const Sequence seq = sequence_of(p, n);
  const ChunkRange chunks = chunk_range(c, n);
  const int64_t o_base = token_offset(p.o, seq, hv);

  StateTile<KP> S;
  S.load(p, n, hv, j0);
  auto record = [&](int64_t i) { return record_of(c, (chunks.first + i) * p.HV + hv); };
  if (G::kStages == 2 && chunks.count > 0) fetch_record(c, record(0), j0, p.delta, sh.stage[0]);

  for (int64_t i = 0; i < chunks.count; ++i) {
    Stage<KP>& st = sh.stage[G::kStages == 2 ? i % 2 : 0];
    S.stage(sh.s);
    if (G::kStages == 1) {
      fetch_record(c, record(i), j0, p.delta, st);
      wait_async<0>();
    } else if (i + 1 < chunks.count) {
      fetch_record(c, record(i + 1), j0, p.delta, sh.stage[(i + 1) % 2]);
      wait_async<1>();
    } else {
      wait_async<0>();
    }
    __syncthreads();

    // v_new for this warp's 16 tokens.
    Acc vn[G::kColTiles];
    if (p.delta) rows_times<KP>(vn, &st.w[0][0], G::LK, &sh.s[0][0], KP);
#pragma unroll
    for (int nt = 0; nt < G::kColTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int t = r0 + acc_row(e), j = 8 * nt + acc_col(e);
        const float u0 = __bfloat162float(st.u[t][j]), u1 = __bfloat162float(st.u[t][j + 1]);
        *reinterpret_cast<__nv_bfloat162*>(&sh.vn[t][j]) =
            __floats2bfloat162_rn(u0 - vn[nt].d[e], u1 - vn[nt].d[e + 1]);
      }
    __syncthreads();

    // o = qg S + A_qk v_new for this warp's tokens (A_qk is zero right of the diagonal).
    Acc o[G::kColTiles];
    rows_times<KP>(o, &st.qg[0][0], G::LK, &sh.s[0][0], KP);
    rows_times<KP>(o, &st.a[0][0], G::LC, &sh.vn[0][0], r0 + 16);
    // Each warp stores its own 16 rows in runs of 8 columns (one vector store each for
    // contiguous 16-bit outputs).
#pragma unroll
    for (int nt = 0; nt < G::kColTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sh.o[r0 + acc_row(e)][8 * nt + acc_col(e)] = o[nt].d[e];
    __syncwarp();
    constexpr int kRuns = kSubChunk * G::BV / 8;
#pragma unroll
    for (int x = lane; x < kRuns; x += 32) {
      const int row = r0 + x / (G::BV / 8), col = 8 * (x % (G::BV / 8));
      const int64_t t = i * kChunk + row, j = j0 + col;
      if (t >= seq.len) continue;
      float run[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) run[e] = sh.o[row][col + e];
      store_run8(p.o, o_base + t * p.o.stride[1] + j * p.o.stride[3],
                 static_cast<int>(p.V - j < 8 ? p.V - j : 8), run);
    }

    // S = diag(decay) S + kg^T v_new for this warp's keys.
#pragma unroll
    for (int mt = 0; mt < G::kKeyTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < G::kColTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S.acc[mt][nt].d[e] *= st.decay[StateTile<KP>::key(mt, e)];
      const int m0 = warp * (KP / kWarps) + 16 * mt;
#pragma unroll
      for (int k0 = 0; k0 < kChunk; k0 += 16) {
        uint32_t a[4];
        load_a_transposed(a, &st.kg[0][0], G::LK, m0, k0);
#pragma unroll
        for (int np = 0; np < G::kColTiles / 2; ++np) {
          uint32_t b[4];
          load_b_pair_kn(b, &sh.vn[0][0], G::LV, 16 * np, k0);
          mma_bf16(S.acc[mt][2 * np], a, b[0], b[1]);
          mma_bf16(S.acc[mt][2 * np + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the next chunk rewrites s, vn and this stage
  }
  S.store(p, n, hv, j0);
}

template <int KP>
void launch_state(const ChunkParams& c, cudaStream_t stream) {
  using G = StateGeometry<KP>;
  const auto kernel = chunk_state_kernel<KP>;
  constexpr int smem = sizeof(StateShared<KP>);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int64_t blocks = c.p.N * c.p.HV * ((c.p.V + G::BV - 1) / G::BV);
  if (blocks > 0) kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(c);
}

template <int KP>
void require_shared_memory() {
  constexpr int smem = sizeof(StateShared<KP>);
  int device = 0, available = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess)
    throw Error(ErrorCode::runtime, "the CUDA chunk schedule: no usable CUDA device");
  if (available < smem)
    throw Error(ErrorCode::unsupported,
                "argument 'q': the CUDA chunk state kernel for K <= " + std::to_string(KP) +
                    " needs " + std::to_string(smem) + " bytes of shared memory per block; this "
                    "GPU offers " + std::to_string(available) + " (Hopper: 232448)");
}

}  // namespace

void require_chunk_state_shared_memory(const ChunkParams& c) {
  if (c.KP == 64) return require_shared_memory<64>();
  if (c.KP == 128) return require_shared_memory<128>();
  return require_shared_memory<256>();
}

void launch_chunk_state(const ChunkParams& c, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (c.KP == 64) return launch_state<64>(c, s);
  if (c.KP == 128) return launch_state<128>(c, s);
  return launch_state<256>(c, s);
}

}  // namespace flashdelta::detail::cuda
