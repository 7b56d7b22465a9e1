#include "synthetic.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/token_inputs.h"

namespace flashdelta::cli {
namespace {

template <class Distribution>
io::OwnedTensor random_tensor(std::vector<int64_t> shape, std::mt19937_64& rng, Distribution dist) {
  io::OwnedTensor t(DType::f32, std::move(shape));
  std::vector<float> values(static_cast<size_t>(t.numel()));
  for (float& x : values) x = dist(rng);
  std::memcpy(t.bytes.data(), values.data(), values.size() * sizeof(float));
  return t;
}

io::OwnedTensor normal_tensor(std::vector<int64_t> shape, std::mt19937_64& rng, float mean,
                              float stddev) {
  return random_tensor(std::move(shape), rng, std::normal_distribution<float>(mean, stddev));
}

float* floats(io::OwnedTensor& t) { return reinterpret_cast<float*>(t.bytes.data()); }

// Calls f(row, head) on each row of t [.., heads, width] as doubles, and stores it back.
template <class F>
void for_each_row(io::OwnedTensor& t, int64_t heads, int64_t width, F&& f) {
  const int64_t rows = t.numel() / width;
  for (int64_t r = 0; r < rows; ++r) {
    float* x = floats(t) + r * width;
    std::vector<double> row(x, x + width);
    f(row.data(), r % heads);
    for (int64_t i = 0; i < width; ++i) x[i] = static_cast<float>(row[static_cast<size_t>(i)]);
  }
}

// Applies the fused transforms of `fused` options to raw layer inputs, in place, with the
// reference's formulas (core/token_inputs.h), and drops A_log and dt_bias.
void apply_transforms(const Options& fused, const MechanismTraits& mt, const ProblemShape& s,
                      io::TensorMap& t) {
  for (const char* name : {"q", "k"})
    for_each_row(t[name], s.H, s.K, [&](double* x, int64_t) { detail::l2_normalize(x, s.K); });
  if (mt.delta)
    for_each_row(t["beta"], s.HV, 1, [](double* x, int64_t) { *x = detail::sigmoid(*x); });
  if (mt.gate != GateKind::none) {
    const int64_t width = mt.gate == GateKind::vector ? s.K : 1;
    std::vector<detail::GateParams<double>> gp(static_cast<size_t>(s.HV));
    for (int64_t hv = 0; hv < s.HV; ++hv) {
      detail::GateParams<double>& h = gp[static_cast<size_t>(hv)];
      h.has_a = true;
      h.a = std::exp(static_cast<double>(floats(t["A_log"])[hv]));
      for (int64_t i = 0; i < width; ++i) h.bias[i] = floats(t["dt_bias"])[hv * width + i];
    }
    for_each_row(t["g"], s.HV, width, [&](double* x, int64_t hv) {
      for (int64_t i = 0; i < width; ++i)
        x[i] = detail::gate_activation(fused, gp[static_cast<size_t>(hv)], i, x[i]);
    });
    t.erase("A_log");
    t.erase("dt_bias");
  }
}

}  // namespace

Options layer_options(Mechanism mechanism, Transforms transforms) {
  const MechanismTraits mt = traits(mechanism);
  const bool fused = transforms == Transforms::fused;
  Options o;
  o.mechanism = mechanism;
  o.qk_l2norm = fused;
  o.beta_sigmoid = fused && mt.delta;
  o.gate_in_kernel = fused && mt.gate != GateKind::none;
  return o;
}

const char* transforms_name(Transforms transforms) {
  return transforms == Transforms::fused ? "fused" : "prepared";
}

io::TensorMap random_layer_inputs(Mechanism mechanism, const ProblemShape& s, uint64_t seed,
                                  bool with_initial_state, Transforms transforms) {
  const MechanismTraits mt = traits(mechanism);
  std::mt19937_64 rng(seed);
  io::TensorMap t;
  t["q"] = normal_tensor({s.B, s.T, s.H, s.K}, rng, 0, 1);
  t["k"] = normal_tensor({s.B, s.T, s.H, s.K}, rng, 0, 1);
  t["v"] = normal_tensor({s.B, s.T, s.HV, s.V}, rng, 0, 1);
  if (mt.delta) t["beta"] = normal_tensor({s.B, s.T, s.HV}, rng, 0, 1);
  if (mt.gate != GateKind::none) {
    const bool vector_gate = mt.gate == GateKind::vector;
    // Raw gates; with A_log in [-1, 1) and dt_bias near 0 the activated per-step decay
    // -exp(A_log) softplus(g + dt_bias) is mostly between -3 and 0, as in trained layers.
    t["g"] = vector_gate ? normal_tensor({s.B, s.T, s.HV, s.K}, rng, 0, 1)
                         : normal_tensor({s.B, s.T, s.HV}, rng, 0, 1);
    t["A_log"] = random_tensor({s.HV}, rng, std::uniform_real_distribution<float>(-1, 1));
    t["dt_bias"] = normal_tensor({vector_gate ? s.HV * s.K : s.HV}, rng, 0, 0.5f);
  }
  if (with_initial_state) t["initial_state"] = normal_tensor({s.B, s.HV, s.K, s.V}, rng, 0, 0.5f);
  if (transforms == Transforms::prepared)
    apply_transforms(layer_options(mechanism, Transforms::fused), mt, s, t);
  return t;
}

void fill_uniform(float* data, int64_t n, float lo, float hi, uint64_t seed) {
  // splitmix64: one multiply-xorshift chain per value, fast enough for gigabytes.
  uint64_t x = seed;
  const float scale = (hi - lo) / 16777216.0f;  // 24 random bits
  for (int64_t i = 0; i < n; ++i) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    data[i] = lo + static_cast<float>(z >> 40) * scale;
  }
}

}  // namespace flashdelta::cli
