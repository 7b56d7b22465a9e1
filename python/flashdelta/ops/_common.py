"""What the fla-named functions share: fla's extra keyword arguments, its argument checks,
and small array helpers that work on torch tensors and NumPy arrays alike."""

import inspect
import warnings

from .. import _api, _core
from .._api import is_torch

# Keywords selecting the vLLM-style serving form of fused_recurrent_kda and
# fused_recurrent_gated_delta_rule.
SERVING_KWARGS = frozenset(("ssm_state_indices", "num_accepted_tokens", "inplace_final_state"))
# The serving form's common eager torch call (_torch_ops.serving_direct), None without torch.
# fused_recurrent_kda and fused_recurrent_gated_delta_rule call it themselves, then
# serving_call where it declines: a shared helper's frame around the two would cost the
# serving call ~0.1 us (bench/serving_host_overhead.py).
serving_direct = None if _api._torch_ops is None else _api._torch_ops.serving_direct
# The default of a serving keyword taken as a keyword-only parameter: not passed.
ABSENT = object()


def with_serving_kwargs(kwargs, ssm_state_indices, num_accepted_tokens, inplace_final_state):
    """kwargs plus the serving keywords passed (not ABSENT), as **kwargs would hold them."""
    kwargs = dict(kwargs)
    for name, x in (("ssm_state_indices", ssm_state_indices),
                    ("num_accepted_tokens", num_accepted_tokens),
                    ("inplace_final_state", inplace_final_state)):
        if x is not ABSENT:
            kwargs[name] = x
    return kwargs


def serving_form(fn):
    """Gives fn, a fused_recurrent_* function that takes the serving keywords as keyword-only
    parameters (default ABSENT), fla's signature: inspect shows fla's parameters. They are
    parameters rather than **kwargs entries for speed alone: CPython matches a parameter's
    name by identity, but compares a **kwargs entry's name with every parameter name first
    (~0.4 us a keyword with fla's 17 or 18, bench/serving_host_overhead.py)."""
    sig = inspect.signature(fn)
    fn.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values()
                                               if p.name not in SERVING_KWARGS])
    return fn


# fla keyword arguments that tune fla's own kernels: accepted and ignored (the result is
# the same without them).
_IGNORED_KWARGS = ("cu_seqlens_cpu", "chunk_indices", "disable_recompute", "use_graph",
                   "max_num_seqs")


def extra_options(fn_name, kwargs, state_v_first=False):
    """Consumes the keyword arguments fla takes through **kwargs (plus `schedule`, which picks
    a FlashDelta schedule) and returns (state_v_first, chunk_size, schedule). An unknown
    keyword is a TypeError: fla ignores them silently, which hides typos."""
    if not kwargs:
        return state_v_first, 64, None
    kwargs = dict(kwargs)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("argument 'transpose_state_layout': cannot be passed together "
                             "with state_v_first (it is its deprecated name)")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if kwargs.pop("head_first", False):
        raise ValueError("argument 'head_first': head-first inputs were removed from fla; "
                         "pass [B, T, H, ...] tensors")
    if kwargs.pop("cp_context", None) is not None:
        raise NotImplementedError("argument 'cp_context': context parallelism is not supported")
    if kwargs.pop("return_intermediate_states", False):  # the chunk_* functions take it first
        raise NotImplementedError("argument 'return_intermediate_states': per-chunk states come "
                                  "from the chunk_* functions (the chunkwise schedule), as in "
                                  "fla")
    chunk_size = kwargs.pop("chunk_size", None)
    schedule = kwargs.pop("schedule", None)
    for name in _IGNORED_KWARGS:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{fn_name}() got unexpected keyword argument(s): "
                        f"{', '.join(sorted(kwargs))}")
    return state_v_first, (64 if chunk_size is None else chunk_size), schedule


def check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("argument 'allow_neg_eigval': requires use_beta_sigmoid_in_kernel=True "
                         "(it scales the sigmoid to 2 * sigmoid(beta))")


def gate_arguments(use_gate_in_kernel, A_log, dt_bias, lower_bound):
    """(gate_in_kernel, A_log, dt_bias, lower_bound) as the library takes them. As in fla,
    A_log, dt_bias and lower_bound only matter with use_gate_in_kernel=True."""
    if not use_gate_in_kernel:
        return False, None, None, None
    if A_log is None and lower_bound is None:
        raise ValueError("argument 'A_log': must be provided when use_gate_in_kernel=True and "
                         "lower_bound is not set")
    return True, A_log, dt_bias, lower_bound


def run(mechanism, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
        state_v_first, chunk_size, schedule, qk_l2norm=False, use_gate_in_kernel=False,
        A_log=None, dt_bias=None, beta_sigmoid=False, allow_neg_eigval=False,
        lower_bound=None, return_intermediate_states=False, cu_seqlens_cpu=None,
        keep_chunk_states=False):
    """fla's checks, then flashdelta.forward (whose library validates everything else).
    return_intermediate_states: fla's inference mode, (o, final_state, h) with h the state
    entering every 64-token chunk (flashdelta.forward's output_chunk_states).
    keep_chunk_states: flashdelta.forward's, fla's disable_recompute."""
    check_neg_eigval(allow_neg_eigval, beta_sigmoid)
    gate_in_kernel, A_log, dt_bias, lower_bound = gate_arguments(use_gate_in_kernel, A_log,
                                                                 dt_bias, lower_bound)
    if return_intermediate_states and is_torch(q):
        from .._torch_ops import check_no_grad
        check_no_grad([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                       ("initial_state", initial_state), ("A_log", A_log),
                       ("dt_bias", dt_bias)], "return_intermediate_states")
    return _api.forward(q, k, v, g, beta, mechanism=mechanism, scale=scale,
                        initial_state=initial_state, output_final_state=output_final_state,
                        cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid,
                        allow_neg_eigval=allow_neg_eigval, gate_in_kernel=gate_in_kernel,
                        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                        state_v_first=state_v_first, chunk_size=chunk_size, schedule=schedule,
                        output_chunk_states=bool(return_intermediate_states),
                        cu_seqlens_cpu=cu_seqlens_cpu, keep_chunk_states=keep_chunk_states)


def run_in_time_order(reverse, mechanism, q, k, v, g, *, initial_state, cu_seqlens, **options):
    """`run` forward in time, or with reverse=True from the last token to the first (fla's
    `reverse`): the same recurrence on the inputs reversed along T, outputs reversed back.
    Packed sequences then come in reverse order, and so do their states."""
    if not reverse:
        return run(mechanism, q, k, v, g, None, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, **options)
    varlen = cu_seqlens is not None
    o, final = run(mechanism, flip(q, 1), flip(k, 1), flip(v, 1), flip(g, 1), None,
                   initial_state=flip(initial_state, 0) if varlen else initial_state,
                   cu_seqlens=reversed_cu_seqlens(cu_seqlens, q.shape[1]), **options)
    return flip(o, 1), (flip(final, 0) if varlen else final)


def check_arrays(**arrays):
    """Type and device checks, before a wrapper builds arrays of its own from the inputs."""
    _api.check_arrays(arrays)
    _api.check_rank(arrays["q"], "q", 4, "[B, T, H, K]")
    _api.check_rank(arrays["v"], "v", 4, "[B, T, HV, V]")


def ones_beta(q, v):
    """beta = 1 of shape [B, T, HV] in q's dtype (the delta rule without a step size)."""
    shape = tuple(q.shape[:2]) + (v.shape[2],)
    if is_torch(q):
        return q.new_ones(shape)
    import numpy
    return numpy.ones(shape, dtype=q.dtype)


def ones_values(q, v):
    """v = 1 of shape [B, T, HV, 1] in q's dtype: linear attention on it accumulates the keys."""
    shape = tuple(q.shape[:2]) + (v.shape[2], 1)
    if is_torch(q):
        return q.new_ones(shape)
    import numpy
    return numpy.ones(shape, dtype=q.dtype)


def as_float_state(x):
    """x as a float32 state unless it already is float32 or float64 (fla keeps some states in
    the inputs' dtype)."""
    if x is None or _core.dtype_name(x) in ("float32", "float64"):
        return x
    return x.float() if is_torch(x) else x.astype("float32")


def broadcast(x, shape):
    """A view of x broadcast to shape (stride 0 where repeated; the library reads strides)."""
    if is_torch(x):
        return x.expand(shape)
    import numpy
    return numpy.broadcast_to(x, shape)


def flip(x, axis):
    """x reversed along axis (a copy for NumPy: DLPack takes no negative strides)."""
    if x is None:
        return None
    if is_torch(x):
        return x.flip(axis)
    import numpy
    return numpy.ascontiguousarray(numpy.flip(x, axis))


def reversed_cu_seqlens(cu_seqlens, total):
    """Offsets of the packed sequences after reversing the token axis: the sequences appear
    in reverse order, sequence n spanning [total - cu[n + 1], total - cu[n])."""
    if cu_seqlens is None:
        return None
    return total - flip(cu_seqlens, 0)


def serving_call(mechanism, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, qk_l2norm,
                 use_gate_in_kernel, beta_sigmoid, allow_neg_eigval, lower_bound,
                 state_v_first, cu_seqlens, kwargs, fn_name):
    """The vLLM-style serving form of fused_recurrent_*: initial_state is the state pool."""
    indices = kwargs.get("ssm_state_indices")
    accepted = kwargs.get("num_accepted_tokens")
    inplace = kwargs.get("inplace_final_state", True)
    schedule = None
    if not kwargs.keys() <= SERVING_KWARGS:  # more than the serving keywords
        rest = {n: x for n, x in kwargs.items() if n not in SERVING_KWARGS}
        state_v_first, _, schedule = extra_options(fn_name, rest, state_v_first)
    if indices is None:
        raise ValueError("argument 'ssm_state_indices': required for the serving form "
                         "(num_accepted_tokens / inplace_final_state given)")
    if not inplace:
        raise NotImplementedError("argument 'inplace_final_state': the serving form updates "
                                  "the state pool in place; pass inplace_final_state=True")
    if initial_state is None:
        raise ValueError("argument 'initial_state': the state pool [P, HV, K, V] is required "
                         "with ssm_state_indices")
    if allow_neg_eigval:
        check_neg_eigval(allow_neg_eigval, beta_sigmoid)
    gate_in_kernel, A_log, dt_bias, lower_bound = gate_arguments(use_gate_in_kernel, A_log,
                                                                 dt_bias, lower_bound)
    o = _api.decode_positional(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, initial_state,
                               indices, accepted, mechanism, scale, qk_l2norm, beta_sigmoid,
                               allow_neg_eigval, gate_in_kernel, lower_bound, state_v_first,
                               schedule or "recurrent")
    return o, initial_state
