"""Kimi Delta Attention: the delta rule with a per-key-channel (vector) gate.

Drop-in for fla.ops.kda: same names, parameters, defaults and return values.

    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)
"""

from .. import _api
from ._common import (ABSENT, extra_options, run, serving_call, serving_direct, serving_form,
                      with_serving_kwargs)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, **kwargs):
    r"""KDA, chunkwise schedule (prefill and training). Differentiable in q, k, v, g, beta,
    initial_state, A_log and dt_bias; on the CPU the gradients come from the library's fp64
    reference backward (exact, not yet fast).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]``, HV a multiple of H (GVA).
        g: log-space decay ``[B, T, HV, K]``; with ``use_gate_in_kernel`` the raw gate input,
            activated as ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound`` as
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be None).
        beta: ``[B, T, HV]`` (raw logits with ``use_beta_sigmoid_in_kernel``; ``2 * sigmoid``
            with ``allow_neg_eigval``).
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), float32
            or float64; N = B, or len(cu_seqlens) - 1.
        output_final_state: also return the final state (float32; float64 for float64 inputs).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6).
        A_log ``[HV]``, dt_bias ``[HV * K]`` or ``[HV, K]``: keyword arguments, read only with
            ``use_gate_in_kernel``.
        safe_gate: a speed knob in fla; here it only keeps fla's check that ``lower_bound`` is
            in ``[-5, 0)`` when the gate is computed in the kernel.
        cu_seqlens: int64/int32 ``[N + 1]`` offsets of sequences packed along T (B = 1).
        return_intermediate_states: also return ``h``, the state entering every 64-token
            chunk (before tokens 0, 64, 128, ... of each sequence), as fla's inference mode:
            ``[B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` with ``state_v_first``) in q's
            dtype, NT = ceil(T / 64), or with ``cu_seqlens`` ``[1, NT, ...]`` with NT the
            chunks of all sequences. No gradient: inputs must not require grad (fla asks
            for ``torch.inference_mode()``). With ``cu_seqlens`` the chunks are counted on
            the host, from ``cu_seqlens_cpu`` when given (its only use here). Not with
            ``chunk_size=32``, for which fla's ``h`` holds a state per 32 tokens.
        disable_recompute: as in fla, keep the forward's intermediates for the backward
            instead of recomputing them; here the state entering every 64-token chunk
            (``[C, HV, K, V]`` float32 until the backward), which spares the backward its
            sequential states pass. No effect without autograd.
        use_graph, max_num_seqs: accepted, no effect.
        cp_context: not supported (NotImplementedError).
        chunk_size (keyword): 16, 32, 64 (default) or 128.

    Returns:
        (o ``[B, T, HV, V]`` in q's dtype, final_state or None), and ``h`` third with
        ``return_intermediate_states``.
    """
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    state_v_first, chunk_size, schedule = extra_options(
        "chunk_kda", dict(kwargs, cp_context=cp_context), state_v_first)
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("argument 'lower_bound': must be set when safe_gate=True and "
                             "use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"argument 'lower_bound': must be in the safe range [-5, 0), got "
                             f"{lower_bound}")
    if return_intermediate_states and chunk_size == 32:
        # fla's h then holds a state per 32 tokens; ours is per 64 whatever chunk_size says.
        raise NotImplementedError("argument 'chunk_size': fla's chunk_kda(chunk_size=32) "
                                  "returns h per 32 tokens; FlashDelta records h per 64 "
                                  "tokens; pass chunk_size=64 (or leave it out)")
    return run("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "chunk", q),
               qk_l2norm=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               A_log=A_log, dt_bias=dt_bias, beta_sigmoid=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound,
               return_intermediate_states=return_intermediate_states,
               cu_seqlens_cpu=cu_seqlens_cpu, keep_chunk_states=disable_recompute)


@serving_form
def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, state_v_first=False, cu_seqlens=None, *,
                        ssm_state_indices=ABSENT, num_accepted_tokens=ABSENT,
                        inplace_final_state=ABSENT, **kwargs):
    r"""KDA, token-by-token schedule (decode). Arguments and results as in ``chunk_kda``.

    Serving (vLLM style): with ``ssm_state_indices`` (``[N]`` or ``[N, S]``), optional
    ``num_accepted_tokens`` ``[N]`` and ``inplace_final_state=True`` (the default when
    ``ssm_state_indices`` is given), ``initial_state`` is a state pool ``[P, HV, K, V]``
    updated in place, and the result is ``(o, initial_state)``; see ``flashdelta.decode``.
    """
    if ssm_state_indices is not ABSENT and not kwargs and serving_direct is not None:
        o = serving_direct("kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel,
                           use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                           state_v_first, cu_seqlens, ssm_state_indices,
                           None if num_accepted_tokens is ABSENT else num_accepted_tokens,
                           True if inplace_final_state is ABSENT else inplace_final_state)
        if o is not None:
            return o, initial_state
    if (ssm_state_indices is not ABSENT or num_accepted_tokens is not ABSENT
            or inplace_final_state is not ABSENT):
        return serving_call("kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                            use_qk_l2norm_in_kernel, use_gate_in_kernel,
                            use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                            state_v_first, cu_seqlens,
                            with_serving_kwargs(kwargs, ssm_state_indices, num_accepted_tokens,
                                                inplace_final_state), "fused_recurrent_kda")
    state_v_first, chunk_size, schedule = extra_options("fused_recurrent_kda", kwargs,
                                                        state_v_first)
    return run("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
               state_v_first=state_v_first, chunk_size=chunk_size,
               schedule=_api.pick_schedule(schedule, "recurrent", q),
               qk_l2norm=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               A_log=A_log, dt_bias=dt_bias, beta_sigmoid=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound)
