// The chunk state kernel's instantiations at key width KP = 256 (cuda/chunk_state.cuh): one
// width per file, so that the widths compile in parallel.
#include "cuda/chunk_state.cuh"

namespace flashdelta::detail::cuda {

template <>
void launch_chunk_state_width<256>(const ChunkParams& c, void* stream) {
  launch_state_width<256>(c, stream);
}

template <>
bool chunk_state_one_stage_only_width<256>(const ChunkParams& c) {
  return one_stage_only_width<256>(c);
}

}  // namespace flashdelta::detail::cuda
