// The chunk state kernel's entry points (cuda/chunk_params.h), by key width: each width's
// kernels are instantiated in a file of their own (cuda/chunk_state_k64.cu, _k128.cu,
// _k256.cu; the kernel is cuda/chunk_state.cuh).
#include "cuda/chunk_params.h"

namespace flashdelta::detail::cuda {

bool chunk_state_one_stage_only(const ChunkParams& c) {
  if (c.KP == 64) return chunk_state_one_stage_only_width<64>(c);
  if (c.KP == 128) return chunk_state_one_stage_only_width<128>(c);
  return chunk_state_one_stage_only_width<256>(c);
}

void launch_chunk_state(const ChunkParams& c, void* stream) {
  if (c.KP == 64) return launch_chunk_state_width<64>(c, stream);
  if (c.KP == 128) return launch_chunk_state_width<128>(c, stream);
  launch_chunk_state_width<256>(c, stream);
}

}  // namespace flashdelta::detail::cuda
