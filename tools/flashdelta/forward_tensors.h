// The forward's tensors by name, as `flashdelta run` reads and writes them: the inputs a
// file may hold, the outputs o and final_state, and the ForwardArgs over them. Shapes and
// dtypes are checked by the library (flashdelta::forward), never here.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "flashdelta/flashdelta.h"
#include "flashdelta/safetensors.h"

namespace flashdelta::cli {

// Every name `run --in` understands; absent ones are absent arguments.
inline constexpr const char* kForwardInputNames[] = {
    "q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias"};

// "F32 [2, 64, 4, 64]": dtype and shape, for messages.
std::string describe(const io::OwnedTensor& t);

// Throws Error naming every tensor of `inputs` that is neither a forward input nor one of
// `extra`: a misspelt name would otherwise silently become an absent argument.
void check_input_names(const io::TensorMap& inputs, const std::string& origin,
                       const std::vector<std::string>& extra = {});

// o [B, T, HV, V] in the dtype of v, final_state float32 [N, HV, K, V] or [N, HV, V, K],
// and with `chunk_states` the float32 states before every 64th token of each sequence
// (ForwardArgs::chunk_states: [C, HV, K, V] or [C, HV, V, K], C = sum ceil(L_n / 64)).
// An output stays empty when the inputs it is sized from are missing or of the wrong rank;
// the library then reports the bad input, which it checks before the outputs.
struct ForwardOutputs {
  std::optional<io::OwnedTensor> o;
  std::optional<io::OwnedTensor> final_state;
  std::optional<io::OwnedTensor> chunk_states;
};
ForwardOutputs make_forward_outputs(const io::TensorMap& inputs, StateLayout layout,
                                    bool chunk_states = false);

// Host views of the inputs and outputs (forward_on runs them on either device).
ForwardArgs make_forward_args(io::TensorMap& inputs, ForwardOutputs& outputs);

}  // namespace flashdelta::cli
