"""Forward results of every fla-named function and option, against the independent fp64
recurrence (naive.py), for torch tensors; output and final state are both asserted."""

import numpy as np
import pytest

import naive
from problems import TOLERANCE, assert_close, make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402

# Option sets shared by the delta-rule and gated families: (name, make_inputs arguments).
GATED_OPTIONS = [
    ("plain", {}),
    ("no_initial_state", dict(initial_state=False)),
    ("l2norm_beta_sigmoid", dict(qk_l2norm=True, beta_sigmoid=True)),
    ("neg_eigval", dict(beta_sigmoid=True, allow_neg_eigval=True)),
    ("gate_softplus", dict(gate_in_kernel=True)),
    ("gate_softplus_no_bias", dict(gate_in_kernel=True, with_dt_bias=False)),
    ("gate_lower_bound", dict(gate_in_kernel=True, lower_bound=-5.0)),
    ("gate_lower_bound_no_A_log", dict(gate_in_kernel=True, lower_bound=-2.0,
                                       with_A_log=False)),
    ("varlen", dict(seqlens=[7, 0, 1, 22])),
    ("state_v_first", dict(state_v_first=True)),
    ("strong_gates", dict(gate_min=-8.0)),
    ("no_gva_odd_dims", dict(H=3, HV=3, K=5, V=7)),
]


def fla_kwargs(a, cfg, **extra):
    """fla keyword arguments for the problem `a` built with make_inputs(**cfg)."""
    kw = dict(initial_state=a["initial_state"], output_final_state=True,
              cu_seqlens=a["cu_seqlens"], state_v_first=cfg.get("state_v_first", False))
    kw.update(extra)
    return kw


def naive_kwargs(a, cfg, **extra):
    kw = dict(initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
              state_v_first=cfg.get("state_v_first", False),
              qk_l2norm=cfg.get("qk_l2norm", False), beta_sigmoid=cfg.get("beta_sigmoid", False),
              allow_neg_eigval=cfg.get("allow_neg_eigval", False),
              gate_in_kernel=cfg.get("gate_in_kernel", False), A_log=a["A_log"],
              dt_bias=a["dt_bias"], lower_bound=cfg.get("lower_bound"))
    kw.update(extra)
    return kw


def delta_options(a, cfg):
    """The fused-transform arguments of the delta-rule functions."""
    kw = dict(use_qk_l2norm_in_kernel=cfg.get("qk_l2norm", False),
              use_beta_sigmoid_in_kernel=cfg.get("beta_sigmoid", False),
              allow_neg_eigval=cfg.get("allow_neg_eigval", False))
    if cfg.get("gate_in_kernel"):
        kw.update(use_gate_in_kernel=True, A_log=a["A_log"], dt_bias=a["dt_bias"])
    return kw


def check(result, expected, dtype, what, state_dtype=torch.float32):
    o, final = result
    o_ref, final_ref = expected
    tol = TOLERANCE[dtype]
    assert o.dtype == dtype, f"{what}: o dtype {o.dtype}, expected {dtype}"
    assert_close(o, o_ref, tol, f"{what}: o")
    assert final is not None and final.dtype == state_dtype, f"{what}: final state {final}"
    # The state is float32 (float64) whatever the input dtype, and the expected one is
    # computed from the same rounded inputs: its tolerance is the state dtype's.
    assert_close(final, final_ref, TOLERANCE[state_dtype], f"{what}: final state")


@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("name,cfg", GATED_OPTIONS, ids=[n for n, _ in GATED_OPTIONS])
def test_kda(fn, name, cfg):
    a = make_inputs("kda", **cfg)
    kw = fla_kwargs(a, cfg, **delta_options(a, cfg))
    if cfg.get("lower_bound") is not None:
        kw["lower_bound"] = cfg["lower_bound"]
    result = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)
    expected = naive.recurrence("kda", a["q"], a["k"], a["v"], a["g"], a["beta"],
                                **naive_kwargs(a, cfg))
    check(result, expected, torch.float32, f"{fn} {name}")


@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("name,cfg", [c for c in GATED_OPTIONS if "lower_bound" not in c[0]],
                         ids=[n for n, _ in GATED_OPTIONS if "lower_bound" not in n])
def test_gated_delta_rule(fn, name, cfg):
    a = make_inputs("gated_deltanet", **cfg)
    kw = fla_kwargs(a, cfg, **delta_options(a, cfg))
    result = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], beta=a["beta"], **kw)
    expected = naive.recurrence("gated_deltanet", a["q"], a["k"], a["v"], a["g"], a["beta"],
                                **naive_kwargs(a, cfg))
    check(result, expected, torch.float32, f"{fn} {name}")


@pytest.mark.parametrize("fn", ["chunk_kda", "chunk_gated_delta_rule", "chunk_gla",
                                "chunk_simple_gla", "chunk_delta_rule", "fused_recurrent_kda"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_low_and_double_precision(fn, dtype):
    dtype = getattr(torch, dtype)
    mechanism = {"chunk_kda": "kda", "fused_recurrent_kda": "kda", "chunk_gla": "gla",
                 "chunk_gated_delta_rule": "gated_deltanet", "chunk_simple_gla": "simple_gla",
                 "chunk_delta_rule": "deltanet"}[fn]
    cfg = dict(T=45, dtype=dtype)
    a = make_inputs(mechanism, **cfg)
    gate = () if a["g"] is None else (a["g"],)
    beta = {} if a["beta"] is None else dict(beta=a["beta"])
    kw = fla_kwargs(a, cfg)
    if fn == "chunk_delta_rule":
        del kw["state_v_first"]  # not a parameter of fla's delta rule
    result = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], *gate, **beta, **kw)
    expected = naive.recurrence(mechanism, a["q"], a["k"], a["v"], a["g"], a["beta"],
                                **naive_kwargs(a, cfg))
    state = torch.float64 if dtype == torch.float64 else torch.float32
    check(result, expected, dtype, f"{fn} {dtype}", state_dtype=state)


def test_fused_recurrent_gated_delta_rule_gate_forms():
    """g (scalar), gk (per key: KDA), both (decays multiply), neither (DeltaNet), and
    beta=None (ones over the HV value heads, also with GVA)."""
    a = make_inputs("kda")
    scalar = make_inputs("gated_deltanet")["g"]
    fn = flashdelta.fused_recurrent_gated_delta_rule
    common = dict(initial_state=a["initial_state"], output_final_state=True)
    naive_common = dict(initial_state=a["initial_state"])
    cases = {
        "gk": (dict(gk=a["g"], beta=a["beta"]), ("kda", a["g"], a["beta"])),
        "g+gk": (dict(g=scalar, gk=a["g"], beta=a["beta"]),
                 ("kda", scalar[..., None] + a["g"], a["beta"])),
        "neither": (dict(beta=a["beta"]), ("deltanet", None, a["beta"])),
        "beta=None": (dict(g=scalar), ("gated_deltanet", scalar, torch.ones(2, 19, 4))),
    }
    for name, (kw, (mechanism, g, beta)) in cases.items():
        result = fn(a["q"], a["k"], a["v"], **kw, **common)
        expected = naive.recurrence(mechanism, a["q"], a["k"], a["v"], g, beta, **naive_common)
        check(result, expected, torch.float32, f"fused_recurrent_gated_delta_rule {name}")


@pytest.mark.parametrize("fn", ["chunk_delta_rule", "fused_recurrent_delta_rule"])
@pytest.mark.parametrize("name,cfg", [("plain", {}), ("l2norm", dict(qk_l2norm=True)),
                                      ("varlen", dict(seqlens=[3, 16, 0, 9])),
                                      ("no_initial_state", dict(initial_state=False))])
def test_delta_rule(fn, name, cfg):
    a = make_inputs("deltanet", **cfg)
    kw = fla_kwargs(a, cfg, use_qk_l2norm_in_kernel=cfg.get("qk_l2norm", False))
    del kw["state_v_first"]  # not a parameter of fla's delta rule
    result = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["beta"], **kw)
    expected = naive.recurrence("deltanet", a["q"], a["k"], a["v"], None, a["beta"],
                                **naive_kwargs(a, cfg))
    check(result, expected, torch.float32, f"{fn} {name}")


def test_fused_recurrent_delta_rule_without_beta():
    a = make_inputs("deltanet")
    result = flashdelta.fused_recurrent_delta_rule(a["q"], a["k"], a["v"], scale=0.3,
                                                   initial_state=a["initial_state"],
                                                   output_final_state=True)
    expected = naive.recurrence("deltanet", a["q"], a["k"], a["v"], None, torch.ones(2, 19, 4),
                                scale=0.3, initial_state=a["initial_state"])
    check(result, expected, torch.float32, "fused_recurrent_delta_rule beta=None")


GLA_OPTIONS = [("plain", {}), ("varlen", dict(seqlens=[11, 1, 0, 8])),
               ("state_v_first", dict(state_v_first=True)), ("strong", dict(gate_min=-8.0)),
               ("no_initial_state", dict(initial_state=False))]


@pytest.mark.parametrize("name,cfg", GLA_OPTIONS, ids=[n for n, _ in GLA_OPTIONS])
def test_chunk_gla(name, cfg):
    a = make_inputs("gla", **cfg)
    result = flashdelta.chunk_gla(a["q"], a["k"], a["v"], a["g"], scale=0.5, **fla_kwargs(a, cfg))
    expected = naive.recurrence("gla", a["q"], a["k"], a["v"], a["g"], scale=0.5,
                                **naive_kwargs(a, cfg))
    check(result, expected, torch.float32, f"chunk_gla {name}")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("name,cfg", GLA_OPTIONS[:3], ids=[n for n, _ in GLA_OPTIONS[:3]])
def test_fused_recurrent_gla(name, cfg, gated, reverse):
    a = make_inputs("gla", **cfg)
    gk = a["g"] if gated else None
    result = flashdelta.fused_recurrent_gla(a["q"], a["k"], a["v"], gk, reverse=reverse,
                                            **fla_kwargs(a, cfg))
    expected = naive.recurrence("gla" if gated else "linear", a["q"], a["k"], a["v"], gk,
                                reverse=reverse, **naive_kwargs(a, cfg))
    check(result, expected, torch.float32, f"fused_recurrent_gla {name} gk={gated} "
                                           f"reverse={reverse}")


@pytest.mark.parametrize("gate", ["g", "g_gamma", "none"])
@pytest.mark.parametrize("name,cfg", GLA_OPTIONS[:3], ids=[n for n, _ in GLA_OPTIONS[:3]])
def test_chunk_simple_gla(name, cfg, gate):
    a = make_inputs("simple_gla", **cfg)
    kw, g, mechanism = {}, None, "simple_gla"
    if gate == "g":
        kw, g = dict(g=a["g"]), a["g"]
    elif gate == "g_gamma":
        gamma = -torch.linspace(0.05, 0.6, a["v"].shape[2])
        kw, g = dict(g_gamma=gamma), gamma.expand(a["g"].shape)
    else:
        mechanism = "linear"
    result = flashdelta.chunk_simple_gla(a["q"], a["k"], a["v"], **kw, **fla_kwargs(a, cfg))
    expected = naive.recurrence(mechanism, a["q"], a["k"], a["v"], g, **naive_kwargs(a, cfg))
    check(result, expected, torch.float32, f"chunk_simple_gla {name} {gate}")


def normalized_linear_attention(a, z0, reverse, scale=None):
    """fla's normalised linear attention from the fp64 recurrence: o / (scale q . z + 1e-10)."""
    o, S = naive.recurrence("linear", a["q"], a["k"], a["v"], scale=scale,
                            initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
                            reverse=reverse)
    HV = a["v"].shape[2]
    z, z_last = naive.key_sums(a["k"], HV, z0=z0, cu_seqlens=a["cu_seqlens"], reverse=reverse)
    q = np.repeat(naive.as64(a["q"]), HV // a["q"].shape[2], axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    denominator = (scale * q * z).sum(-1, keepdims=True) + 1e-10
    return o / denominator, S, z_last


@pytest.mark.parametrize("fn,reverse", [("chunk_linear_attn", False),
                                        ("fused_recurrent_linear_attn", False),
                                        ("fused_recurrent_linear_attn", True)])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("name,cfg", [("plain", {}), ("varlen", dict(seqlens=[6, 0, 13, 1]))])
def test_linear_attn(fn, reverse, normalize, name, cfg):
    a = make_inputs("linear", **cfg)
    # Keys and queries of one sign keep the normaliser away from zero.
    a["q"], a["k"] = a["q"].abs(), a["k"].abs()
    kw = dict(cu_seqlens=a["cu_seqlens"], output_final_state=True, normalize=normalize)
    if reverse:
        kw["reverse"] = True
    what = f"{fn} {name} normalize={normalize} reverse={reverse}"
    if not normalize:
        result = getattr(flashdelta, fn)(a["q"], a["k"], a["v"],
                                         initial_state=a["initial_state"], **kw)
        expected = naive.recurrence("linear", a["q"], a["k"], a["v"],
                                    initial_state=a["initial_state"],
                                    cu_seqlens=a["cu_seqlens"], reverse=reverse)
        check(result, expected, torch.float32, what)
        return
    N, HV, K = a["initial_state"].shape[:3]
    z0 = torch.rand(N, 1, HV, K)
    o, (S, z) = getattr(flashdelta, fn)(a["q"], a["k"], a["v"],
                                        initial_state=(a["initial_state"], z0), **kw)
    o_ref, S_ref, z_ref = normalized_linear_attention(a, z0, reverse)
    check((o, S), (o_ref, S_ref), torch.float32, what)
    assert_close(z, z_ref, TOLERANCE[torch.float32], f"{what}: z state")
    # Without output_final_state the second result is None (as fla documents).
    o2, none = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], initial_state=a["initial_state"],
                                       **dict(kw, output_final_state=False))
    assert none is None
    o_ref2, _, _ = normalized_linear_attention(a, None, reverse)
    assert_close(o2, o_ref2, TOLERANCE[torch.float32], f"{what}: no z0")


@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_gla", "chunk_linear_attn"])
def test_reference_module_is_fp64(fn):
    """flashdelta.reference: same signatures, float64 results from the fp64 recurrence."""
    mechanism = {"chunk_kda": "kda", "fused_recurrent_gla": "gla", "chunk_linear_attn": "linear"}
    a = make_inputs(mechanism[fn], dtype=torch.bfloat16)
    args = [a[n] for n in ("q", "k", "v", "g", "beta") if a[n] is not None]
    kw = dict(initial_state=a["initial_state"], output_final_state=True)
    if fn == "chunk_linear_attn":
        kw["normalize"] = False
    o, final = getattr(flashdelta.reference, fn)(*args, **kw)
    assert o.dtype == torch.float64 and final.dtype == torch.float64
    o_ref, final_ref = naive.recurrence(mechanism[fn], a["q"], a["k"], a["v"], a["g"], a["beta"],
                                        initial_state=a["initial_state"])
    assert_close(o, o_ref, 1e-12, f"reference.{fn}: o")
    assert_close(final, final_ref, 1e-12, f"reference.{fn}: final state")


def test_output_final_state_false_returns_none():
    a = make_inputs("kda")
    o, final = flashdelta.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"])
    assert final is None and o.shape == a["v"].shape


def test_strided_inputs():
    """Non-contiguous views (a transposed layout, a slice) are read through their strides."""
    a = make_inputs("kda", T=21)
    q = a["q"].transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, K] with H-major storage
    v = torch.cat([a["v"], a["v"]], dim=-1)[..., :a["v"].shape[-1]]
    state = a["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not q.is_contiguous() and not v.is_contiguous() and not state.is_contiguous()
    result = flashdelta.chunk_kda(q, a["k"], v, a["g"], a["beta"], initial_state=state,
                                  output_final_state=True)
    expected = naive.recurrence("kda", a["q"], a["k"], a["v"], a["g"], a["beta"],
                                initial_state=a["initial_state"])
    check(result, expected, torch.float32, "strided inputs")


@pytest.mark.parametrize("schedule", ["chunk", "recurrent", "reference"])
def test_generic_forward(schedule):
    a = make_inputs("gated_deltanet", seqlens=[4, 9], qk_l2norm=True, gate_in_kernel=True)
    result = flashdelta.forward(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                mechanism="gated_deltanet", initial_state=a["initial_state"],
                                output_final_state=True, cu_seqlens=a["cu_seqlens"],
                                qk_l2norm=True, gate_in_kernel=True, A_log=a["A_log"],
                                dt_bias=a["dt_bias"], schedule=schedule)
    expected = naive.recurrence("gated_deltanet", a["q"], a["k"], a["v"], a["g"], a["beta"],
                                initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
                                qk_l2norm=True, gate_in_kernel=True, A_log=a["A_log"],
                                dt_bias=a["dt_bias"])
    wide = schedule == "reference"
    check(result, expected, torch.float64 if wide else torch.float32, f"forward {schedule}",
          state_dtype=torch.float64 if wide else torch.float32)


def test_fla_tuning_keywords_change_nothing():
    """fla's kernel-tuning keywords are accepted and leave the result unchanged; the
    deprecated transpose_state_layout means state_v_first (with a DeprecationWarning)."""
    a = make_inputs("kda", seqlens=[5, 14], state_v_first=True)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    kw = dict(initial_state=a["initial_state"], output_final_state=True,
              cu_seqlens=a["cu_seqlens"])
    o, final = flashdelta.chunk_kda(*args, state_v_first=True, **kw)
    tuned = flashdelta.chunk_kda(*args, state_v_first=True, disable_recompute=True,
                                 use_graph=True, max_num_seqs=2, safe_gate=True,
                                 cu_seqlens_cpu=a["cu_seqlens"], chunk_size=32, **kw)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        renamed = flashdelta.chunk_kda(*args, transpose_state_layout=True, **kw)
    for what, (o2, final2) in (("tuning keywords", tuned), ("transpose_state_layout", renamed)):
        assert_close(o2, o, TOLERANCE[torch.float32], f"{what}: o")
        assert_close(final2, final, TOLERANCE[torch.float32], f"{what}: final state")
