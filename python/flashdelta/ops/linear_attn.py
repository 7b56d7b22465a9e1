"""Linear attention: additive writes, no gate, optionally normalised.

Drop-in for fla.ops.linear_attn: same names, parameters, defaults and return values.

    S <- S + k_t v_t^T;  o_t = S^T (scale q_t)
    normalize:  o_t <- o_t / (scale q_t . z_t + 1e-10),  z_t = z_0 + sum_{s <= t} k_s
"""

from .. import _api
from ._common import (as_float_state, check_arrays, extra_options, ones_values,
                      run_in_time_order)


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                      normalize=True, cu_seqlens=None, **kwargs):
    r"""Linear attention, chunkwise schedule (prefill and training). Differentiable in q, k, v
    and the initial state(s); on the CPU the gradients come from the library's fp64
    reference backward (exact, not yet fast).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]`` (HV a multiple of H; fla needs HV = H).
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``; with ``normalize=True`` also a tuple
            ``(kv_state, z_state)``, z_state ``[N, 1, HV, K]`` the running key sum.
        output_final_state: also return the final state: a tensor, or with ``normalize=True``
            the tuple ``(kv_state, z_state)`` (z_state float32). Without it the second
            result is None, as fla documents (fla's code returns ``(None, z_state)``).
        normalize: divide by ``scale * q . z_t + 1e-10`` (default True, as in fla).
        cu_seqlens: int64/int32 ``[N + 1]`` offsets of sequences packed along T (B = 1).
        return_intermediate_states (keyword): also return ``h``, the kv state entering every
            64-token chunk, as ``chunk_kda`` does (an extension: fla's function has none).
        chunk_size (keyword): 16, 32, 64 or 128.

    Returns:
        (o ``[B, T, HV, V]`` in q's dtype, final state or None), and ``h`` third with
        ``return_intermediate_states``.
    """
    intermediate = kwargs.pop("return_intermediate_states", False)
    return _linear_attn("chunk_linear_attn", "chunk", q, k, v, scale, initial_state,
                        output_final_state, normalize, False, cu_seqlens, kwargs, intermediate)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None,
                                output_final_state=False, reverse=False, normalize=False,
                                cu_seqlens=None, **kwargs):
    r"""Linear attention, token-by-token schedule (decode). Arguments as in
    ``chunk_linear_attn`` (``normalize`` defaults to False here, as in fla), plus:

        reverse: run from the last token to the first (each packed sequence on its own); the
            normaliser then sums the keys from t to the end.
    """
    return _linear_attn("fused_recurrent_linear_attn", "recurrent", q, k, v, scale,
                        initial_state, output_final_state, normalize, reverse, cu_seqlens,
                        kwargs)


def _linear_attn(fn_name, default_schedule, q, k, v, scale, initial_state, output_final_state,
                 normalize, reverse, cu_seqlens, kwargs, intermediate=False):
    state_v_first, chunk_size, schedule = extra_options(fn_name, kwargs)
    if isinstance(initial_state, tuple):
        if not normalize:
            raise TypeError("argument 'initial_state': a (kv_state, z_state) tuple needs "
                            "normalize=True; pass the kv state alone")
        kv_init, z_init = initial_state
    else:
        kv_init, z_init = initial_state, None
    check_arrays(q=q, k=k, v=v, initial_state=kv_init, z_state=z_init)
    options = dict(scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   schedule=_api.pick_schedule(schedule, default_schedule, q))
    # h: the kv states entering each chunk, when asked for (the normaliser's are not returned).
    o, kv_state, *h = run_in_time_order(reverse, "linear", q, k, v, None, initial_state=kv_init,
                                        output_final_state=output_final_state,
                                        state_v_first=state_v_first,
                                        return_intermediate_states=intermediate, **options)
    if not normalize:
        return (o, kv_state, *h)
    # The normaliser scale q_t . z_t is the same recurrence with a one-column value v = 1:
    # its state [N, HV, K, 1] is the running key sum z.
    if z_init is not None:
        if len(z_init.shape) != 4 or z_init.shape[1] != 1:
            raise ValueError(f"argument 'initial_state': expected z_state of shape "
                             f"[N, 1, HV, K], got {list(z_init.shape)}")
        z_init = as_float_state(z_init[:, 0, :, :, None])
    denominator, z_state = run_in_time_order(
        reverse, "linear", q, k, ones_values(q, v), None, initial_state=z_init,
        output_final_state=output_final_state, state_v_first=False, **options)
    o = o / (denominator + 1e-10)
    if not output_final_state:
        return (o, None, *h)
    return (o, (kv_state, z_state[:, None, :, :, 0]), *h)
