// The chunk table of a varlen forward: chunk_start[n] = sum over m < n of ceil(len_m / C),
// computed on the device from the device-resident cu_seqlens (the host reads no index data),
// so the prepare kernel can map a chunk to its sequence and the state kernel a sequence to
// its chunks.
#include <cub/block/block_scan.cuh>

#include "cuda/chunk_params.h"
#include "cuda/sequence.cuh"

namespace flashdelta::detail::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) chunk_table_kernel(const ChunkParams c) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scratch;
  __shared__ int64_t carried;
  if (threadIdx.x == 0) carried = 0;
  __syncthreads();
  for (int64_t base = 0; base < c.p.N; base += kThreads) {
    const int64_t n = base + threadIdx.x;
    const int64_t chunks = n < c.p.N ? (sequence_of(c.p, n).len + kChunk - 1) / kChunk : 0;
    int64_t before = 0, total = 0;
    Scan(scratch).ExclusiveSum(chunks, before, total);
    // Capped at the workspace's records: a malformed device table (offsets that decrease,
    // sequences that overlap) may promise more chunks than T / C + N, but never reads or
    // writes past the workspace; such sequences lose their last chunks.
    if (n < c.p.N) c.ws.chunk_start[n] = min(carried + before, c.max_chunks);
    __syncthreads();
    if (threadIdx.x == 0) carried += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) c.ws.chunk_start[c.p.N] = min(carried, c.max_chunks);
}

}  // namespace

void launch_chunk_table(const ChunkParams& c, void* stream) {
  chunk_table_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(c);
}

}  // namespace flashdelta::detail::cuda
