"""NumPy arrays on the CPU, without torch: every fla-named function's forward, the generic
entry points, and flashdelta.backward checked by finite differences."""

import numpy as np
import pytest

import flashdelta
import naive
from problems import NUMPY_TOLERANCE, assert_close, make_inputs

# (function, mechanism, positional inputs, keyword arguments of the fla-named call)
FUNCTIONS = [
    ("chunk_kda", "kda", ("q", "k", "v", "g", "beta"), {}),
    ("fused_recurrent_kda", "kda", ("q", "k", "v", "g", "beta"), {}),
    ("chunk_gated_delta_rule", "gated_deltanet", ("q", "k", "v", "g", "beta"), {}),
    ("fused_recurrent_gated_delta_rule", "gated_deltanet", ("q", "k", "v", "g"), "beta"),
    ("chunk_delta_rule", "deltanet", ("q", "k", "v", "beta"), {}),
    ("fused_recurrent_delta_rule", "deltanet", ("q", "k", "v", "beta"), {}),
    ("chunk_gla", "gla", ("q", "k", "v", "g"), {}),
    ("fused_recurrent_gla", "gla", ("q", "k", "v", "g"), {}),
    ("chunk_simple_gla", "simple_gla", ("q", "k", "v", "g"), {}),
    ("chunk_linear_attn", "linear", ("q", "k", "v"), dict(normalize=False)),
    ("fused_recurrent_linear_attn", "linear", ("q", "k", "v"), {}),
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("fn,mechanism,positional,kw", FUNCTIONS, ids=[f[0] for f in FUNCTIONS])
def test_numpy_forward(fn, mechanism, positional, kw, dtype):
    a = make_inputs(mechanism, numpy=True, dtype=np.dtype(dtype), seqlens=[6, 0, 11])
    if kw == "beta":  # fla's fused_recurrent_gated_delta_rule takes gk, gv before beta
        kw = dict(beta=a["beta"])
    o, final = getattr(flashdelta, fn)(*(a[n] for n in positional),
                                       initial_state=a["initial_state"], output_final_state=True,
                                       cu_seqlens=a["cu_seqlens"], **kw)
    o_ref, final_ref = naive.recurrence(mechanism, a["q"], a["k"], a["v"], a["g"], a["beta"],
                                        initial_state=a["initial_state"],
                                        cu_seqlens=a["cu_seqlens"])
    assert isinstance(o, np.ndarray) and o.dtype == np.dtype(dtype), f"{fn}: o {o.dtype}"
    assert final.dtype == (np.float64 if dtype == "float64" else np.float32)
    tol = NUMPY_TOLERANCE[np.dtype(dtype)]
    assert_close(o, o_ref, tol, f"{fn} {dtype}: o")
    assert_close(final, final_ref, NUMPY_TOLERANCE[final.dtype], f"{fn} {dtype}: final state")


def test_numpy_strided_and_read_only_inputs():
    a = make_inputs("kda", numpy=True, T=23)
    q = np.ascontiguousarray(a["q"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    v = np.concatenate([a["v"], a["v"]], axis=-1)[..., ::2]  # every other column
    v_values = np.ascontiguousarray(v)
    for x in (q, a["k"], v, a["g"], a["beta"]):
        x.setflags(write=False)
    o, final = flashdelta.chunk_kda(q, a["k"], v, a["g"], a["beta"],
                                    initial_state=a["initial_state"], output_final_state=True)
    o_ref, final_ref = naive.recurrence("kda", a["q"], a["k"], v_values, a["g"], a["beta"],
                                        initial_state=a["initial_state"])
    assert_close(o, o_ref, 2e-4, "o")
    assert_close(final, final_ref, 2e-4, "final state")


def numeric_directional_derivative(f, x, direction, eps=1e-6):
    return (f(x + eps * direction) - f(x - eps * direction)) / (2 * eps)


@pytest.mark.parametrize("mechanism,cfg", [
    ("kda", dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("gated_deltanet", dict(gate_in_kernel=True, lower_bound=-4.0)),
    ("gla", dict(seqlens=[3, 4])),
])
def test_numpy_backward_matches_finite_differences(mechanism, cfg):
    a = make_inputs(mechanism, numpy=True, dtype=np.float64, B=1, T=7, H=1, HV=2, K=3, V=2,
                    **cfg)
    options = dict(mechanism=mechanism, cu_seqlens=a["cu_seqlens"],
                   qk_l2norm=cfg.get("qk_l2norm", False),
                   beta_sigmoid=cfg.get("beta_sigmoid", False),
                   gate_in_kernel=cfg.get("gate_in_kernel", False),
                   lower_bound=cfg.get("lower_bound"))
    rng = np.random.default_rng(7)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
             if a[n] is not None]
    o, final = flashdelta.forward(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                  initial_state=a["initial_state"], A_log=a["A_log"],
                                  dt_bias=a["dt_bias"], output_final_state=True, **options)
    d_o, d_final = rng.standard_normal(o.shape), rng.standard_normal(final.shape)
    grads = flashdelta.backward(a["q"], a["k"], a["v"], a["g"], a["beta"], d_o=d_o,
                                d_final_state=d_final, initial_state=a["initial_state"],
                                A_log=a["A_log"], dt_bias=a["dt_bias"], **options)
    assert sorted(grads) == sorted(names)
    for name in names:
        def loss(x, name=name):
            args = dict(a, **{name: x})
            o, final = flashdelta.forward(args["q"], args["k"], args["v"], args["g"],
                                          args["beta"], initial_state=args["initial_state"],
                                          A_log=args["A_log"], dt_bias=args["dt_bias"],
                                          output_final_state=True, **options)
            return float((o * d_o).sum() + (final * d_final).sum())

        direction = rng.standard_normal(a[name].shape)
        numeric = numeric_directional_derivative(loss, a[name], direction)
        analytic = float((grads[name] * direction).sum())
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), \
            f"d{name}: backward {analytic:.9f} vs finite differences {numeric:.9f}"
