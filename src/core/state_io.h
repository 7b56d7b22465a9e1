// Whole-state reads and writes of one (sequence or slot, value head) as a dense K x V
// row-major buffer, whatever the layout (K-first / V-first), strides and dtype of the view.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "core/tensor_io.h"

namespace flashdelta::detail {

template <class T>
void load_state(const StateView& s, int64_t n, int64_t hv, int64_t K, int64_t V, T* S) {
  for (int64_t i = 0; i < K; ++i) load_row(s.t, s.offset(n, hv, i, 0), V, s.value_step(), S + i * V);
}

template <class T>
void store_state(const StateView& s, int64_t n, int64_t hv, int64_t K, int64_t V, const T* S) {
  for (int64_t i = 0; i < K; ++i)
    store_row(s.t, s.offset(n, hv, i, 0), V, s.value_step(), S + i * V);
}

}  // namespace flashdelta::detail
