"""torch.library custom ops: flashdelta::forward, flashdelta::backward, flashdelta::decode,
and flashdelta::forward_chunk_states (the forward with its per-chunk states, inference only).

The only torch code of the package. Each op has a fake (meta) implementation, so
torch.compile(fullgraph=True) traces through without graph breaks, and forward has an
autograd formula (the backward op), so every input that carries a gradient gets one.
Outputs and gradients are allocated with torch.empty (torch's caching allocator, on the
inputs' device) and written in place by the library; nothing in the call path reads tensor
data on the host, so the ops can be captured in CUDA graphs. CUDA work is queued on the
current torch stream of the inputs' device.

A plain eager call (no torch.compile or other tracing, no dispatch or function modes, no
functorch transform, plain tensors, and for forward no input that needs a gradient) skips
the dispatcher and runs the op's body directly (`direct`): the torch.library dispatch costs
tens of microseconds per call, more than a whole decode step on a GPU. Anything else goes
through the ops, which behave the same.

Gradients run the library's backward: on the CPU the fp64 reference backward (exact, not
fast), on CUDA tensors the chunkwise CUDA backward. It recomputes the forward's per-chunk
states unless the forward kept them (keep_chunk_states, fla's disable_recompute): memory for
time, [C, HV, K, V] float32 (float64 for the reference) saved for the backward.
"""

import atexit
import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, _core

# The backward schedule per device: the fp64 reference on the CPU, the chunkwise kernels on
# CUDA (tf32 tensor-core products, float32 sums: bench/NOTES.md (k)).
def _backward_schedule(q):
    return "chunk" if q.is_cuda else "reference"

# The float dtypes q may have: o takes q's dtype.
FLOAT_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))
# Tensor types a direct call takes (subclasses such as FakeTensor or DTensor go through the ops).
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_DENSE = torch.contiguous_format
_OPTIONAL = _PLAIN | {type(None)}  # an optional tensor argument's classes

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _version_bumper():
    """torch._C._increment_version takes a tuple of tensors in recent torch (fast) and one
    tensor in older releases."""
    bump = torch._C._increment_version
    try:
        bump((torch.empty(0),))
        return bump
    except TypeError:
        return lambda tensors: bump(tensors[0])


_increment_version = _version_bumper()
_get_num_threads = torch.get_num_threads
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


def direct(tensors, grad=False):
    """True when an eager call may run the op's body without the dispatcher: not under
    torch.compile (dynamo folds the first test to a constant and traces the op), no active
    dispatch or function modes (make_fx, FakeTensorMode, ...), no functorch transform, only
    plain tensors, and with grad=True none that requires grad while grad mode is on."""
    if _is_compiling() or _dispatch_modes() or _function_modes() or _functorch_active():
        return False
    grad = grad and torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.__class__ not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def check_decode_grad(named_tensors):
    """NotImplementedError naming the first CUDA input that requires grad (grad mode on), for
    decode calls through the custom op (tracing, modes, tensor subclasses): decode updates
    its state pool in place and has no autograd formula. The eager direct call (`direct`)
    reads such inputs as values instead, on either device."""
    if not torch.is_grad_enabled():
        return
    for name, t in named_tensors:
        if t is not None and t.is_cuda and t.requires_grad:
            raise NotImplementedError(
                f"argument '{name}': requires grad, but decode (a serving step that updates "
                f"its state pool in place) has no autograd formula; call under "
                f"torch.no_grad() or torch.inference_mode(), or pass detached tensors")


def check_no_grad(named_tensors, argument):
    """NotImplementedError naming `argument` when an input requires grad (grad mode on): the
    per-chunk states are inference-only, as in fla, and have no autograd formula."""
    if not torch.is_grad_enabled():
        return
    for name, t in named_tensors:
        if getattr(t, "requires_grad", False):
            raise NotImplementedError(
                f"argument '{argument}': the per-chunk states are inference-only (as in fla) "
                f"and carry no gradient, but input '{name}' requires grad; call under "
                f"torch.no_grad() or torch.inference_mode(), or pass detached tensors")


_OPTIONS = {}
# Dropped before the extension's teardown, which reports live instances as leaks.
atexit.register(_OPTIONS.clear)


def _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel,
             lower_bound, state_v_first, chunk_size):
    """A _C.Options, cached by value (they are never modified once built). decode_direct
    looks its key up inline."""
    key = (mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel,
           lower_bound, state_v_first, chunk_size, _get_num_threads())
    options = _OPTIONS.get(key)
    if options is None:
        options = _core.make_options(*key[:9], num_threads=key[9])
        if len(_OPTIONS) >= 256:
            _OPTIONS.clear()
        _OPTIONS[key] = options
    return options


def _run(fn, q, args):
    """fn(*args, stream): on the current torch stream of q's device for CUDA tensors (with
    q's device current), stream 0 otherwise."""
    if not q.is_cuda:
        return fn(*args, 0)
    index = q.get_device()
    if _raw_stream is None:  # not expected: torch builds with CUDA have both
        return fn(*args, torch.cuda.current_stream(q.device).cuda_stream)
    if _cuda_get_device() == index:
        return fn(*args, _raw_stream(index))
    with torch.cuda.device(index):
        return fn(*args, _raw_stream(index))


class _Workspace:
    """The temporary memory of one CUDA chunk call, from torch's caching allocator: the
    library asks for it by size (a call of its own allocation would return memory to the
    driver and map it again every call, milliseconds for the backward's gigabytes). Allocated
    on the current stream and held until the call has queued its work, so torch reuses it
    only in stream order."""

    __slots__ = ("device", "held")

    def __init__(self, device):
        self.device, self.held = device, None

    def __call__(self, nbytes):
        self.held = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.held.data_ptr()


def _workspace(q):
    return _Workspace(q.device) if q.is_cuda else None


def _forward_outputs(q, v, initial_state, cu_seqlens, state_v_first, output_final_state,
                     schedule):
    """o [B, T, HV, V] (v's shape, q's dtype) and the final state [N, HV, K, V] (or V-first;
    initial_state's shape where there is one), or None when not wanted. torch.empty_like is
    the cheapest allocation: half the host time of new_empty with a shape."""
    wide = schedule == "reference" or q.dtype == torch.float64
    o = torch.empty_like(v, dtype=torch.float64 if wide else q.dtype, memory_format=_DENSE)
    if not output_final_state:
        return o, None
    if initial_state is not None:
        wide = wide or initial_state.dtype == torch.float64
        return o, torch.empty_like(initial_state, dtype=torch.float64 if wide else torch.float32,
                                   memory_format=_DENSE)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V),
                        dtype=torch.float64 if wide else torch.float32)
    return o, final


def _op_forward_outputs(q, v, initial_state, cu_seqlens, state_v_first, output_final_state,
                        schedule):
    # custom ops return tensors, never None: an unwanted final state is an empty tensor.
    o, final = _forward_outputs(q, v, initial_state, cu_seqlens, state_v_first,
                                output_final_state, schedule)
    return o, (q.new_empty((0,), dtype=torch.float32) if final is None else final)


def wants_grad(tensors):
    """True when autograd will record a node for these inputs (grad mode on, one requires
    grad): the only calls for which keep_chunk_states has an effect."""
    return torch.is_grad_enabled() and any(
        t is not None and getattr(t, "requires_grad", False) for t in tensors)


def _kept_states(q, v, cu_seqlens, state_v_first, schedule, keep):
    """The per-chunk states a training forward keeps for its backward ([C, HV, K, V], or
    V-first; C = _core.kept_chunk_count), or an empty tensor when it keeps none. The CUDA
    recurrent schedule records no per-chunk states: it keeps none (the backward recomputes),
    the same decision in the real and the fake implementation."""
    if not keep or (q.is_cuda and schedule == "recurrent"):
        return q.new_empty((0,), dtype=torch.float32)
    B, T, K = q.shape[0], q.shape[1], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    C = _core.kept_chunk_count(B, T, cu_seqlens.shape[0] - 1 if varlen else B, varlen)
    wide = schedule == "reference" or q.dtype == torch.float64
    return q.new_empty((C, HV, V, K) if state_v_first else (C, HV, K, V),
                       dtype=torch.float64 if wide else torch.float32)


def _kept_view(kept, q, cu_seqlens):
    """The kept states as the library takes them: None when none are kept; on the CPU with
    cu_seqlens the exact chunk count (the offsets are host memory there and are checked
    exactly), elsewhere the whole tensor."""
    if kept.dim() == 1:
        return None
    if cu_seqlens is None or q.is_cuda:
        return kept
    return kept[:_core.chunks_per_row(q.shape[1], cu_seqlens.tolist())]


def forward_impl(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, mechanism, scale,
                 qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound,
                 state_v_first, chunk_size, output_final_state, schedule, keep=False,
                 op=False):
    """The body of flashdelta::forward (op=True: (o, final state, kept states)), also called
    directly (see `direct`: (o, final state or None when not wanted), keeping nothing)."""
    o, final = (_op_forward_outputs if op else _forward_outputs)(
        q, v, initial_state, cu_seqlens, state_v_first, output_final_state, schedule)
    kept = _kept_states(q, v, cu_seqlens, state_v_first, schedule, keep and op)
    options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                       gate_in_kernel, lower_bound, state_v_first, chunk_size)
    _run(_C.forward, q, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, o,
                         final if output_final_state else None,
                         _kept_view(kept, q, cu_seqlens), options, schedule, _workspace(q)))
    return (o, final, kept) if op else (o, final)


@torch.library.custom_op("flashdelta::forward", mutates_args=())
def forward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
            initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
            A_log: Optional[Tensor], dt_bias: Optional[Tensor], mechanism: str, scale: float,
            qk_l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool, gate_in_kernel: bool,
            lower_bound: Optional[float], state_v_first: bool, chunk_size: int,
            output_final_state: bool, schedule: str,
            keep_chunk_states: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """(o, final state, kept per-chunk states); the last two are empty tensors when not
    wanted. The kept states carry no gradient: the backward reads them."""
    return forward_impl(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, mechanism,
                        scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel,
                        lower_bound, state_v_first, chunk_size, output_final_state, schedule,
                        keep=keep_chunk_states, op=True)


@forward.register_fake
def _forward_fake(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, mechanism,
                  scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel,
                  lower_bound, state_v_first, chunk_size, output_final_state, schedule,
                  keep_chunk_states=False):
    o, final = _op_forward_outputs(q, v, initial_state, cu_seqlens, state_v_first,
                                   output_final_state, schedule)
    return o, final, _kept_states(q, v, cu_seqlens, state_v_first, schedule, keep_chunk_states)


@torch.library.custom_op("flashdelta::backward", mutates_args=())
def backward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
             initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
             A_log: Optional[Tensor], dt_bias: Optional[Tensor], d_o: Tensor,
             d_final_state: Optional[Tensor], mechanism: str, scale: float, qk_l2norm: bool,
             beta_sigmoid: bool, allow_neg_eigval: bool, gate_in_kernel: bool,
             lower_bound: Optional[float], state_v_first: bool, chunk_size: int,
             wanted: List[bool], chunk_states: Optional[Tensor] = None,
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (q, k, v, g, beta, initial_state, A_log, dt_bias); an unwanted or
    absent one is an empty tensor. chunk_states: the forward's kept states (or None, or an
    empty tensor: recompute them)."""
    sources = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    grads = _backward_outputs(sources, wanted)
    options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                       gate_in_kernel, lower_bound, state_v_first, chunk_size)
    requested = [gr if w else None for gr, w in zip(grads, wanted)]
    kept = None if chunk_states is None else _kept_view(chunk_states, q, cu_seqlens)
    _run(functools.partial(_C.backward, chunk_states=kept), q,
         (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, d_o, d_final_state,
          *requested, options, _backward_schedule(q), _workspace(q)))
    return grads


def _backward_outputs(sources, wanted):
    return tuple(torch.empty_like(s) if w and s is not None else sources[0].new_empty((0,))
                 for s, w in zip(sources, wanted))


@backward.register_fake
def _backward_fake(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, d_o,
                   d_final_state, mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                   gate_in_kernel, lower_bound, state_v_first, chunk_size, wanted,
                   chunk_states=None):
    return _backward_outputs((q, k, v, g, beta, initial_state, A_log, dt_bias), wanted)


def _chunk_states_output(q, v, dtype, state_v_first, num_chunks):
    """fla's h [B, NT, HV, K, V] (or V-first) in o's dtype; NT = num_chunks."""
    shape = _core.chunk_states_shape(q.shape, v.shape, num_chunks, state_v_first)
    return q.new_empty(shape, dtype=dtype)


@torch.library.custom_op("flashdelta::forward_chunk_states", mutates_args=())
def forward_chunk_states(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor],
                         beta: Optional[Tensor], initial_state: Optional[Tensor],
                         cu_seqlens: Optional[Tensor], A_log: Optional[Tensor],
                         dt_bias: Optional[Tensor], mechanism: str, scale: float,
                         qk_l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool,
                         gate_in_kernel: bool, lower_bound: Optional[float],
                         state_v_first: bool, chunk_size: int, output_final_state: bool,
                         schedule: str, num_chunks: int) -> Tuple[Tensor, Tensor, Tensor]:
    """flashdelta::forward plus the state entering every 64-token chunk (fla's h of
    return_intermediate_states), NT = num_chunks per batch row (counted on the host by the
    caller, so the shapes never depend on tensor data). No autograd formula: inference only."""
    o, final = _op_forward_outputs(q, v, initial_state, cu_seqlens, state_v_first,
                                   output_final_state, schedule)
    h = _chunk_states_output(q, v, o.dtype, state_v_first, num_chunks)
    options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                       gate_in_kernel, lower_bound, state_v_first, chunk_size)
    _run(_C.forward, q, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, o,
                         final if output_final_state else None, h.flatten(0, 1), options,
                         schedule, _workspace(q)))
    return o, final, h


@forward_chunk_states.register_fake
def _forward_chunk_states_fake(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias,
                               mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                               gate_in_kernel, lower_bound, state_v_first, chunk_size,
                               output_final_state, schedule, num_chunks):
    o, final = _op_forward_outputs(q, v, initial_state, cu_seqlens, state_v_first,
                                   output_final_state, schedule)
    return o, final, _chunk_states_output(q, v, o.dtype, state_v_first, num_chunks)


# Positions of the forward op's arguments: 9 tensors, then the configuration.
_N_TENSORS = len(_core.FORWARD_INPUTS)
_GRAD_POSITION = {name: _core.FORWARD_INPUTS.index(name) for name in _core.GRAD_INPUTS}


def _setup_context(ctx, inputs, output):
    # The inputs, then the kept per-chunk states (an empty tensor when none are kept).
    ctx.save_for_backward(*inputs[:_N_TENSORS], output[2])
    ctx.mark_non_differentiable(output[2])
    # mechanism .. chunk_size, then output_final_state (schedule is not needed).
    ctx.config = inputs[_N_TENSORS:_N_TENSORS + 9]
    ctx.output_final_state = inputs[_N_TENSORS + 9]


def _forward_backward(ctx, d_o, d_final_state, _d_kept):
    *saved, kept = ctx.saved_tensors
    wanted = [bool(ctx.needs_input_grad[_GRAD_POSITION[n]]) and saved[_GRAD_POSITION[n]]
              is not None for n in _core.GRAD_INPUTS]
    if not any(wanted):
        return (None,) * len(ctx.needs_input_grad)
    q = saved[0]
    if d_o is None:
        d_o = torch.zeros(q.shape[:2] + saved[2].shape[2:], dtype=q.dtype, device=q.device)
    if not ctx.output_final_state:
        d_final_state = None
    grads = torch.ops.flashdelta.backward(*saved, d_o, d_final_state, *ctx.config, wanted,
                                          kept if kept.dim() > 1 else None)
    result = [None] * len(ctx.needs_input_grad)
    for name, gr, w in zip(_core.GRAD_INPUTS, grads, wanted):
        if w:
            result[_GRAD_POSITION[name]] = gr
    return tuple(result)


forward.register_autograd(_forward_backward, setup_context=_setup_context)


def _decode_output(q, v, schedule):
    wide = schedule == "reference" or q.dtype == torch.float64
    return torch.empty_like(v, dtype=torch.float64 if wide else q.dtype, memory_format=_DENSE)


def decode_direct(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool, state_indices,
                  num_accepted_tokens, mechanism, scale, qk_l2norm, beta_sigmoid,
                  allow_neg_eigval, gate_in_kernel, lower_bound, state_v_first, schedule,
                  bump_version=True):
    """The body of flashdelta::decode, also called directly (see `direct`): then it bumps
    state_pool's version counter, as the op's registration of the in-place update does
    (bump_version=False in the op). Its helpers are inlined (_decode_output; _options' cache
    hit; _run when q's device is current): ~0.5 us a call less host time
    (bench/serving_host_overhead.py), where a wrapper frame would cost about as much."""
    o = torch.empty_like(v, dtype=torch.float64 if schedule == "reference" else q.dtype,
                         memory_format=_DENSE)
    options = _OPTIONS.get((mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                            gate_in_kernel, lower_bound, state_v_first, 64, _get_num_threads()))
    if options is None:
        options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                           gate_in_kernel, lower_bound, state_v_first, 64)
    stream = 0
    if q.is_cuda:
        index = q.get_device()
        if _raw_stream is None or _cuda_get_device() != index:
            _run(_C.decode, q, (q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool,
                                state_indices, num_accepted_tokens, o, options, schedule))
            if bump_version:
                _increment_version((state_pool,))
            return o
        stream = _raw_stream(index)
    _C.decode(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool, state_indices,
              num_accepted_tokens, o, options, schedule, stream)
    if bump_version:
        _increment_version((state_pool,))
    return o


def serving_direct(mechanism, q, k, v, g, beta, A_log, dt_bias, scale, state_pool, qk_l2norm,
                   gate_in_kernel, beta_sigmoid, allow_neg_eigval, lower_bound, state_v_first,
                   cu_seqlens, indices, accepted, inplace):
    """The serving form of fused_recurrent_kda / fused_recurrent_gated_delta_rule (ops'
    serving_call, arguments in its order, then ssm_state_indices, num_accepted_tokens and
    inplace_final_state) in the common eager call, for callers whose other keywords were none:
    serving_call's and decode_positional's checks in one frame, then decode_direct (the two
    layers cost ~1 us a call; bench/serving_host_overhead.py). Returns o, or None for any
    other call, which the caller hands to serving_call (it raises, or takes the op or the
    NumPy path)."""
    if (indices is None or not inplace or state_pool is None
            or (allow_neg_eigval and not beta_sigmoid)):
        return None
    if not gate_in_kernel:  # ops' gate_arguments
        gate_in_kernel, A_log, dt_bias, lower_bound = False, None, None, None
    elif A_log is None and lower_bound is None:
        return None
    else:
        gate_in_kernel = True
    # decode_positional's checks and `direct`'s (q's and v's classes checked once).
    if (q.__class__ not in _PLAIN or v.__class__ not in _PLAIN or k is None or q.ndim != 4
            or v.ndim != 4 or q.dtype not in FLOAT_DTYPES or _is_compiling()
            or _dispatch_modes() or _function_modes() or _functorch_active()
            or k.__class__ not in _PLAIN or state_pool.__class__ not in _PLAIN
            or indices.__class__ not in _PLAIN or g.__class__ not in _OPTIONAL
            or beta.__class__ not in _OPTIONAL or A_log.__class__ not in _OPTIONAL
            or dt_bias.__class__ not in _OPTIONAL or cu_seqlens.__class__ not in _OPTIONAL
            or accepted.__class__ not in _OPTIONAL):
        return None
    return decode_direct(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool, indices,
                         accepted, mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                         gate_in_kernel, lower_bound, state_v_first, "recurrent")


@torch.library.custom_op("flashdelta::decode", mutates_args=("state_pool",))
def decode(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
           cu_seqlens: Optional[Tensor], A_log: Optional[Tensor], dt_bias: Optional[Tensor],
           state_pool: Tensor, state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
           mechanism: str, scale: float, qk_l2norm: bool, beta_sigmoid: bool,
           allow_neg_eigval: bool, gate_in_kernel: bool, lower_bound: Optional[float],
           state_v_first: bool, schedule: str) -> Tensor:
    return decode_direct(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool,
                         state_indices, num_accepted_tokens, mechanism, scale, qk_l2norm,
                         beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound,
                         state_v_first, schedule, bump_version=False)


@decode.register_fake
def _decode_fake(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool, state_indices,
                 num_accepted_tokens, mechanism, scale, qk_l2norm, beta_sigmoid,
                 allow_neg_eigval, gate_in_kernel, lower_bound, state_v_first, schedule):
    return _decode_output(q, v, schedule)
