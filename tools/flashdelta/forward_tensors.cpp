#include "forward_tensors.h"

#include <algorithm>
#include <iterator>
#include <vector>

namespace flashdelta::cli {
namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

const io::OwnedTensor* find(const io::TensorMap& inputs, const char* name) {
  const auto it = inputs.find(name);
  return it == inputs.end() ? nullptr : &it->second;
}

bool has_rank(const io::OwnedTensor* t, size_t rank) { return t && t->shape.size() == rank; }

}  // namespace

std::string describe(const io::OwnedTensor& t) {
  return std::string(io::safetensors_dtype_name(t.dtype)) + " " + shape_str(t.shape);
}

void check_input_names(const io::TensorMap& inputs, const std::string& origin,
                       const std::vector<std::string>& extra) {
  std::string unknown;
  for (const auto& [name, tensor] : inputs) {
    const bool known =
        std::find_if(std::begin(kForwardInputNames), std::end(kForwardInputNames),
                     [&](const char* n) { return name == n; }) != std::end(kForwardInputNames) ||
        std::find(extra.begin(), extra.end(), name) != extra.end();
    if (known) continue;
    unknown += unknown.empty() ? "'" : ", '";
    unknown += name + "'";
  }
  if (unknown.empty()) return;
  std::string expected;
  for (const char* n : kForwardInputNames) {
    if (!expected.empty()) expected += ' ';
    expected += n;
  }
  for (const std::string& n : extra) expected += ' ' + n;
  throw Error(ErrorCode::invalid_argument, origin + ": unknown tensor name " + unknown +
                                               " (the inputs are named " + expected + ")");
}

namespace {

// Entries of ForwardArgs::chunk_states for these inputs: ceil(L / 64) per sequence, with the
// lengths from cu_seqlens when present (clamped like the library's own reading; a malformed
// table is the library's to report).
int64_t chunk_state_entries(const io::OwnedTensor& q, const io::OwnedTensor* cu_seqlens) {
  if (!cu_seqlens) return q.shape[0] * chunk_state_count(q.shape[1]);
  const int64_t n = cu_seqlens->numel();
  const auto at = [&](int64_t i) -> int64_t {
    if (cu_seqlens->dtype == DType::i64)
      return reinterpret_cast<const int64_t*>(cu_seqlens->bytes.data())[i];
    if (cu_seqlens->dtype == DType::i32)
      return reinterpret_cast<const int32_t*>(cu_seqlens->bytes.data())[i];
    return 0;
  };
  int64_t total = 0;
  for (int64_t i = 0; i + 1 < n; ++i) total += chunk_state_count(at(i + 1) - at(i));
  return total;
}

}  // namespace

ForwardOutputs make_forward_outputs(const io::TensorMap& inputs, StateLayout layout,
                                    bool chunk_states) {
  ForwardOutputs out;
  const io::OwnedTensor* q = find(inputs, "q");
  const io::OwnedTensor* v = find(inputs, "v");
  const io::OwnedTensor* cu_seqlens = find(inputs, "cu_seqlens");
  if (!has_rank(v, 4)) return out;
  out.o = io::OwnedTensor(v->dtype, v->shape);

  if (!has_rank(q, 4) || (cu_seqlens && !has_rank(cu_seqlens, 1))) return out;
  const int64_t N = cu_seqlens ? cu_seqlens->shape[0] - 1 : q->shape[0];
  const int64_t HV = v->shape[2], K = q->shape[3], V = v->shape[3];
  if (N < 0) return out;
  const auto state_shape = [&](int64_t count) {
    return layout == StateLayout::k_first ? std::vector<int64_t>{count, HV, K, V}
                                          : std::vector<int64_t>{count, HV, V, K};
  };
  out.final_state = io::OwnedTensor(DType::f32, state_shape(N));
  if (chunk_states)
    out.chunk_states = io::OwnedTensor(DType::f32, state_shape(chunk_state_entries(*q, cu_seqlens)));
  return out;
}

ForwardArgs make_forward_args(io::TensorMap& inputs, ForwardOutputs& outputs) {
  const auto input = [&](const char* name) {
    const auto it = inputs.find(name);
    return it == inputs.end() ? TensorView{} : it->second.view();
  };
  ForwardArgs a;
  a.q = input("q");
  a.k = input("k");
  a.v = input("v");
  a.g = input("g");
  a.beta = input("beta");
  a.initial_state = input("initial_state");
  a.cu_seqlens = input("cu_seqlens");
  a.A_log = input("A_log");
  a.dt_bias = input("dt_bias");
  if (outputs.o) a.o = outputs.o->view();
  if (outputs.final_state) a.final_state = outputs.final_state->view();
  if (outputs.chunk_states) a.chunk_states = outputs.chunk_states->view();
  return a;
}

}  // namespace flashdelta::cli
