// Device-side element access for the CUDA kernels: runtime-dtype scalar loads and stores for
// the small per-token tensors, and streaming vector runs for the state, which is read and
// written exactly once per call and should not displace anything else from L2.
//
// Reads before stores, in every kernel: ptxas cannot tell one part of a block's shared memory
// from another (one array, other base registers), so a shared load written after a shared
// store waits for it. A loop that reads shared values and stores to shared memory reads a
// batch of its inputs first, or keeps its results in registers until after the loop;
// otherwise each element's load -> arithmetic -> store chain waits for the one before
// (bench/NOTES.md (bq): the prepare kernel's factor fills had no two chains overlapping).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/recurrent_params.h"

namespace flashdelta::detail::cuda {

__device__ __forceinline__ float load_float(const void* base, DType t, int64_t off) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[off];
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
    case DType::f16: return __half2float(static_cast<const __half*>(base)[off]);
    case DType::f64: return static_cast<float>(static_cast<const double*>(base)[off]);
    default: return 0.f;
  }
}

// Loads split in two so that a thread can issue all its loads before it waits on any: the
// raw bits first (float64 is narrowed at load time: rare, and it waits there), then the
// conversion. A conversion inside the load's dtype switch would serialise the latencies.
__device__ __forceinline__ uint32_t load_raw(const void* base, DType t, int64_t off) {
  switch (t) {
    case DType::bf16:
    case DType::f16: return static_cast<const unsigned short*>(base)[off];
    case DType::f64: return __float_as_uint(static_cast<float>(static_cast<const double*>(base)[off]));
    default: return static_cast<const uint32_t*>(base)[off];
  }
}

__device__ __forceinline__ float raw_to_float(uint32_t r, DType t) {
  switch (t) {
    case DType::bf16: return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(r)));
    case DType::f16: return __half2float(__ushort_as_half(static_cast<unsigned short>(r)));
    default: return __uint_as_float(r);
  }
}

__device__ __forceinline__ void store_float(void* base, DType t, int64_t off, float x) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[off] = x; break;
    case DType::bf16: static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16(x); break;
    case DType::f16: static_cast<__half*>(base)[off] = __float2half(x); break;
    case DType::f64: static_cast<double*>(base)[off] = x; break;
    default: break;
  }
}

// Eight consecutive floats into a float32 buffer; channels at or past `valid` are not
// touched.
__device__ __forceinline__ void store_floats8(float* dst, int valid, const float (&v)[8]) {
  if (valid == 8 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < valid) dst[e] = v[e];
}

// Eight consecutive floats of a float32 buffer (zeros at or past `valid`).
__device__ __forceinline__ void load_floats8(const float* src, int valid, float (&v)[8]) {
  if (valid == 8 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const float4 a = reinterpret_cast<const float4*>(src)[0];
    const float4 b = reinterpret_cast<const float4*>(src)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = e < valid ? src[e] : 0.f;
}

// Eight consecutive channels of a token tensor, as raw bits, for kernels that move whole
// tiles: a 16-bit tensor with unit channel stride whose run is complete and 16-byte aligned
// (the common case: contiguous bf16) takes one vector load and stays packed (w[0..3]);
// anything else takes one load per element (w[e]). Split from the conversion like load_raw.
struct Run8 {
  uint32_t w[8];
  bool packed;
};

// Elements of a run of 8 that lie before the end (`left` = end - run start).
__device__ __forceinline__ int clamp_run(int64_t left) {
  return left <= 0 ? 0 : left >= 8 ? 8 : static_cast<int>(left);
}

__device__ __forceinline__ bool is_16bit(DType t) { return t == DType::bf16 || t == DType::f16; }

// The general case of load_run8: one load per element. Not inlined: it is the rare path,
// and inlined at every call site it would multiply the kernels' code (instruction-cache
// misses).
inline __device__ __noinline__ Run8 load_run8_elementwise(const void* data, DType dtype, int64_t off,
                                                   int64_t step, int valid) {
  Run8 r;
#pragma unroll
  for (int e = 0; e < 8; ++e) r.w[e] = e < valid ? load_raw(data, dtype, off + e * step) : 0u;
  r.packed = false;
  return r;
}

// A complete run of 8 16-bit values at a 16-byte aligned address, by one vector load.
__device__ __forceinline__ Run8 packed_run8(const unsigned short* ptr) {
  Run8 r{};
  const uint4 v = *reinterpret_cast<const uint4*>(ptr);
  r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
  r.packed = true;
  return r;
}

// Channels [0, valid) of the run at element offset `off`; the rest read as 0 and are not
// touched (valid <= 0 reads nothing).
__device__ __forceinline__ Run8 load_run8(const TokenTensor& x, int64_t off, int valid) {
  if (is_16bit(x.dtype) && x.stride[3] == 1 && valid >= 8) {
    const auto* ptr = static_cast<const unsigned short*>(x.data) + off;
    if ((reinterpret_cast<uintptr_t>(ptr) & 15) == 0) return packed_run8(ptr);
  }
  return load_run8_elementwise(x.data, x.dtype, off, x.stride[3], valid);
}

// N bfloat16 / float16 values packed two per word (the lower half first) as float32.
template <int N>
__device__ __forceinline__ void bf16_pairs_to_float(const uint32_t* w, float* out) {
#pragma unroll
  for (int e = 0; e < N; ++e)
    out[e] = __uint_as_float(e % 2 ? w[e / 2] & 0xffff0000u : w[e / 2] << 16);
}
template <int N>
__device__ __forceinline__ void f16_pairs_to_float(const uint32_t* w, float* out) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const uint32_t half = e % 2 ? w[e / 2] >> 16 : w[e / 2] & 0xffffu;
    out[e] = __half2float(__ushort_as_half(static_cast<unsigned short>(half)));
  }
}

__device__ __forceinline__ void run8_to_float(const Run8& r, DType t, float (&out)[8]) {
  // The dtype is branched on once per run, not per element (both conversions and a select).
  if (r.packed && t == DType::bf16) {
    bf16_pairs_to_float<8>(r.w, out);
  } else if (r.packed) {
    f16_pairs_to_float<8>(r.w, out);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = raw_to_float(r.w[e], t);
  }
}

// How a kernel reads runs of 8 channels of its token tensors. Dense: the host has checked
// (bf16_dense_runs) that the tensor is bfloat16 with unit channel stride, every run 16-byte
// aligned and the channel count a multiple of 8, so that a run is one vector load, or nothing
// where `valid` is 0 (past the chunk); no dtype or layout branch and no elementwise path.
// Otherwise by the tensor's dtype and layout at run time (load_run8).
template <bool Dense>
struct TokenRuns {
  __device__ __forceinline__ static Run8 load(const TokenTensor& x, int64_t off, int valid) {
    if constexpr (Dense) {
      if (valid > 0) return packed_run8(static_cast<const unsigned short*>(x.data) + off);
      return Run8{};  // to_float reads w only
    } else {
      return load_run8(x, off, valid);
    }
  }
  __device__ __forceinline__ static void to_float(const Run8& r, const TokenTensor& x,
                                                  float (&out)[8]) {
    if constexpr (Dense)
      bf16_pairs_to_float<8>(r.w, out);
    else
      run8_to_float(r, x.dtype, out);
  }
};

// Queues L2 prefetches of `rows` rows of row_elems elements from p (row stride `stride`
// elements), one 128-byte line per thread at a time; nothing waits on them. 32-bit indices: a
// 64-bit division per line is a long call, on the critical path of the kernels that prefetch.
// (Count, the row length's type, is the caller's: it sets the arithmetic of the line count.)
template <class T, class Count>
__device__ inline void prefetch_row_lines(const T* p, int64_t stride, int rows, Count row_elems) {
  constexpr int kLine = 128 / static_cast<int>(sizeof(T));
  const int lines = static_cast<int>((row_elems + kLine - 1) / kLine);
  for (int idx = threadIdx.x; idx < rows * lines; idx += blockDim.x) {
    const T* line = p + idx / lines * stride + idx % lines * kLine;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
  }
}

// prefetch_row_lines of `rows` token rows of a 16-bit tensor with unit channel stride
// (channels [0, channels) from element offset `off`); other layouts are not prefetched.
__device__ inline void prefetch_token_rows(const TokenTensor& x, int64_t off, int rows, int channels) {
  if (!is_16bit(x.dtype) || x.stride[3] != 1) return;
  prefetch_row_lines(static_cast<const unsigned short*>(x.data) + off, x.stride[1], rows, channels);
}

// Two floats as a bfloat16 pair in one register (lo in the low half): an mma operand word,
// half of a 16-byte store, a bfloat16 state run.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two floats as a float16 pair in one register (lo in the low half).
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two floats as a pair of a 16-bit dtype (bfloat16, else float16) in one register.
__device__ __forceinline__ uint32_t pack_16bit(DType t, float lo, float hi) {
  return t == DType::bf16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
}

// Eight floats by value: passed to a call in registers, where an array's address would put
// the caller's array (and every value summed into it) in local memory.
struct Floats8 {
  float v[8];
};

inline __device__ __noinline__ void store_run8_elementwise(void* data, DType dtype, int64_t off,
                                                           int64_t step, int valid, Floats8 in) {
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < valid) store_float(data, dtype, off + e * step, in.v[e]);
}

// Stores channels [0, valid) of eight at element offset `off` (one vector store for a
// complete, aligned run of a 16-bit tensor with unit channel stride).
__device__ __forceinline__ void store_run8(const TokenTensor& x, int64_t off, int valid,
                                           const float (&in)[8]) {
  void* base = const_cast<void*>(x.data);
  if (is_16bit(x.dtype) && x.stride[3] == 1 && valid >= 8) {
    auto* ptr = static_cast<unsigned short*>(base) + off;
    if ((reinterpret_cast<uintptr_t>(ptr) & 15) == 0) {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) w[e] = pack_16bit(x.dtype, in[2 * e], in[2 * e + 1]);
      *reinterpret_cast<uint4*>(ptr) = make_uint4(w[0], w[1], w[2], w[3]);
      return;
    }
  }
  Floats8 f;
#pragma unroll
  for (int e = 0; e < 8; ++e) f.v[e] = in[e];
  store_run8_elementwise(base, x.dtype, off, x.stride[3], valid, f);
}

__device__ __forceinline__ int64_t load_index(const IndexTensor& t, int64_t row, int64_t col) {
  const int64_t off = row * t.stride[0] + col * t.stride[1];
  return t.is_i64 ? static_cast<const int64_t*>(t.data)[off]
                  : static_cast<int64_t>(static_cast<const int32_t*>(t.data)[off]);
}

// The widest load/store word for a run of `Bytes` bytes (at most 16 per instruction).
template <int Bytes> struct Word;
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };

template <class S> __device__ __forceinline__ S from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// W state elements starting at p, `step` elements apart, from floats. With `vec` (step == 1
// and p aligned to the word) a full run is one vector store; elements at or past `valid`
// are never touched. Plain stores: streaming ones (st.global.cs) measured 1-2% slower in
// the decode kernels at N = 256 (bench/NOTES.md (aj)).
template <int W, class S>
__device__ __forceinline__ void store_run(S* p, int64_t step, int valid, bool vec,
                                          const float (&in)[W]) {
  constexpr int kBytes = W * static_cast<int>(sizeof(S));
  constexpr int kWord = kBytes < 16 ? kBytes : 16;
  using WordT = typename Word<kWord>::type;
  if (vec && valid == W) {
    WordT raw[kBytes / kWord];
    S* e = reinterpret_cast<S*>(raw);
#pragma unroll
    for (int w = 0; w < W; ++w) e[w] = from_float<S>(in[w]);
#pragma unroll
    for (int x = 0; x < kBytes / kWord; ++x) reinterpret_cast<WordT*>(p)[x] = raw[x];
  } else {
#pragma unroll
    for (int w = 0; w < W; ++w)
      if (w < valid) p[w * step] = from_float<S>(in[w]);
  }
}

// Asynchronous global -> shared copy of Bytes (4, 8 or 16) bytes of which the first
// src_bytes are read and the rest zero-filled (cp.async, Ampere and later; older GPUs copy
// synchronously, which is correct, only slower).
template <int Bytes>
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem),
                 "n"(Bytes), "r"(src_bytes)
                 : "memory");
#else
  for (int b = 0; b < Bytes; ++b)
    static_cast<unsigned char*>(smem)[b] =
        b < src_bytes ? static_cast<const unsigned char*>(gmem)[b] : 0;
#endif
}

__device__ __forceinline__ void commit_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int Pending>
__device__ __forceinline__ void wait_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

// Queues the height x width block of dst (row length ld, floats): rows < rows and columns <
// cols from a row-major float32 source (row stride `stride`), zeros elsewhere; 16-byte copies
// where the source rows allow them. All copies go out before any lands (a load-then-store
// loop would wait on every load); the caller commits and waits.
__device__ inline void stage_rows(float* dst, int ld, int height, int width, const float* src,
                                  int64_t stride, int rows, int cols) {
  const int quads = width / 4;
  const bool whole = stride % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  for (int idx = threadIdx.x; idx < height * quads; idx += blockDim.x) {
    const int r = idx / quads, q = idx % quads * 4;
    float* d = dst + r * ld + q;
    if (r < rows && whole && q + 3 < cols) {
      copy_async<16>(d, src + r * stride + q, 16);
      continue;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (r < rows && q + e < cols)
        copy_async<4>(d + e, src + r * stride + q + e, 4);
      else
        d[e] = 0.f;
    }
  }
}

// stage_rows for blocks of exactly kThreads threads and a block of kHeight rows x kWidth
// floats known at compile time: columns [c0, c0 + kWidth) of the source rows into dst (zeros
// past `rows` and `cols`). Thread t copies the run of columns c0 + 4 (t % (kWidth / 4)) .. of
// rows t / (kWidth / 4) + i kThreads / (kWidth / 4): one range test for the run, one address
// per row advanced by an add. (stage_rows' loop over blockDim.x takes a division and a 64-bit
// product per copy: ~25 instructions a 16-byte copy in the SASS, ~14 here.)
template <int kThreads, int kWidth, int kHeight, int kLd>
__device__ __forceinline__ void stage_row_runs(const float* base, int64_t ld, int rows, int cols,
                                               int c0, float (*dst)[kLd]) {
  constexpr int kRuns = kWidth / 4, kRowStep = kThreads / kRuns;
  static_assert(kWidth % 4 == 0 && kWidth <= kLd, "whole runs inside the rows");
  static_assert(kThreads % kRuns == 0 && kHeight % kRowStep == 0, "whole passes over the rows");
  const int t = threadIdx.x, q = 4 * (t % kRuns), c = c0 + q;
  const int64_t step = kRowStep * ld;
  const float* from = base + (t / kRuns) * ld + c;
  // A loop, not unrolled: each row's fallback copies would be repeated in the code.
#pragma unroll 1
  for (int m = t / kRuns; m < kHeight; m += kRowStep, from += step) {
    float* d = &dst[m][q];
    const bool row = m < rows;
    // The address passed is the one tested: a zero-filling copy takes the base, whose
    // alignment can differ from the row's (a row length not a multiple of 4).
    const float* src = row ? from : base;
    if (c + 3 < cols && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      copy_async<16>(d, src, row ? 16 : 0);
      continue;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = row && c + e < cols;
      copy_async<4>(d + e, ok ? from + e : base, ok ? 4 : 0);
    }
  }
}

}  // namespace flashdelta::detail::cuda
