// The chunk prepare kernel's entry point (cuda/chunk_params.h), by key width: each width's
// kernels are instantiated in a file of their own (cuda/chunk_prepare_k64.cu, _k128.cu,
// _k256.cu; the kernel is cuda/chunk_prepare.cuh).
#include "cuda/chunk_params.h"

namespace flashdelta::detail::cuda {

void launch_chunk_prepare(const ChunkParams& c, void* stream) {
  if (c.KP == 64) return launch_chunk_prepare_width<64>(c, stream);
  if (c.KP == 128) return launch_chunk_prepare_width<128>(c, stream);
  launch_chunk_prepare_width<256>(c, stream);
}

}  // namespace flashdelta::detail::cuda
