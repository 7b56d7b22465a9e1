"""Gated linear attention (GLA): additive writes with a per-key-channel (vector) gate.

Drop-in for fla.ops.gla: same names, parameters, defaults and return values.

    S <- Diag(exp(g_t)) S;  S <- S + k_t v_t^T;  o_t = S^T (scale q_t)
"""

from .. import _api
from ._common import extra_options, run, run_in_time_order


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    r"""GLA, chunkwise schedule (prefill and training). Differentiable in q, k, v, g and
    initial_state; on the CPU the gradients come from the library's fp64 reference backward
    (exact, not yet fast).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]`` (HV a multiple of H; fla needs HV = H).
        g: log-space forget gate ``[B, T, HV, K]``.
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
    state_v_first, chunk_size, schedule = extra_options("chunk_gla", kwargs, state_v_first)
    return run("gla", q, k, v, g, None, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "chunk", q),
               return_intermediate_states=intermediate, cu_seqlens_cpu=cu_seqlens_cpu)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False, reverse=False, state_v_first=False,
                        cu_seqlens=None, **kwargs):
    r"""GLA, token-by-token schedule (decode). Arguments as in ``chunk_gla``, plus:

        gk: the per-key gate ``[B, T, HV, K]``; None gives plain linear attention.
        gv: per-value gates are not supported (NotImplementedError).
        reverse: run from the last token to the first (each packed sequence on its own).
    """
    if gv is not None:
        raise NotImplementedError("argument 'gv': per-value-channel gates are not supported")
    state_v_first, chunk_size, schedule = extra_options("fused_recurrent_gla", kwargs,
                                                        state_v_first)
    return run_in_time_order(
        reverse, "linear" if gk is None else "gla", q, k, v, gk, initial_state=initial_state,
        cu_seqlens=cu_seqlens, scale=scale, output_final_state=output_final_state,
        state_v_first=state_v_first, chunk_size=chunk_size,
        schedule=_api.pick_schedule(schedule, "recurrent", q))
