// Serving (decode) test cases shared by the CPU and CUDA recurrent tests: a state pool whose
// unused slots are poisoned, slot indices with padding rows, and the comparison against the
// reference decode.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

namespace flashdelta::testing {

inline constexpr double kPoison = 1e30;

struct DecodeCase {
  Case c;              // q, k, v, g, beta [N, T, ...] (or B = 1 with cu_seqlens)
  HostTensor pool;     // [P, HV, K, V] or V-first, unused slots poisoned
  HostTensor indices;  // [N] or [N, S]
  HostTensor accepted;
  std::vector<bool> slot_used;  // slot read or written by a live row

  DecodeArgs args(HostTensor& o, HostTensor& pool_view) const {
    DecodeArgs a;
    a.q = c.q.view;
    a.k = c.k.view;
    a.v = c.v.view;
    const MechanismTraits mt = traits(c.cfg.mechanism);
    if (mt.gate != GateKind::none) a.g = c.g.view;
    if (mt.delta) a.beta = c.beta.view;
    if (!c.cfg.seqlens.empty()) a.cu_seqlens = c.cu_seqlens.view;
    if (c.cfg.gate_in_kernel && c.cfg.with_A_log) a.A_log = c.A_log.view;
    if (c.cfg.gate_in_kernel && c.cfg.with_dt_bias) a.dt_bias = c.dt_bias.view;
    a.state_pool = pool_view.view;
    a.state_indices = indices.view;
    if (accepted.view.present()) a.num_accepted_tokens = accepted.view;
    a.o = o.view;
    return a;
  }
};

// P slots, rows given by `slots` ([N] when per_token is empty, else [N, S] rows); a start
// slot of -1 is a padding row. Slots no live row touches hold kPoison.
inline DecodeCase make_decode_case(const CaseConfig& cfg, int64_t P, DType pool_dtype,
                            const std::vector<std::vector<int64_t>>& slots,
                            const std::vector<int64_t>& accepted = {}) {
  DecodeCase d;
  d.c = make_case(cfg);
  const bool per_token = slots[0].size() > 1 || !accepted.empty();
  const int64_t N = static_cast<int64_t>(slots.size());
  const int64_t S = static_cast<int64_t>(slots[0].size());
  std::vector<int64_t> idx;
  for (const auto& row : slots) idx.insert(idx.end(), row.begin(), row.end());
  if (per_token) {
    d.indices = HostTensor(DType::i64, {N, S});
    std::memcpy(d.indices.bytes.data(), idx.data(), idx.size() * sizeof(int64_t));
  } else {
    d.indices = HostTensor(DType::i32, {N});
    const std::vector<int32_t> idx32(idx.begin(), idx.end());
    std::memcpy(d.indices.bytes.data(), idx32.data(), idx32.size() * sizeof(int32_t));
  }
  if (!accepted.empty()) {
    d.accepted = HostTensor(DType::i32, {N});
    const std::vector<int32_t> acc32(accepted.begin(), accepted.end());
    std::memcpy(d.accepted.bytes.data(), acc32.data(), acc32.size() * sizeof(int32_t));
  }
  // A live row reads its start slot and writes the slots after its tokens.
  d.slot_used.assign(static_cast<size_t>(P), false);
  for (int64_t n = 0; n < N; ++n) {
    const auto& row = slots[static_cast<size_t>(n)];
    const int64_t start = row[static_cast<size_t>(accepted.empty() ? 0 : accepted[n] - 1)];
    if (start < 0) continue;  // padding row
    d.slot_used[static_cast<size_t>(start)] = true;
    const int64_t len = cfg.seqlens.empty() ? cfg.T : cfg.seqlens[static_cast<size_t>(n)];
    for (int64_t t = 0; per_token && t < len; ++t)
      if (row[static_cast<size_t>(t)] >= 0) d.slot_used[static_cast<size_t>(row[t])] = true;
  }
  const std::vector<int64_t> shape = cfg.layout == StateLayout::k_first
                                         ? std::vector<int64_t>{P, cfg.HV, cfg.K, cfg.V}
                                         : std::vector<int64_t>{P, cfg.HV, cfg.V, cfg.K};
  d.pool = HostTensor(pool_dtype, shape);
  std::mt19937_64 rng(cfg.seed + 7);
  std::vector<double> values = random_normal(rng, d.pool.numel(), 0, 0.5);
  const size_t per_slot = values.size() / static_cast<size_t>(P);
  for (size_t s = 0; s < static_cast<size_t>(P); ++s)
    if (!d.slot_used[s])
      std::fill(values.begin() + s * per_slot, values.begin() + (s + 1) * per_slot, kPoison);
  d.pool.set(values);
  return d;
}

// A fast decode schedule run on host views (a CUDA runner mirrors them to the device).
using DecodeRunner = std::function<void(const DecodeArgs&, const Options&)>;

inline void run_cpu_decode(const DecodeArgs& a, const Options& o) {
  decode(a, o, Schedule::recurrent);
}

// Runs `fast` and the reference decode on copies of the pool; asserts the outputs (written
// as o_dtype) and every used slot match, and that unused slots are bit-for-bit untouched.
inline void expect_decode_matches_reference(const DecodeCase& d, const std::string& what,
                                            const DecodeRunner& fast = run_cpu_decode,
                                            DType o_dtype = DType::f32) {
  const CaseConfig& cfg = d.c.cfg;
  HostTensor ref_pool = d.pool, fast_pool = d.pool;
  HostTensor ref_o = d.c.make_output(DType::f64), fast_o = d.c.make_output(o_dtype);
  fast_o.fill(kPoison);
  decode(d.args(ref_o, ref_pool), d.c.options, Schedule::reference);
  fast(d.args(fast_o, fast_pool), d.c.options);

  const DType inputs = cfg.dtype == DType::f64 ? DType::f32 : cfg.dtype;
  const double tol = std::max(tolerance(inputs), tolerance(o_dtype)) *
                     (d.pool.view.dtype == DType::bf16 ? 50 : 1);  // bf16 state: 2^-9 per store
  EXPECT_LT(rel_error(fast_o.to_double(), ref_o.to_double()), tol)
      << what << ": output relative error, tolerance " << tol;
  const size_t P = d.slot_used.size();
  const size_t slot_bytes = d.pool.bytes.size() / P;
  const std::vector<double> ref_all = ref_pool.to_double(), fast_all = fast_pool.to_double();
  const size_t per_slot = ref_all.size() / P;
  for (size_t s = 0; s < P; ++s) {
    if (!d.slot_used[s]) {
      EXPECT_EQ(0, std::memcmp(fast_pool.bytes.data() + s * slot_bytes,
                               d.pool.bytes.data() + s * slot_bytes, slot_bytes))
          << what << ": unused slot " << s << " was written";
      continue;
    }
    const std::vector<double> r(ref_all.begin() + s * per_slot,
                                ref_all.begin() + (s + 1) * per_slot);
    const std::vector<double> f(fast_all.begin() + s * per_slot,
                                fast_all.begin() + (s + 1) * per_slot);
    EXPECT_LT(rel_error(f, r), tol)
        << what << ": slot " << s << " relative error, tolerance " << tol;
  }
}

inline CaseConfig decode_config(Mechanism m, int64_t N, int64_t T, int64_t K, int64_t V, uint64_t seed) {
  CaseConfig cfg;
  cfg.mechanism = m;
  cfg.B = N;
  cfg.T = T;
  cfg.K = K;
  cfg.V = V;
  cfg.H = 2;
  cfg.HV = 4;
  cfg.initial_state = false;
  cfg.seed = seed;
  return cfg;
}

// KDA rows of 1, 0, 4 and 2 tokens (varlen) with bf16 inputs, every fused transform and the
// lower-bound gate; the last row is padding.
inline DecodeCase varlen_fused_decode_case() {
  CaseConfig cfg = decode_config(Mechanism::kda, 1, 7, 128, 128, 99);
  cfg.seqlens = {1, 0, 4, 2};
  cfg.dtype = DType::bf16;
  cfg.qk_l2norm = cfg.beta_sigmoid = cfg.gate_in_kernel = true;
  cfg.lower_bound = -5.0;
  return make_decode_case(cfg, 8, DType::f32, {{3}, {6}, {1}, {-1}});
}

}  // namespace flashdelta::testing
