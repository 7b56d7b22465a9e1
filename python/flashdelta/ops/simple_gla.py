"""Simple GLA (RetNet / Mamba2-style): additive writes with one scalar gate per token and
head.

Drop-in for fla.ops.simple_gla: same names, parameters, defaults and return values.

    S <- exp(g_t) S;  S <- S + k_t v_t^T;  o_t = S^T (scale q_t)
"""

from .. import _api
from ._common import broadcast, check_arrays, extra_options, run


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                     output_final_state=False, state_v_first=False, cu_seqlens=None,
                     cu_seqlens_cpu=None, **kwargs):
    r"""Simple GLA, chunkwise schedule (prefill and training). Differentiable in q, k, v, g
    (or g_gamma) and initial_state; on the CPU the gradients come from the library's fp64
    reference backward (exact, not yet fast).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]`` (HV a multiple of H; fla needs HV = H).
        g: log-space forget gate ``[B, T, HV]``, or
        g_gamma: a data-independent log decay ``[HV]`` per head (only one of the two);
            neither gives plain linear attention.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        output_final_state: also return the final state (float32; float64 for float64 inputs).
        cu_seqlens: int64/int32 ``[N + 1]`` offsets of sequences packed along T (B = 1).
        return_intermediate_states (keyword): also return ``h``, the state entering every
            64-token chunk, as ``chunk_kda`` does (an extension: fla's function has none);
            ``cu_seqlens_cpu`` only counts its chunks on the host.
        chunk_size (keyword): 16, 32, 64 or 128.

    Returns:
        (o ``[B, T, HV, V]`` in q's dtype, final_state or None), and ``h`` third with
        ``return_intermediate_states``.
    """
    intermediate = kwargs.pop("return_intermediate_states", False)
    state_v_first, chunk_size, schedule = extra_options("chunk_simple_gla", kwargs,
                                                        state_v_first)
    if g is not None and g_gamma is not None:
        raise ValueError("argument 'g_gamma': pass only one of g and g_gamma")
    if g_gamma is not None:
        check_arrays(q=q, k=k, v=v, g_gamma=g_gamma)
        if tuple(g_gamma.shape) != (v.shape[2],):
            raise ValueError(f"argument 'g_gamma': expected shape [HV] = [{v.shape[2]}], got "
                             f"{list(g_gamma.shape)}")
        g = broadcast(g_gamma, tuple(q.shape[:2]) + (v.shape[2],))
    return run("linear" if g is None else "simple_gla", q, k, v, g, None, scale=scale,
               initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=cu_seqlens, state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "chunk", q),
               return_intermediate_states=intermediate, cu_seqlens_cpu=cu_seqlens_cpu)
