"""Autograd: torch.autograd.gradcheck in float64 (finite differences of the fp64 forward
against the library's backward) for every chunk_* function, through the fused transforms,
for every differentiable input and both outputs (o and the final state)."""

import pytest

from problems import make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402

SMALL = dict(B=1, T=7, H=1, HV=2, K=3, V=2, dtype=torch.float64)

# (function, mechanism, make_inputs options, extra fla keyword arguments)
CASES = [
    ("chunk_kda", "kda", dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True), {}),
    ("chunk_kda", "kda", dict(gate_in_kernel=True, lower_bound=-3.0, seqlens=[3, 0, 4]), {}),
    ("chunk_kda", "kda", dict(gate_in_kernel=True, lower_bound=-3.0, with_A_log=False,
                              beta_sigmoid=True, allow_neg_eigval=True, state_v_first=True), {}),
    ("chunk_gated_delta_rule", "gated_deltanet",
     dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True), {}),
    ("chunk_gated_delta_rule", "gated_deltanet", dict(seqlens=[5, 2]), {}),
    ("chunk_delta_rule", "deltanet", dict(qk_l2norm=True), {}),
    ("chunk_gla", "gla", dict(seqlens=[1, 6]), {}),
    ("chunk_simple_gla", "simple_gla", {}, {}),
    ("chunk_linear_attn", "linear", {}, dict(normalize=False)),
    ("fused_recurrent_kda", "kda", dict(gate_in_kernel=True, beta_sigmoid=True), {}),
]


def differentiable(a):
    """The present float inputs, as leaves that require grad."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
             if a[n] is not None]
    return names, [a[n].clone().requires_grad_() for n in names]


def call(fn, a, cfg, extra, names, tensors):
    args = dict(a, **dict(zip(names, tensors)))
    kw = dict(initial_state=args["initial_state"], output_final_state=True,
              cu_seqlens=args["cu_seqlens"], **extra)
    if fn not in ("chunk_delta_rule", "chunk_linear_attn"):
        kw["state_v_first"] = cfg.get("state_v_first", False)
    if fn in ("chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule", "chunk_delta_rule"):
        kw["use_qk_l2norm_in_kernel"] = cfg.get("qk_l2norm", False)
    if fn in ("chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule"):
        kw["use_beta_sigmoid_in_kernel"] = cfg.get("beta_sigmoid", False)
        kw["allow_neg_eigval"] = cfg.get("allow_neg_eigval", False)
        if cfg.get("gate_in_kernel"):
            kw.update(use_gate_in_kernel=True, A_log=args["A_log"], dt_bias=args["dt_bias"])
            if "lower_bound" in cfg:
                kw["lower_bound"] = cfg["lower_bound"]
    positional = [args[n] for n in ("q", "k", "v", "g") if args[n] is not None]
    if args["beta"] is not None:
        kw["beta"] = args["beta"]
    return getattr(flashdelta, fn)(*positional, **kw)


@pytest.mark.parametrize("fn,mechanism,cfg,extra", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_gradcheck(fn, mechanism, cfg, extra):
    a = make_inputs(mechanism, **dict(SMALL, **cfg))
    names, tensors = differentiable(a)

    def f(*xs):
        return call(fn, a, cfg, extra, names, xs)

    assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_simple_gla_g_gamma():
    a = make_inputs("simple_gla", **SMALL)
    gamma = torch.tensor([-0.2, -0.7], dtype=torch.float64, requires_grad=True)
    q, k, v, h0 = (a[n].clone().requires_grad_() for n in ("q", "k", "v", "initial_state"))

    def f(q, k, v, gamma, h0):
        return flashdelta.chunk_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0,
                                           output_final_state=True)

    assert torch.autograd.gradcheck(f, (q, k, v, gamma, h0), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_normalized_linear_attn():
    a = make_inputs("linear", **SMALL)
    q, k, v, h0 = (a[n].abs().clone().requires_grad_() for n in ("q", "k", "v", "initial_state"))
    z0 = torch.rand(1, 1, 2, 3, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, h0, z0):
        o, (S, z) = flashdelta.chunk_linear_attn(q, k, v, initial_state=(h0, z0),
                                                 output_final_state=True)
        return o, S, z

    assert torch.autograd.gradcheck(f, (q, k, v, h0, z0), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_low_precision_gradients_match_float64(dtype, tol):
    """The fast forward in float32/bf16 and its gradients agree with the float64 run."""
    cfg = dict(T=40, qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)
    wide = make_inputs("kda", dtype=torch.float64, **cfg)
    narrow = make_inputs("kda", dtype=dtype, **cfg)
    results = {}
    for label, a in (("wide", wide), ("narrow", narrow)):
        names, tensors = differentiable(a)
        o, final = call("chunk_kda", a, cfg, {}, names, tensors)
        # A fixed random projection of both outputs makes every gradient non-trivial.
        gen = torch.Generator().manual_seed(1)
        loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() + \
               (final.double() * torch.randn(final.shape, generator=gen,
                                             dtype=torch.float64)).sum()
        loss.backward()
        results[label] = {n: t.grad for n, t in zip(names, tensors)}
    for name, expected in results["wide"].items():
        got = results["narrow"][name]
        assert got.dtype == narrow[name].dtype, f"d{name}: dtype {got.dtype}"
        err = ((got.double() - expected).abs().max() / expected.abs().max().clamp_min(1)).item()
        assert err <= tol, f"d{name} in {dtype}: error {err:.3e} exceeds tolerance {tol:.1e}"


def test_gradient_of_unused_final_state_and_partial_requires_grad():
    """Only v requires grad; the final state is not requested: dv still matches float64."""
    a = make_inputs("gla", **SMALL)
    v = a["v"].clone().requires_grad_()
    o, final = flashdelta.chunk_gla(a["q"], a["k"], v, a["g"], initial_state=a["initial_state"])
    assert final is None
    o.sum().backward()
    assert v.grad is not None and v.grad.shape == v.shape
    assert torch.autograd.gradcheck(
        lambda v: flashdelta.chunk_gla(a["q"], a["k"], v, a["g"],
                                       initial_state=a["initial_state"])[0],
        (v.detach().clone().requires_grad_(),))
