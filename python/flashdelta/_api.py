"""The generic entry points: forward, decode and backward of the one recurrence.

torch tensors go through the torch.library custom ops (autograd, torch.compile), except a plain
eager call, which runs the op's body directly (see _torch_ops.direct: the dispatcher costs
more host time than a GPU decode step); NumPy arrays and other DLPack arrays on the CPU get
NumPy outputs. The fla-named functions (flashdelta.ops) are thin wrappers over `forward` and
`decode`. CUDA tensors run on the current torch stream; every tensor of a call, index tensors
included, must be on q's device (nothing is copied to or read on the host).
"""

from . import _core

try:
    import torch
    from . import _torch_ops
except ImportError:  # torch is optional
    torch = None
    _torch_ops = None


_FLOAT64 = torch.float64 if torch is not None else None
_MECHANISMS = frozenset(_core.MECHANISMS)
_SCHEDULES = frozenset(_core.SCHEDULES)


def is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def _is_array(x):
    return hasattr(x, "__dlpack__") or type(x).__module__ == "numpy"


def check_arrays(arrays, required=("q", "k", "v")):
    """TypeError naming the argument for anything that is not an array, or a torch/non-torch
    mix; ValueError for a device mix. Returns True when the call is a torch call."""
    q = arrays["q"]
    for name in required:
        if arrays.get(name) is None:
            raise TypeError(f"argument '{name}': is required, got None")
    if is_torch(q):
        Tensor, device = torch.Tensor, q.device
        for name, x in arrays.items():
            if x is not None and (not isinstance(x, Tensor) or x.device != device):
                if not isinstance(x, Tensor):
                    raise TypeError(f"argument '{name}': expected a torch.Tensor like q, got "
                                    f"{type(x).__module__}.{type(x).__qualname__}")
                raise ValueError(f"argument '{name}': expected device {device} (the device "
                                 f"of q), got {x.device}")
        return True
    for name, x in arrays.items():
        if x is not None and (is_torch(x) or not _is_array(x)):
            raise TypeError(f"argument '{name}': expected an array of the same kind as q "
                            f"({type(q).__module__}.{type(q).__qualname__}), got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
    return False


def check_rank(x, name, rank, dims):
    if x is not None and len(x.shape) != rank:
        raise ValueError(f"argument '{name}': expected rank {rank} {dims}, got shape "
                         f"{list(x.shape)}")


def check_float_q(q):
    """q's dtype sets the output dtype, so it is checked before outputs are allocated."""
    name = _core.dtype_name(q)
    if name not in _core.FLOAT_DTYPES:
        raise TypeError(f"argument 'q': expected a float dtype ({', '.join(_core.FLOAT_DTYPES)})"
                        f", got {name}")


def _numpy_empty(shape, dtype):
    import numpy
    if dtype == "bfloat16":
        raise TypeError("argument 'q': bfloat16 NumPy inputs need torch (NumPy has no "
                        "bfloat16 output type); pass float32, float16 or float64")
    return numpy.empty(shape, dtype=dtype)


def pick_schedule(schedule, default, q):
    """The requested schedule, or the default; float64 inputs run the fp64 reference, so
    float64 results (and gradcheck) are exact."""
    if schedule is not None:
        if schedule not in _core.SCHEDULES:
            raise ValueError(f"argument 'schedule': expected one of {', '.join(_core.SCHEDULES)}"
                             f", got {schedule!r}")
        return schedule
    dtype = getattr(q, "dtype", None)
    wide = dtype is not None and (dtype is _FLOAT64 or str(dtype) == "float64")
    return "reference" if wide else default


def host_offsets(cu_seqlens, cu_seqlens_cpu=None):
    """cu_seqlens as host ints (None without it), to size the per-chunk states:
    cu_seqlens_cpu when given, else cu_seqlens itself, which for a CUDA tensor is a
    device-to-host copy that synchronises (as fla's chunk indices are)."""
    if cu_seqlens is None:
        return None
    offsets = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
    return [int(x) for x in (offsets.tolist() if hasattr(offsets, "tolist") else offsets)]


def forward(q, k, v, g=None, beta=None, *, mechanism, scale=None, initial_state=None,
            output_final_state=False, cu_seqlens=None, qk_l2norm=False, beta_sigmoid=False,
            allow_neg_eigval=False, gate_in_kernel=False, A_log=None, dt_bias=None,
            lower_bound=None, state_v_first=False, chunk_size=16, schedule=None,
            output_chunk_states=False, cu_seqlens_cpu=None, keep_chunk_states=False):
    """Runs the recurrence (see the package docstring) and returns (o, final_state or None),
    or with output_chunk_states (o, final_state or None, chunk_states).

    Shapes (fla layout): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (vector gate) or
    [B, T, HV] (scalar gate); beta [B, T, HV]; state [N, HV, K, V] ([N, HV, V, K] with
    state_v_first); cu_seqlens int [N + 1] with B = 1. mechanism is one of linear,
    simple_gla, gla, deltanet, gated_deltanet, kda. schedule: chunk (default), recurrent or
    reference; float64 inputs run the reference unless a schedule is given. o has q's dtype
    (float64 for the reference), the final state float32 (float64 for the reference or
    float64 inputs).

    output_chunk_states: also return the state entering every 64-token chunk, i.e. before
    tokens 0, 64, 128, ... of each sequence: [B, NT, HV, K, V] ([B, NT, HV, V, K] with
    state_v_first) in o's dtype, NT = ceil(T / 64); with cu_seqlens B = 1 and NT the chunks
    of all sequences, in order (fla's h of return_intermediate_states). Inference only: no
    input may require grad. With cu_seqlens the chunks are counted on the host, from
    cu_seqlens_cpu when given, else from cu_seqlens (a synchronising copy for CUDA tensors).

    keep_chunk_states: for training (torch tensors that require grad), keep the state
    entering every 64-token chunk for the backward instead of recomputing it there (fla's
    disable_recompute): it saves the backward's sequential states pass and costs [C, HV, K,
    V] float32 (float64 for the reference) of memory until the backward runs. The gradients
    are the same up to rounding. No effect without autograd.
    """
    if _torch_ops is not None and q.__class__ in _torch_ops._PLAIN:
        # The common eager torch call: the few checks that outputs need, then the op's body
        # without the dispatcher. Anything unusual takes the checked path below, which raises
        # or calls the custom op (torch.compile, autograd, tensor subclasses, modes).
        if schedule is None:
            schedule = "reference" if q.dtype == torch.float64 else "chunk"
        if (not output_chunk_states and q.ndim == 4 and k is not None
                and v.__class__ in _torch_ops._PLAIN and v.ndim == 4
                and q.dtype in _torch_ops.FLOAT_DTYPES and mechanism in _MECHANISMS
                and schedule in _SCHEDULES and (cu_seqlens is None or cu_seqlens.ndim == 1)
                and _torch_ops.direct((q, k, v, g, beta, initial_state, cu_seqlens, A_log,
                                       dt_bias), grad=True)):
            o, final = _torch_ops.forward_impl(
                q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, mechanism, scale,
                qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound,
                state_v_first, chunk_size, output_final_state, schedule)
            return o, (final if output_final_state else None)
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    use_torch = check_arrays(arrays)
    for name in ("q", "k", "v"):
        check_rank(arrays[name], name, 4, "[B, T, H, K]" if name != "v" else "[B, T, HV, V]")
    check_rank(initial_state, "initial_state", 4,
                "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]")
    check_rank(cu_seqlens, "cu_seqlens", 1, "[N + 1]")
    check_float_q(q)
    if mechanism not in _core.MECHANISMS:
        raise ValueError(f"argument 'mechanism': expected one of {', '.join(_core.MECHANISMS)}"
                         f", got {mechanism!r}")
    schedule = pick_schedule(schedule, "chunk", q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    config = (mechanism, float(scale), bool(qk_l2norm), bool(beta_sigmoid),
              bool(allow_neg_eigval), bool(gate_in_kernel),
              None if lower_bound is None else float(lower_bound), bool(state_v_first),
              int(chunk_size))
    if output_chunk_states:
        if use_torch:
            _torch_ops.check_no_grad(arrays.items(), "output_chunk_states")
        num_chunks = _core.chunks_per_row(q.shape[1], host_offsets(cu_seqlens, cu_seqlens_cpu))
    if use_torch:
        if output_chunk_states:
            o, final, h = _torch_ops.forward_chunk_states(
                q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *config,
                bool(output_final_state), schedule, num_chunks)
            return o, (final if output_final_state else None), h
        keep = bool(keep_chunk_states) and _torch_ops.wants_grad(
            (q, k, v, g, beta, initial_state, A_log, dt_bias))
        o, final, _ = _torch_ops.forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log,
                                         dt_bias, *config, bool(output_final_state), schedule,
                                         keep)
        return o, (final if output_final_state else None)

    o_shape, state_shape = _core.forward_shapes(
        q.shape, v.shape, None if cu_seqlens is None else cu_seqlens.shape, state_v_first)
    o_dtype, state_dtype = _core.output_dtypes(
        _core.dtype_name(q), None if initial_state is None else _core.dtype_name(initial_state),
        schedule)
    o = _numpy_empty(o_shape, o_dtype)
    final = _numpy_empty(state_shape, state_dtype) if output_final_state else None
    if not output_chunk_states:
        _core.run_forward(arrays, o, final, _core.make_options(*config), schedule)
        return o, final
    h = _numpy_empty(_core.chunk_states_shape(q.shape, v.shape, num_chunks, state_v_first),
                     o_dtype)
    _core.run_forward(arrays, o, final, _core.make_options(*config), schedule,
                      h.reshape((h.shape[0] * h.shape[1],) + h.shape[2:]))
    return o, final, h


def decode(q, k, v, g=None, beta=None, *, mechanism, state_pool, state_indices,
           num_accepted_tokens=None, cu_seqlens=None, scale=None, qk_l2norm=False,
           beta_sigmoid=False, allow_neg_eigval=False, gate_in_kernel=False, A_log=None,
           dt_bias=None, lower_bound=None, state_v_first=False, schedule="recurrent"):
    """Stateful serving step over a state pool; returns o and updates state_pool in place.

    q, k [N, T, H, K], v [N, T, HV, V] (or B = 1 with cu_seqlens); state_pool [P, HV, K, V]
    float32 (or [P, HV, V, K] with state_v_first); state_indices int32/int64:
      [N]     row n starts from slot state_indices[n] and writes its final state back to it;
      [N, S]  per-token slots: row n starts from slot state_indices[n, a_n - 1] with
              a_n = num_accepted_tokens[n] (1 when absent), and writes the state after its
              token t to slot state_indices[n, t] (when >= 0).
    A start slot of -1 marks a padding row: its outputs are zeros and the pool is untouched.
    """
    return decode_positional(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool,
                             state_indices, num_accepted_tokens, mechanism, scale, qk_l2norm,
                             beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound,
                             state_v_first, schedule)


def decode_positional(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool, state_indices,
                      num_accepted_tokens, mechanism, scale, qk_l2norm, beta_sigmoid,
                      allow_neg_eigval, gate_in_kernel, lower_bound, state_v_first, schedule):
    """`decode` with every argument positional, in the op's order: matching 19 keyword
    arguments costs 0.4 us a call, a tenth of the serving form's host time on the CPU."""
    if (_torch_ops is not None and q.__class__ in _torch_ops._PLAIN and q.ndim == 4
            and k is not None and v.__class__ in _torch_ops._PLAIN and v.ndim == 4
            and state_pool is not None and state_indices is not None
            and q.dtype in _torch_ops.FLOAT_DTYPES and mechanism in _MECHANISMS
            and schedule in _SCHEDULES
            and _torch_ops.direct((q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool,
                                   state_indices, num_accepted_tokens))):
        # The common eager torch call (see forward); decode has no autograd formula.
        return _torch_ops.decode_direct(q, k, v, g, beta, cu_seqlens, A_log, dt_bias,
                                        state_pool, state_indices, num_accepted_tokens,
                                        mechanism, scale, qk_l2norm, beta_sigmoid,
                                        allow_neg_eigval, gate_in_kernel, lower_bound,
                                        state_v_first, schedule)
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, A_log=A_log,
                  dt_bias=dt_bias, state_pool=state_pool, state_indices=state_indices,
                  num_accepted_tokens=num_accepted_tokens)
    use_torch = check_arrays(arrays, required=("q", "k", "v", "state_pool", "state_indices"))
    for name in ("q", "k", "v"):
        check_rank(arrays[name], name, 4, "[N, T, H, K]" if name != "v" else "[N, T, HV, V]")
    check_float_q(q)
    if mechanism not in _core.MECHANISMS:
        raise ValueError(f"argument 'mechanism': expected one of {', '.join(_core.MECHANISMS)}"
                         f", got {mechanism!r}")
    if schedule not in _core.SCHEDULES:
        raise ValueError(f"argument 'schedule': expected one of {', '.join(_core.SCHEDULES)}, "
                         f"got {schedule!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    config = (mechanism, float(scale), bool(qk_l2norm), bool(beta_sigmoid),
              bool(allow_neg_eigval), bool(gate_in_kernel),
              None if lower_bound is None else float(lower_bound), bool(state_v_first))
    if use_torch:
        _torch_ops.check_decode_grad(arrays.items())
        return _torch_ops.decode(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool,
                                 state_indices, num_accepted_tokens, *config, schedule)
    o_dtype, _ = _core.output_dtypes(_core.dtype_name(q), None, schedule)
    o = _numpy_empty(tuple(q.shape[:2]) + tuple(v.shape[2:]), o_dtype)
    _core.run_decode(arrays, state_pool, state_indices, num_accepted_tokens, o,
                     _core.make_options(*config), schedule)
    return o


def backward(q, k, v, g=None, beta=None, *, mechanism, d_o, d_final_state=None, scale=None,
             initial_state=None, cu_seqlens=None, qk_l2norm=False, beta_sigmoid=False,
             allow_neg_eigval=False, gate_in_kernel=False, A_log=None, dt_bias=None,
             lower_bound=None, state_v_first=False, chunk_states=None):
    """Gradients of forward's outputs for NumPy (and other DLPack) arrays, without torch.

    Returns a dict input name -> gradient for every present input among q, k, v, g, beta,
    initial_state, A_log and dt_bias, computed by the library's backward (the fp64 reference
    on the CPU). torch users get the same through autograd.

    chunk_states: the forward's per-chunk states as forward(output_chunk_states=True)
    returns them ([B, NT, HV, K, V]), read instead of recomputed: the gradients are those of
    a forward that enters every 64-token chunk with these states.
    """
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    if check_arrays(dict(arrays, d_o=d_o, d_final_state=d_final_state,
                         chunk_states=chunk_states),
                    required=("q", "k", "v", "d_o")):
        raise TypeError("argument 'q': flashdelta.backward takes NumPy-like arrays; torch "
                        "tensors get gradients through autograd")
    import numpy
    if scale is None:
        scale = q.shape[-1] ** -0.5
    options = _core.make_options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                                 gate_in_kernel, lower_bound, state_v_first)
    grads = {n: numpy.empty(arrays[n].shape, dtype=arrays[n].dtype)
             for n in _core.GRAD_INPUTS if arrays[n] is not None}
    if chunk_states is not None:
        check_rank(chunk_states, "chunk_states", 5,
                   "[B, NT, HV, V, K]" if state_v_first else "[B, NT, HV, K, V]")
        chunk_states = chunk_states.reshape((-1,) + tuple(chunk_states.shape[2:]))
    _core.run_backward(arrays, d_o, d_final_state, grads, options, "reference", chunk_states)
    return grads
