"""DeltaNet: the delta rule without a gate.

Drop-in for fla.ops.delta_rule: same names, parameters, defaults and return values.

    S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)
"""

from .. import _api
from ._common import check_arrays, extra_options, ones_beta, run


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                     **kwargs):
    r"""DeltaNet, chunkwise schedule (prefill and training). Differentiable in q, k, v, beta
    and initial_state; on the CPU the gradients come from the library's fp64 reference
    backward (exact, not yet fast).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]`` (HV a multiple of H; fla needs HV = H).
        beta: ``[B, T, HV]``.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``.
        output_final_state: also return the final state (float32; float64 for float64 inputs).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6).
        cu_seqlens: int64/int32 ``[N + 1]`` offsets of sequences packed along T (B = 1).
        return_intermediate_states (keyword): also return ``h``, the state entering every
            64-token chunk, as ``chunk_kda`` does (an extension: fla's function has none);
            ``cu_seqlens_cpu`` only counts its chunks on the host.
        chunk_size (keyword): 16, 32, 64 or 128.
        float32 inputs are accepted (fla's chunk kernel refuses them).

    Returns:
        (o ``[B, T, HV, V]`` in q's dtype, final_state or None), and ``h`` third with
        ``return_intermediate_states``.
    """
    intermediate = kwargs.pop("return_intermediate_states", False)
    state_v_first, chunk_size, schedule = extra_options("chunk_delta_rule", kwargs)
    return run("deltanet", q, k, v, None, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "chunk", q),
               qk_l2norm=use_qk_l2norm_in_kernel, return_intermediate_states=intermediate,
               cu_seqlens_cpu=cu_seqlens_cpu)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, **kwargs):
    r"""DeltaNet, token-by-token schedule (decode). Arguments as in ``chunk_delta_rule``;
    beta None means 1 for every token and head (shape ``[B, T, HV]``)."""
    state_v_first, chunk_size, schedule = extra_options("fused_recurrent_delta_rule", kwargs)
    if beta is None:
        check_arrays(q=q, k=k, v=v)
        beta = ones_beta(q, v)
    return run("deltanet", q, k, v, None, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "recurrent", q),
               qk_l2norm=use_qk_l2norm_in_kernel)
