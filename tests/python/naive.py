"""An independent fp64 recurrence in NumPy, written from the math (DESIGN.md section 1) and
not from the library: the yardstick the Python API is checked against.

Per sequence and value head hv (key head hv // (HV // H)), state S (K x V), token by token:
    S <- Diag(exp(g_t)) S
    delta:  S <- S + k_t (beta_t (v_t - S^T k_t))^T      linear: S <- S + k_t v_t^T
    o_t = S^T (scale q_t)
"""

import numpy as np

GATE = {"linear": None, "simple_gla": "scalar", "gla": "vector",
        "deltanet": None, "gated_deltanet": "scalar", "kda": "vector"}
DELTA = {"linear": False, "simple_gla": False, "gla": False,
         "deltanet": True, "gated_deltanet": True, "kda": True}


def as64(x):
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def activate_gate(g, HV, A_log=None, dt_bias=None, lower_bound=None):
    """The fused gate activation on raw g ([B, T, HV, K] or [B, T, HV])."""
    x = g.copy()
    vector = g.ndim == 4
    if dt_bias is not None:
        x = x + dt_bias.reshape((HV, -1) if vector else (HV,))
    a = None if A_log is None else np.exp(A_log).reshape((HV, 1) if vector else (HV,))
    if lower_bound is not None:
        return lower_bound * _sigmoid(x if a is None else a * x)
    return -a * _softplus(x)


def sequences(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    return [(0, cu[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def recurrence(mechanism, q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
               cu_seqlens=None, qk_l2norm=False, beta_sigmoid=False, allow_neg_eigval=False,
               A_log=None, dt_bias=None, lower_bound=None, gate_in_kernel=False,
               state_v_first=False, reverse=False):
    """Returns (o [B, T, HV, V], final state [N, HV, K, V] or V-first), both float64."""
    q, k, v, g, beta = map(as64, (q, k, v, g, beta))
    A_log, dt_bias, h0 = as64(A_log), as64(dt_bias), as64(initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if GATE[mechanism] is not None and gate_in_kernel:
        g = activate_gate(g, HV, A_log, dt_bias, lower_bound)
    if DELTA[mechanism] and beta_sigmoid:
        beta = (2.0 if allow_neg_eigval else 1.0) * _sigmoid(beta)
    seqs = sequences(B, T, cu_seqlens)
    o = np.zeros((B, T, HV, V))
    final = np.zeros((len(seqs), HV, K, V))
    for n, (b, t0, length) in enumerate(seqs):
        for hv in range(HV):
            h = hv // (HV // H)
            S = np.zeros((K, V))
            if h0 is not None:
                S = h0[n, hv].T.copy() if state_v_first else h0[n, hv].copy()
            steps = range(t0 + length - 1, t0 - 1, -1) if reverse else range(t0, t0 + length)
            for t in steps:
                if GATE[mechanism] == "vector":
                    S = np.exp(g[b, t, hv])[:, None] * S
                elif GATE[mechanism] == "scalar":
                    S = np.exp(g[b, t, hv]) * S
                kt = k[b, t, h]
                if DELTA[mechanism]:
                    S = S + np.outer(kt, beta[b, t, hv] * (v[b, t, hv] - S.T @ kt))
                else:
                    S = S + np.outer(kt, v[b, t, hv])
                o[b, t, hv] = S.T @ (scale * q[b, t, h])
            final[n, hv] = S
    if state_v_first:
        final = final.transpose(0, 1, 3, 2)
    return o, final


def key_sums(k, HV, *, z0=None, cu_seqlens=None, reverse=False):
    """z_t = z0 + sum of k_s over s <= t (s >= t with reverse) within each sequence, per value
    head (key head hv // (HV // H)); z0 [N, 1, HV, K]. Returns (z [B, T, HV, K], last z per
    sequence [N, 1, HV, K])."""
    k = as64(k)
    B, T, H, K = k.shape
    k = np.repeat(k, HV // H, axis=2)
    seqs = sequences(B, T, cu_seqlens)
    z = np.zeros((B, T, HV, K))
    last = np.zeros((len(seqs), 1, HV, K))
    for n, (b, t0, length) in enumerate(seqs):
        acc = np.zeros((HV, K)) if z0 is None else as64(z0)[n, 0].copy()
        steps = range(t0 + length - 1, t0 - 1, -1) if reverse else range(t0, t0 + length)
        for t in steps:
            acc = acc + k[b, t]
            z[b, t] = acc
        last[n, 0] = acc
    return z, last


def error(actual, expected):
    """max |actual - expected| / max(max |expected|, 1): an error relative to the scale."""
    actual, expected = as64(actual), as64(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    scale = max(float(np.abs(expected).max(initial=0.0)), 1.0)
    return float(np.abs(actual - expected).max(initial=0.0)) / scale
