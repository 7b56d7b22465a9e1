// flashdelta._C: the nanobind module under the `flashdelta` Python package.
//
// It converts, validates and dispatches; it adds no math. Every tensor argument is any
// DLPack-capable array (torch, NumPy, JAX, CuPy) or None, read as a strided TensorView
// without copying; outputs are allocated by the caller (the Python package) and written in
// place, so temporary memory comes from the caller's allocator. The GIL is released while
// the library runs. flashdelta::Error becomes ValueError (TypeError for a wrong dtype),
// NotImplementedError (unsupported) or RuntimeError, keeping the library's message, which
// names the argument.
//
// Per-call cost matters (a decode step is called once per generated token): arrays whose type
// offers the DLPack C exchange API (`type(x).__dlpack_c_exchange_api__`, torch >= 2.10) are
// read through its non-owning `dltensor_from_py_object_no_sync`, tens of nanoseconds instead of
// microseconds for a Python-level `__dlpack__()` call; everything else goes through nanobind's
// ndarray. CUDA work runs on the stream the caller passes (an integer cudaStream_t, 0 = the
// default stream); the binding never synchronises.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
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

// The DLPack C exchange API (DLPack >= 1.2; dlpack.h's DLPackExchangeAPI), declared here
// with the layout of the DLPack ABI so that no framework header is needed.
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLPackExchangeAPIHeader {
  DLPackVersion version;
  DLPackExchangeAPIHeader* prev_api;
};
struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

// The exchange API of a Python type, or nullptr: `__dlpack_c_exchange_api__` (a PyCapsule named
// "dlpack_exchange_api", the DLPack 1.3 convention) or the earlier `__c_dlpack_exchange_api__`
// (an integer address). Looked up once per type; the cache keeps a reference to each type so
// that its address cannot be reused by another.
const DLPackExchangeAPI* exchange_api(PyTypeObject* type) {
  struct Entry {
    PyTypeObject* type;
    const DLPackExchangeAPI* api;
  };
  static Entry cache[8];
  static int used = 0;
  for (int i = 0; i < used; ++i)
    if (cache[i].type == type) return cache[i].api;

  const DLPackExchangeAPI* api = nullptr;
  PyObject* attr = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type),
                                          "__dlpack_c_exchange_api__");
  if (attr && PyCapsule_CheckExact(attr)) {
    api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(attr, "dlpack_exchange_api"));
  } else {
    Py_XDECREF(attr);
    PyErr_Clear();
    attr = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__c_dlpack_exchange_api__");
    if (attr && PyLong_Check(attr))
      api = static_cast<const DLPackExchangeAPI*>(PyLong_AsVoidPtr(attr));
  }
  Py_XDECREF(attr);
  PyErr_Clear();
  if (api && (api->header.version.major != 1 || api->header.version.minor < 2 ||
              !api->dltensor_from_py_object_no_sync))
    api = nullptr;
  if (used < static_cast<int>(sizeof(cache) / sizeof(cache[0]))) {
    Py_INCREF(reinterpret_cast<PyObject*>(type));
    cache[used++] = {type, api};
  }
  return api;
}

// Converts the arrays of one call into views and keeps them alive for the call's duration.
// The first array converted is q: every other one must be of the same kind (a torch tensor
// with torch tensors, NumPy-like arrays with NumPy-like arrays: TypeError) and on the same
// device, index included (ValueError): the library checks the device kind, not the index,
// which a TensorView does not carry.
class CallViews {
 public:
  // An input (read-only is fine); None gives an absent view.
  fd::TensorView input(nb::handle obj, const char* name) {
    if (obj.is_none()) return {};
    fd::TensorView v;
    if (fast(obj, name, &v)) return v;
    nb::ndarray<nb::ro> a;
    if (!cast(obj, a)) {
      if (nb::hasattr(obj, "__dlpack__"))
        value_error(arg(name) + "could not be read through DLPack" + device_note(obj) +
                    "; expected a cpu or cuda array on the device of q");
      type_error(arg(name) + "expected a DLPack array (torch.Tensor, numpy.ndarray, ...), got " +
                 type_name(obj));
    }
    inputs_.push_back(a);
    return view_of(obj, a, const_cast<void*>(static_cast<const void*>(a.data())), name);
  }

  // An output written in place; None gives an absent view.
  fd::TensorView output(nb::handle obj, const char* name) {
    if (obj.is_none()) return {};
    fd::TensorView v;
    if (fast(obj, name, &v)) return v;
    nb::ndarray<> a;
    if (!cast(obj, a))
      type_error(arg(name) + "expected a writable array supporting DLPack, got " + type_name(obj) +
                 device_note(obj) + " (read-only arrays cannot be written)");
    outputs_.push_back(a);
    return view_of(obj, a, a.data(), name);
  }

 private:
  static std::string type_name(nb::handle obj) {
    return nb::cast<std::string>(nb::type_name(obj.type()));
  }

  // " (device meta)" for an object with a device attribute, else "".
  static std::string device_note(nb::handle obj) {
    try {
      if (nb::hasattr(obj, "device")) {
        nb::object text = nb::steal(PyObject_Str(obj.attr("device").ptr()));
        const char* c = text.is_valid() ? PyUnicode_AsUTF8(text.ptr()) : nullptr;
        if (c) return std::string(" (device ") + c + ")";
      }
    } catch (const nb::python_error&) {
    }
    PyErr_Clear();
    return "";
  }

  // nanobind's import; a torch tensor that requires grad refuses `__dlpack__()`, and the
  // library never writes inputs (outputs do not require grad), so it is read detached.
  template <class Array>
  static bool cast(nb::handle obj, Array& a) {
    if (nb::try_cast(obj, a)) return true;
    try {
      if (nb::hasattr(obj, "requires_grad") && nb::cast<bool>(obj.attr("requires_grad"))) {
        nb::object detached = obj.attr("detach")();
        return nb::try_cast(detached, a);  // the ndarray keeps the detached tensor alive
      }
    } catch (const nb::python_error&) {
    }
    return false;
  }

  // Through the exchange API: true with *out filled, false to take nanobind's path (no API,
  // or the producer refused, e.g. a meta tensor: nanobind's path then reports it). The view
  // only borrows: the caller's references keep the object, and so its data, alive for the call.
  bool fast(nb::handle obj, const char* name, fd::TensorView* out) {
    const DLPackExchangeAPI* api = exchange_api(Py_TYPE(obj.ptr()));
    if (!api) return false;
    nb::dlpack::dltensor t;
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) {
      PyErr_Clear();
      return false;
    }
    *out = view_from(obj, api, t.dtype, t.device.device_type, t.device.device_id, t.ndim, t.shape,
                     t.strides, static_cast<char*>(t.data) + t.byte_offset, name);
    return true;
  }

  template <class Array>
  fd::TensorView view_of(nb::handle obj, const Array& a, void* data, const char* name) {
    int64_t shape[fd::kMaxRank + 1], stride[fd::kMaxRank + 1];
    const int ndim = static_cast<int>(a.ndim());
    for (int d = 0; d < ndim && d <= fd::kMaxRank; ++d) {
      shape[d] = static_cast<int64_t>(a.shape(d));
      stride[d] = a.stride_ptr() ? a.stride(d) : 0;
    }
    return view_from(obj, exchange_api(Py_TYPE(obj.ptr())), a.dtype(), a.device_type(),
                     a.device_id(), ndim, shape, a.stride_ptr() ? stride : nullptr, data, name);
  }

  static std::string device_str(int32_t type, int32_t id) {
    if (type == nb::device::cpu::value) return "cpu";
    if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
    return "DLPack device type " + std::to_string(type);
  }

  // kind: the exchange API of the object's type (nullptr for arrays without one), which tells
  // torch tensors from NumPy-like arrays without importing either.
  fd::TensorView view_from(nb::handle obj, const DLPackExchangeAPI* kind, nb::dlpack::dtype dtype,
                           int32_t device_type, int32_t device_id, int ndim, const int64_t* shape,
                           const int64_t* strides, void* data, const char* name) {
    if (!first_type_) {
      first_type_ = obj.type();
      first_kind_ = kind;
      first_device_type_ = device_type;
      first_device_id_ = device_id;
    } else {
      if (kind != first_kind_)
        type_error(arg(name) + "expected an array of the same kind as q (" +
                   nb::cast<std::string>(nb::type_name(first_type_)) + "), got " + type_name(obj));
      if (device_type != first_device_type_ ||
          (device_type != nb::device::cpu::value && device_id != first_device_id_))
        value_error(arg(name) + "expected device " +
                    device_str(first_device_type_, first_device_id_) + " (the device of q), got " +
                    device_str(device_type, device_id));
    }
    fd::TensorView v;
    if (!to_dtype(dtype, &v.dtype))
      type_error(arg(name) + "unsupported dtype " + dlpack_dtype_str(dtype) +
                 "; expected float32, bfloat16, float16, float64 (or int32/int64 for indices)");
    if (device_type == nb::device::cpu::value) {
      v.device = fd::Device::cpu;
    } else if (device_type == nb::device::cuda::value) {
      v.device = fd::Device::cuda;
    } else {
      value_error(arg(name) + "unsupported device (DLPack device type " +
                  std::to_string(device_type) + "); expected cpu or cuda");
    }
    if (ndim > fd::kMaxRank)
      value_error(arg(name) + "expected at most " + std::to_string(fd::kMaxRank) +
                  " dimensions, got " + std::to_string(ndim));
    v.data = data;
    v.rank = ndim;
    int64_t dense = 1;  // DLPack may omit strides for a dense row-major array
    for (int d = v.rank - 1; d >= 0; --d) {
      v.shape[d] = shape[d];
      v.stride[d] = strides ? strides[d] : dense;
      dense *= v.shape[d];
    }
    return v;
  }

  nb::handle first_type_;
  const DLPackExchangeAPI* first_kind_ = nullptr;
  int32_t first_device_type_ = 0;
  int32_t first_device_id_ = 0;
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

// The per-token inputs every entry point takes, read in one order (q first: it fixes the
// array kind and device the others must match).
template <class Args>
void set_token_inputs(CallViews& views, Args& a, nb::handle q, nb::handle k, nb::handle v,
                      nb::handle g, nb::handle beta, nb::handle cu_seqlens, nb::handle A_log,
                      nb::handle dt_bias) {
  a.q = views.input(q, "q");
  a.k = views.input(k, "k");
  a.v = views.input(v, "v");
  a.g = views.input(g, "g");
  a.beta = views.input(beta, "beta");
  a.cu_seqlens = views.input(cu_seqlens, "cu_seqlens");
  a.A_log = views.input(A_log, "A_log");
  a.dt_bias = views.input(dt_bias, "dt_bias");
}

// The workspace of a CUDA chunk call from the caller's allocator (a callable nbytes ->
// device address, e.g. backed by torch's caching allocator, which keeps the memory alive for
// the call); None, or a call that needs none, leaves the library to allocate.
// Only the chunk schedule takes one: other calls skip the sizing (a second validation).
template <class Args, class Bytes>
void take_workspace(nb::handle allocate, fd::Schedule s, Args& a, Bytes bytes_of) {
  if (allocate.is_none() || s != fd::Schedule::chunk) return;
  const size_t bytes = bytes_of(a, s);
  if (bytes == 0) return;
  a.workspace = reinterpret_cast<void*>(nb::cast<uintptr_t>(allocate(bytes)));
  a.workspace_bytes = bytes;
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
         nb::handle o, nb::handle final_state, nb::handle chunk_states,
         const fd::Options& options, const std::string& schedule, nb::handle workspace,
         uintptr_t stream) {
        CallViews views;
        fd::ForwardArgs a;
        set_token_inputs(views, a, q, k, v, g, beta, cu_seqlens, A_log, dt_bias);
        a.initial_state = views.input(initial_state, "initial_state");
        a.o = views.output(o, "o");
        a.final_state = views.output(final_state, "final_state");
        a.chunk_states = views.output(chunk_states, "chunk_states");
        a.stream = reinterpret_cast<void*>(stream);
        const fd::Schedule s = fd::parse_schedule(schedule);
        take_workspace(workspace, s, a, [&](const fd::ForwardArgs& x, fd::Schedule y) {
          return fd::forward_workspace_bytes(x, options, y);
        });
        nb::gil_scoped_release release;
        fd::forward(a, options, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g").none(), nb::arg("beta").none(),
      nb::arg("initial_state").none(), nb::arg("cu_seqlens").none(), nb::arg("A_log").none(),
      nb::arg("dt_bias").none(), nb::arg("o"), nb::arg("final_state").none(),
      nb::arg("chunk_states").none(), nb::arg("options"), nb::arg("schedule"),
      nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0,
      "flashdelta::forward: writes o (and final_state, chunk_states [C, HV, K, V] when given) in "
      "place; CUDA work is queued on `stream` (an integer cudaStream_t, 0 = the default "
      "stream). workspace: None (the library allocates in stream order) or a callable "
      "nbytes -> device address of memory that stays valid for the call's work on `stream`.");

  m.def(
      "decode",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
         nb::handle cu_seqlens, nb::handle A_log, nb::handle dt_bias, nb::handle state_pool,
         nb::handle state_indices, nb::handle num_accepted_tokens, nb::handle o,
         const fd::Options& options, const std::string& schedule, uintptr_t stream) {
        CallViews views;
        fd::DecodeArgs a;
        set_token_inputs(views, a, q, k, v, g, beta, cu_seqlens, A_log, dt_bias);
        a.state_pool = views.output(state_pool, "state_pool");
        a.state_indices = views.input(state_indices, "state_indices");
        a.num_accepted_tokens = views.input(num_accepted_tokens, "num_accepted_tokens");
        a.o = views.output(o, "o");
        a.stream = reinterpret_cast<void*>(stream);
        const fd::Schedule s = fd::parse_schedule(schedule);
        nb::gil_scoped_release release;
        fd::decode(a, options, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g").none(), nb::arg("beta").none(),
      nb::arg("cu_seqlens").none(), nb::arg("A_log").none(), nb::arg("dt_bias").none(),
      nb::arg("state_pool"), nb::arg("state_indices"), nb::arg("num_accepted_tokens").none(),
      nb::arg("o"), nb::arg("options"), nb::arg("schedule"), nb::arg("stream") = 0,
      "flashdelta::decode: writes o and updates state_pool in place (on `stream` for CUDA).");

  m.def(
      "backward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
         nb::handle initial_state, nb::handle cu_seqlens, nb::handle A_log, nb::handle dt_bias,
         nb::handle d_o, nb::handle d_final_state, nb::handle dq, nb::handle dk, nb::handle dv,
         nb::handle dg, nb::handle dbeta, nb::handle d_initial_state, nb::handle dA_log,
         nb::handle ddt_bias, const fd::Options& options, const std::string& schedule,
         nb::handle workspace, uintptr_t stream, nb::handle chunk_states) {
        CallViews views;
        fd::BackwardArgs a;
        set_token_inputs(views, a, q, k, v, g, beta, cu_seqlens, A_log, dt_bias);
        a.initial_state = views.input(initial_state, "initial_state");
        a.d_o = views.input(d_o, "d_o");
        a.d_final_state = views.input(d_final_state, "d_final_state");
        a.chunk_states = views.input(chunk_states, "chunk_states");
        a.dq = views.output(dq, "dq");
        a.dk = views.output(dk, "dk");
        a.dv = views.output(dv, "dv");
        a.dg = views.output(dg, "dg");
        a.dbeta = views.output(dbeta, "dbeta");
        a.d_initial_state = views.output(d_initial_state, "d_initial_state");
        a.dA_log = views.output(dA_log, "dA_log");
        a.ddt_bias = views.output(ddt_bias, "ddt_bias");
        a.stream = reinterpret_cast<void*>(stream);
        const fd::Schedule s = fd::parse_schedule(schedule);
        take_workspace(workspace, s, a, [&](const fd::BackwardArgs& x, fd::Schedule y) {
          return fd::backward_workspace_bytes(x, options, y);
        });
        nb::gil_scoped_release release;
        fd::backward(a, options, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g").none(), nb::arg("beta").none(),
      nb::arg("initial_state").none(), nb::arg("cu_seqlens").none(), nb::arg("A_log").none(),
      nb::arg("dt_bias").none(), nb::arg("d_o"), nb::arg("d_final_state").none(),
      nb::arg("dq").none(), nb::arg("dk").none(), nb::arg("dv").none(), nb::arg("dg").none(),
      nb::arg("dbeta").none(), nb::arg("d_initial_state").none(), nb::arg("dA_log").none(),
      nb::arg("ddt_bias").none(), nb::arg("options"), nb::arg("schedule"),
      nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0,
      nb::arg("chunk_states").none() = nb::none(),
      "flashdelta::backward: writes the requested gradients in place (on `stream` for CUDA); "
      "workspace as in forward; chunk_states: the forward's kept per-chunk states [C, HV, K, "
      "V] (read instead of recomputed), or None.");

  m.def("version", &fd::version);
  m.def("cpu_simd_target", &fd::cpu_simd_target);
}
