"""torch.library custom ops: flashdelta::forward, flashdelta::backward, flashdelta::decode.

The only torch code of the package. Each op has a fake (meta) implementation, so
torch.compile(fullgraph=True) traces through without graph breaks, and forward has an
autograd formula (the backward op), so every input that carries a gradient gets one.
Outputs and gradients are allocated with torch.empty (torch's caching allocator, on the
inputs' device) and written in place by the library; nothing in the call path reads tensor
data on the host, so the ops can be captured in CUDA graphs once the CUDA schedules exist.

Gradients run the library's backward, which on the CPU is the fp64 reference backward
(exact, not fast) until a faster one exists.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _core

# The backward schedule: the only one the CPU library has today.
BACKWARD_SCHEDULE = "reference"

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16}


def _array(t):
    # DLPack export refuses tensors that require grad; the library never writes inputs.
    return None if t is None else t.detach()


def _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel,
             lower_bound, state_v_first, chunk_size):
    return _core.make_options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                              gate_in_kernel, lower_bound, state_v_first, chunk_size,
                              num_threads=torch.get_num_threads())


def _forward_outputs(q, v, initial_state, cu_seqlens, state_v_first, output_final_state,
                     schedule):
    o_shape, state_shape = _core.forward_shapes(
        q.shape, v.shape, None if cu_seqlens is None else cu_seqlens.shape, state_v_first)
    o_dtype, state_dtype = _core.output_dtypes(
        _core.dtype_name(q), None if initial_state is None else _core.dtype_name(initial_state),
        schedule)
    o = q.new_empty(o_shape, dtype=_DTYPES[o_dtype])
    # custom ops return tensors, never None: an unwanted final state is an empty tensor.
    final = q.new_empty(state_shape if output_final_state else (0,), dtype=_DTYPES[state_dtype])
    return o, final


@torch.library.custom_op("flashdelta::forward", mutates_args=())
def forward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
            initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
            A_log: Optional[Tensor], dt_bias: Optional[Tensor], mechanism: str, scale: float,
            qk_l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool, gate_in_kernel: bool,
            lower_bound: Optional[float], state_v_first: bool, chunk_size: int,
            output_final_state: bool, schedule: str) -> Tuple[Tensor, Tensor]:
    o, final = _forward_outputs(q, v, initial_state, cu_seqlens, state_v_first,
                                output_final_state, schedule)
    inputs = dict(zip(_core.FORWARD_INPUTS, map(_array, (q, k, v, g, beta, initial_state,
                                                         cu_seqlens, A_log, dt_bias))))
    options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                       gate_in_kernel, lower_bound, state_v_first, chunk_size)
    _core.run_forward(inputs, o, final if output_final_state else None, options, schedule)
    return o, final


@forward.register_fake
def _forward_fake(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, mechanism,
                  scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel,
                  lower_bound, state_v_first, chunk_size, output_final_state, schedule):
    return _forward_outputs(q, v, initial_state, cu_seqlens, state_v_first,
                            output_final_state, schedule)


@torch.library.custom_op("flashdelta::backward", mutates_args=())
def backward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
             initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
             A_log: Optional[Tensor], dt_bias: Optional[Tensor], d_o: Tensor,
             d_final_state: Optional[Tensor], mechanism: str, scale: float, qk_l2norm: bool,
             beta_sigmoid: bool, allow_neg_eigval: bool, gate_in_kernel: bool,
             lower_bound: Optional[float], state_v_first: bool, chunk_size: int,
             wanted: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                         Tensor, Tensor]:
    """Gradients of (q, k, v, g, beta, initial_state, A_log, dt_bias); an unwanted or
    absent one is an empty tensor."""
    sources = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    grads = _backward_outputs(sources, wanted)
    inputs = dict(zip(_core.FORWARD_INPUTS, map(_array, (q, k, v, g, beta, initial_state,
                                                         cu_seqlens, A_log, dt_bias))))
    options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                       gate_in_kernel, lower_bound, state_v_first, chunk_size)
    requested = {name: gr for name, gr, w in zip(_core.GRAD_INPUTS, grads, wanted) if w}
    _core.run_backward(inputs, _array(d_o), _array(d_final_state), requested, options,
                       BACKWARD_SCHEDULE)
    return grads


def _backward_outputs(sources, wanted):
    return tuple(torch.empty_like(s) if w and s is not None else sources[0].new_empty((0,))
                 for s, w in zip(sources, wanted))


@backward.register_fake
def _backward_fake(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, d_o,
                   d_final_state, mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                   gate_in_kernel, lower_bound, state_v_first, chunk_size, wanted):
    return _backward_outputs((q, k, v, g, beta, initial_state, A_log, dt_bias), wanted)


# Positions of the forward op's arguments: 9 tensors, then the configuration.
_N_TENSORS = len(_core.FORWARD_INPUTS)
_GRAD_POSITION = {name: _core.FORWARD_INPUTS.index(name) for name in _core.GRAD_INPUTS}


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_N_TENSORS])
    # mechanism .. chunk_size, then output_final_state (schedule is not needed).
    ctx.config = inputs[_N_TENSORS:_N_TENSORS + 9]
    ctx.output_final_state = inputs[_N_TENSORS + 9]


def _forward_backward(ctx, d_o, d_final_state):
    saved = ctx.saved_tensors
    wanted = [bool(ctx.needs_input_grad[_GRAD_POSITION[n]]) and saved[_GRAD_POSITION[n]]
              is not None for n in _core.GRAD_INPUTS]
    if not any(wanted):
        return (None,) * len(ctx.needs_input_grad)
    q = saved[0]
    if d_o is None:
        d_o = torch.zeros(q.shape[:2] + saved[2].shape[2:], dtype=q.dtype, device=q.device)
    if not ctx.output_final_state:
        d_final_state = None
    grads = torch.ops.flashdelta.backward(*saved, d_o, d_final_state, *ctx.config, wanted)
    result = [None] * len(ctx.needs_input_grad)
    for name, gr, w in zip(_core.GRAD_INPUTS, grads, wanted):
        if w:
            result[_GRAD_POSITION[name]] = gr
    return tuple(result)


forward.register_autograd(_forward_backward, setup_context=_setup_context)


@torch.library.custom_op("flashdelta::decode", mutates_args=("state_pool",))
def decode(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
           cu_seqlens: Optional[Tensor], A_log: Optional[Tensor], dt_bias: Optional[Tensor],
           state_pool: Tensor, state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
           mechanism: str, scale: float, qk_l2norm: bool, beta_sigmoid: bool,
           allow_neg_eigval: bool, gate_in_kernel: bool, lower_bound: Optional[float],
           state_v_first: bool, schedule: str) -> Tensor:
    o = _decode_output(q, v, schedule)
    inputs = dict(zip(("q", "k", "v", "g", "beta", "cu_seqlens", "A_log", "dt_bias"),
                      map(_array, (q, k, v, g, beta, cu_seqlens, A_log, dt_bias))))
    options = _options(mechanism, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
                       gate_in_kernel, lower_bound, state_v_first, 64)
    _core.run_decode(inputs, _array(state_pool), _array(state_indices), _array(num_accepted_tokens),
                     o, options, schedule)
    return o


def _decode_output(q, v, schedule):
    o_dtype, _ = _core.output_dtypes(_core.dtype_name(q), None, schedule)
    return q.new_empty(q.shape[:2] + v.shape[2:], dtype=_DTYPES[o_dtype])


@decode.register_fake
def _decode_fake(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, state_pool, state_indices,
                 num_accepted_tokens, mechanism, scale, qk_l2norm, beta_sigmoid,
                 allow_neg_eigval, gate_in_kernel, lower_bound, state_v_first, schedule):
    return _decode_output(q, v, schedule)
