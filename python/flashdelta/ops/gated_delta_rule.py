"""Gated DeltaNet: the delta rule with one scalar gate per token and value head.

Drop-in for fla.ops.gated_delta_rule: same names, parameters, defaults and return values.

    S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)
"""

from .. import _api
from ._common import (ABSENT, check_arrays, extra_options, ones_beta, run, serving_call,
                      serving_direct, serving_form, with_serving_kwargs)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, **kwargs):
    r"""Gated DeltaNet, chunkwise schedule (prefill and training). Differentiable in q, k, v,
    g, beta, initial_state, A_log and dt_bias; on the CPU the gradients come from the
    library's fp64 reference backward (exact, not yet fast).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]``, HV a multiple of H (GVA).
        g: log-space decay ``[B, T, HV]``; with ``use_gate_in_kernel=True`` (keyword) the raw
            input, activated as ``-exp(A_log) * softplus(g + dt_bias)`` with the keyword
            arguments ``A_log`` ``[HV]`` (required) and ``dt_bias`` ``[HV]``.
        beta: ``[B, T, HV]`` (raw logits with ``use_beta_sigmoid_in_kernel``; ``2 * sigmoid``
            with ``allow_neg_eigval``).
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        output_final_state: also return the final state (float32; float64 for float64 inputs).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6).
        cu_seqlens: int64/int32 ``[N + 1]`` offsets of sequences packed along T (B = 1).
        return_intermediate_states (keyword): also return ``h``, the state entering every
            64-token chunk, as ``chunk_kda`` does (an extension: fla's function has none);
            ``cu_seqlens_cpu`` only counts its chunks on the host.
        chunk_indices: accepted, no effect.  cp_context: not supported.
        chunk_size (keyword): 16, 32, 64 (default) or 128.

    Returns:
        (o ``[B, T, HV, V]`` in q's dtype, final_state or None), and ``h`` third with
        ``return_intermediate_states``.
    """
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    if use_gate_in_kernel and A_log is None:
        raise ValueError("argument 'A_log': must be provided when use_gate_in_kernel=True")
    intermediate = kwargs.pop("return_intermediate_states", False)
    state_v_first, chunk_size, schedule = extra_options(
        "chunk_gated_delta_rule", dict(kwargs, cp_context=cp_context), state_v_first)
    return run("gated_deltanet", q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "chunk", q),
               qk_l2norm=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               A_log=A_log, dt_bias=dt_bias, beta_sigmoid=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, return_intermediate_states=intermediate,
               cu_seqlens_cpu=cu_seqlens_cpu)


@serving_form
def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, ssm_state_indices=ABSENT,
                                     num_accepted_tokens=ABSENT, inplace_final_state=ABSENT,
                                     **kwargs):
    r"""Gated DeltaNet, token-by-token schedule (decode). Arguments as in
    ``chunk_gated_delta_rule``, plus:

        g: scalar gate ``[B, T, HV]``;  gk: per-key gate ``[B, T, HV, K]`` (this is KDA);
            both: the decays multiply (``g[..., None] + gk`` in log space).  Neither: DeltaNet.
        gv: per-value gates are not supported (NotImplementedError).
        beta: None means 1 for every token and head, of shape ``[B, T, HV]`` (fla builds it
            with q's H heads, which breaks GVA).

    Serving (vLLM style): ``ssm_state_indices``, ``num_accepted_tokens`` and
    ``inplace_final_state`` as in ``fused_recurrent_kda``.
    """
    if gv is not None:
        raise NotImplementedError("argument 'gv': per-value-channel gates are not supported")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("argument 'A_log': must be provided when use_gate_in_kernel=True")
        if g is None:
            raise ValueError("argument 'g': the raw pre-activation must be provided when "
                             "use_gate_in_kernel=True")
        if gk is not None:
            raise NotImplementedError("argument 'gk': cannot be combined with "
                                      "use_gate_in_kernel=True (the activation applies to g)")
    check_arrays(q=q, k=k, v=v, g=g, gk=gk, beta=beta)
    if beta is None:
        beta = ones_beta(q, v)
    mechanism = "gated_deltanet"
    if gk is not None and g is not None and tuple(gk.shape) != tuple(g.shape) + (q.shape[-1],):
        raise ValueError(f"argument 'gk': expected shape [B, T, HV, K] = "
                         f"{list(g.shape) + [q.shape[-1]]} (g's shape and K), got "
                         f"{list(gk.shape)}")
    if gk is not None:
        mechanism, g = "kda", gk if g is None else g[..., None] + gk
    elif g is None:
        mechanism = "deltanet"
    if ssm_state_indices is not ABSENT and not kwargs and serving_direct is not None:
        o = serving_direct(mechanism, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel,
                           use_beta_sigmoid_in_kernel, allow_neg_eigval, None, state_v_first,
                           cu_seqlens, ssm_state_indices,
                           None if num_accepted_tokens is ABSENT else num_accepted_tokens,
                           True if inplace_final_state is ABSENT else inplace_final_state)
        if o is not None:
            return o, initial_state
    if (ssm_state_indices is not ABSENT or num_accepted_tokens is not ABSENT
            or inplace_final_state is not ABSENT):
        return serving_call(mechanism, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                            use_qk_l2norm_in_kernel, use_gate_in_kernel,
                            use_beta_sigmoid_in_kernel, allow_neg_eigval, None, state_v_first,
                            cu_seqlens,
                            with_serving_kwargs(kwargs, ssm_state_indices, num_accepted_tokens,
                                                inplace_final_state),
                            "fused_recurrent_gated_delta_rule")
    state_v_first, chunk_size, schedule = extra_options("fused_recurrent_gated_delta_rule",
                                                        kwargs, state_v_first)
    return run(mechanism, q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "recurrent", q),
               qk_l2norm=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               A_log=A_log, dt_bias=dt_bias, beta_sigmoid=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
