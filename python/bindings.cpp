// flashdelta._C: the nanobind module under the `flashdelta` Python package.
//
// It converts, validates and dispatches; it adds no math. Every tensor argument is any
// DLPack-capable array (torch, NumPy, JAX, CuPy) or None, read as a strided TensorView
// without copying; outputs are allocated by the caller (the Python package) and written in
// place, so temporary memory comes from the caller's allocator. The GIL is released while
// the library runs. flashdelta::Error becomes ValueError (TypeError for a wrong dtype),
// NotImplementedError (unsupported) or RuntimeError, keeping the library's message, which
// names the argument.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>
#include <vector>

#include "flashdelta/flashdelta.h"

namespace nb = nanobind;
namespace fd = flashdelta;

namespace {

std::string arg(const char* name) { return std::string("argument '") + name + "': "; }

[[noreturn]] void type_error(const std::string& message) { throw nb::type_error(message.c_str()); }
[[noreturn]] void value_error(const std::string& message) {
  throw nb::value_error(message.c_str());
}

// The DLPack element types FlashDelta reads.
struct DTypeMatch {
  nb::dlpack::dtype_code code;
  uint8_t bits;
  fd::DType dtype;
};
constexpr DTypeMatch kDTypes[] = {
    {nb::dlpack::dtype_code::Float, 32, fd::DType::f32},
    {nb::dlpack::dtype_code::Float, 64, fd::DType::f64},
    {nb::dlpack::dtype_code::Float, 16, fd::DType::f16},
    {nb::dlpack::dtype_code::Bfloat, 16, fd::DType::bf16},
    {nb::dlpack::dtype_code::Int, 32, fd::DType::i32},
    {nb::dlpack::dtype_code::Int, 64, fd::DType::i64},
};

bool to_dtype(nb::dlpack::dtype t, fd::DType* out) {
  for (const DTypeMatch& m : kDTypes)
    if (t.code == static_cast<uint8_t>(m.code) && t.bits == m.bits && t.lanes == 1) {
      *out = m.dtype;
      return true;
    }
  return false;
}

std::string dlpack_dtype_str(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  std::string kind;
  switch (static_cast<Code>(t.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Complex: kind = "complex"; break;
    case Code::Bool: return "bool";
    default: kind = "dlpack-type-" + std::to_string(t.code) + "-"; break;
  }
  return kind + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

// Converts the arrays of one call into views and keeps them alive for the call's duration.
class CallViews {
 public:
  // An input (read-only is fine); None gives an absent view.
  fd::TensorView input(nb::handle obj, const char* name) {
    if (obj.is_none()) return {};
    nb::ndarray<nb::ro> a;
    if (!nb::try_cast(obj, a))
      type_error(arg(name) + "expected a DLPack array (torch.Tensor, numpy.ndarray, ...), got " +
                 type_name(obj));
    inputs_.push_back(a);
    return view_of(a, const_cast<void*>(static_cast<const void*>(a.data())), name);
  }

  // An output written in place; None gives an absent view.
  fd::TensorView output(nb::handle obj, const char* name) {
    if (obj.is_none()) return {};
    nb::ndarray<> a;
    if (!nb::try_cast(obj, a))
      type_error(arg(name) + "expected a writable array supporting DLPack, got " + type_name(obj) +
                 " (read-only arrays cannot be written)");
    outputs_.push_back(a);
    return view_of(a, a.data(), name);
  }

 private:
  static std::string type_name(nb::handle obj) {
    return nb::cast<std::string>(nb::type_name(obj.type()));
  }

  template <class Array>
  static fd::TensorView view_of(const Array& a, void* data, const char* name) {
    fd::TensorView v;
    if (!to_dtype(a.dtype(), &v.dtype))
      type_error(arg(name) + "unsupported dtype " + dlpack_dtype_str(a.dtype()) +
                 "; expected float32, bfloat16, float16, float64 (or int32/int64 for indices)");
    if (a.device_type() == nb::device::cpu::value) {
      v.device = fd::Device::cpu;
    } else if (a.device_type() == nb::device::cuda::value) {
      v.device = fd::Device::cuda;
    } else {
      value_error(arg(name) + "unsupported device (DLPack device type " +
                  std::to_string(a.device_type()) + "); expected cpu or cuda");
    }
    if (a.ndim() > static_cast<size_t>(fd::kMaxRank))
      value_error(arg(name) + "expected at most " + std::to_string(fd::kMaxRank) +
                  " dimensions, got " + std::to_string(a.ndim()));
    v.data = data;
    v.rank = static_cast<int>(a.ndim());
    int64_t dense = 1;  // DLPack may omit strides for a dense row-major array
    for (int d = v.rank - 1; d >= 0; --d) {
      v.shape[d] = static_cast<int64_t>(a.shape(d));
      v.stride[d] = a.stride_ptr() ? a.stride(d) : dense;
      dense *= v.shape[d];
    }
    return v;
  }

  std::vector<nb::ndarray<nb::ro>> inputs_;
  std::vector<nb::ndarray<>> outputs_;
};

// A dtype problem reads "expected a float dtype ..., got int32" or "expected int32 or int64,
// got float32": Python reports those as TypeError.
bool is_dtype_error(const std::string& message) {
  if (message.find("dtype") != std::string::npos) return true;
  for (fd::DType t : {fd::DType::f32, fd::DType::bf16, fd::DType::f16, fd::DType::f64,
                      fd::DType::i32, fd::DType::i64}) {
    const std::string tail = std::string("got ") + fd::dtype_name(t);
    if (message.size() >= tail.size() &&
        message.compare(message.size() - tail.size(), tail.size(), tail) == 0)
      return true;
  }
  return false;
}

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const fd::Error& e) {
    PyObject* type = PyExc_RuntimeError;
    if (e.code() == fd::ErrorCode::invalid_argument)
      type = is_dtype_error(e.what()) ? PyExc_TypeError : PyExc_ValueError;
    else if (e.code() == fd::ErrorCode::unsupported)
      type = PyExc_NotImplementedError;
    PyErr_SetString(type, e.what());
  }
}

fd::StateLayout parse_layout(const std::string& s) {
  if (s == "k_first") return fd::StateLayout::k_first;
  if (s == "v_first") return fd::StateLayout::v_first;
  throw fd::Error(fd::ErrorCode::invalid_argument,
                  "argument 'state_layout': expected k_first or v_first, got " + s);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "FlashDelta C++ library bindings (internal; use the flashdelta package).";
  nb::register_exception_translator(translate_error);

  nb::class_<fd::Options>(m, "Options")
      .def(nb::init<>())
      .def_prop_rw(
          "mechanism",
          [](const fd::Options& o) { return std::string(fd::mechanism_name(o.mechanism)); },
          [](fd::Options& o, const std::string& s) { o.mechanism = fd::parse_mechanism(s); })
      .def_rw("scale", &fd::Options::scale)
      .def_rw("qk_l2norm", &fd::Options::qk_l2norm)
      .def_rw("beta_sigmoid", &fd::Options::beta_sigmoid)
      .def_rw("allow_neg_eigval", &fd::Options::allow_neg_eigval)
      .def_rw("gate_in_kernel", &fd::Options::gate_in_kernel)
      .def_rw("lower_bound", &fd::Options::lower_bound)
      .def_prop_rw(
          "state_layout",
          [](const fd::Options& o) {
            return std::string(o.state_layout == fd::StateLayout::k_first ? "k_first" : "v_first");
          },
          [](fd::Options& o, const std::string& s) { o.state_layout = parse_layout(s); })
      .def_rw("chunk_size", &fd::Options::chunk_size)
      .def_rw("num_threads", &fd::Options::num_threads);

  m.def(
      "forward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
         nb::handle initial_state, nb::handle cu_seqlens, nb::handle A_log, nb::handle dt_bias,
         nb::handle o, nb::handle final_state, const fd::Options& options,
         const std::string& schedule) {
        CallViews views;
        fd::ForwardArgs a;
        a.q = views.input(q, "q");
        a.k = views.input(k, "k");
        a.v = views.input(v, "v");
        a.g = views.input(g, "g");
        a.beta = views.input(beta, "beta");
        a.initial_state = views.input(initial_state, "initial_state");
        a.cu_seqlens = views.input(cu_seqlens, "cu_seqlens");
        a.A_log = views.input(A_log, "A_log");
        a.dt_bias = views.input(dt_bias, "dt_bias");
        a.o = views.output(o, "o");
        a.final_state = views.output(final_state, "final_state");
        const fd::Schedule s = fd::parse_schedule(schedule);
        nb::gil_scoped_release release;
        fd::forward(a, options, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g").none(), nb::arg("beta").none(),
      nb::arg("initial_state").none(), nb::arg("cu_seqlens").none(), nb::arg("A_log").none(),
      nb::arg("dt_bias").none(), nb::arg("o"), nb::arg("final_state").none(), nb::arg("options"),
      nb::arg("schedule"), "flashdelta::forward: writes o (and final_state when given) in place.");

  m.def(
      "decode",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
         nb::handle cu_seqlens, nb::handle A_log, nb::handle dt_bias, nb::handle state_pool,
         nb::handle state_indices, nb::handle num_accepted_tokens, nb::handle o,
         const fd::Options& options, const std::string& schedule) {
        CallViews views;
        fd::DecodeArgs a;
        a.q = views.input(q, "q");
        a.k = views.input(k, "k");
        a.v = views.input(v, "v");
        a.g = views.input(g, "g");
        a.beta = views.input(beta, "beta");
        a.cu_seqlens = views.input(cu_seqlens, "cu_seqlens");
        a.A_log = views.input(A_log, "A_log");
        a.dt_bias = views.input(dt_bias, "dt_bias");
        a.state_pool = views.output(state_pool, "state_pool");
        a.state_indices = views.input(state_indices, "state_indices");
        a.num_accepted_tokens = views.input(num_accepted_tokens, "num_accepted_tokens");
        a.o = views.output(o, "o");
        const fd::Schedule s = fd::parse_schedule(schedule);
        nb::gil_scoped_release release;
        fd::decode(a, options, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g").none(), nb::arg("beta").none(),
      nb::arg("cu_seqlens").none(), nb::arg("A_log").none(), nb::arg("dt_bias").none(),
      nb::arg("state_pool"), nb::arg("state_indices"), nb::arg("num_accepted_tokens").none(),
      nb::arg("o"), nb::arg("options"), nb::arg("schedule"),
      "flashdelta::decode: writes o and updates state_pool in place.");

  m.def(
      "backward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
         nb::handle initial_state, nb::handle cu_seqlens, nb::handle A_log, nb::handle dt_bias,
         nb::handle d_o, nb::handle d_final_state, nb::handle dq, nb::handle dk, nb::handle dv,
         nb::handle dg, nb::handle dbeta, nb::handle d_initial_state, nb::handle dA_log,
         nb::handle ddt_bias, const fd::Options& options, const std::string& schedule) {
        CallViews views;
        fd::BackwardArgs a;
        a.q = views.input(q, "q");
        a.k = views.input(k, "k");
        a.v = views.input(v, "v");
        a.g = views.input(g, "g");
        a.beta = views.input(beta, "beta");
        a.initial_state = views.input(initial_state, "initial_state");
        a.cu_seqlens = views.input(cu_seqlens, "cu_seqlens");
        a.A_log = views.input(A_log, "A_log");
        a.dt_bias = views.input(dt_bias, "dt_bias");
        a.d_o = views.input(d_o, "d_o");
        a.d_final_state = views.input(d_final_state, "d_final_state");
        a.dq = views.output(dq, "dq");
        a.dk = views.output(dk, "dk");
        a.dv = views.output(dv, "dv");
        a.dg = views.output(dg, "dg");
        a.dbeta = views.output(dbeta, "dbeta");
        a.d_initial_state = views.output(d_initial_state, "d_initial_state");
        a.dA_log = views.output(dA_log, "dA_log");
        a.ddt_bias = views.output(ddt_bias, "ddt_bias");
        const fd::Schedule s = fd::parse_schedule(schedule);
        nb::gil_scoped_release release;
        fd::backward(a, options, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g").none(), nb::arg("beta").none(),
      nb::arg("initial_state").none(), nb::arg("cu_seqlens").none(), nb::arg("A_log").none(),
      nb::arg("dt_bias").none(), nb::arg("d_o"), nb::arg("d_final_state").none(),
      nb::arg("dq").none(), nb::arg("dk").none(), nb::arg("dv").none(), nb::arg("dg").none(),
      nb::arg("dbeta").none(), nb::arg("d_initial_state").none(), nb::arg("dA_log").none(),
      nb::arg("ddt_bias").none(), nb::arg("options"), nb::arg("schedule"),
      "flashdelta::backward: writes the requested gradients in place.");

  m.def("version", &fd::version);
  m.def("cpu_simd_target", &fd::cpu_simd_target);
}
