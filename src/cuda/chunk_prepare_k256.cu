// The chunk prepare kernel's instantiations at key width KP = 256 (cuda/chunk_prepare.cuh):
// one width per file, so that the widths compile in parallel.
#include "cuda/chunk_prepare.cuh"

namespace flashdelta::detail::cuda {

template <>
void launch_chunk_prepare_width<256>(const ChunkParams& c, void* stream) {
  launch_prepare_width<256>(c, stream);
}

}  // namespace flashdelta::detail::cuda
