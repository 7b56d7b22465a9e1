"""The serving entry point: a state pool addressed by slot indices, updated in place, with
padding rows and multi-token (speculative) steps, against the fp64 recurrence."""

import contextlib

import numpy as np
import pytest

import naive
from problems import TOLERANCE, assert_close, make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402


def expected_decode(mechanism, a, pool, indices, accepted=None, **options):
    """Runs each row from its start slot token by token with the fp64 recurrence and
    applies the slot writes to a copy of the pool. Returns (o, pool)."""
    pool = naive.as64(pool).copy()
    indices = np.asarray(indices)
    N, T = a["q"].shape[:2]
    HV, V = a["v"].shape[2:]
    o = np.zeros((N, T, HV, V))
    for n in range(N):
        per_token = indices.ndim == 2
        start = indices[n, (accepted[n] if accepted is not None else 1) - 1] if per_token \
            else indices[n]
        if start < 0:
            continue
        state = pool[start].copy()
        for t in range(T):
            row = {name: (x[n:n + 1, t:t + 1] if x is not None and name in
                          ("q", "k", "v", "g", "beta") else None) for name, x in a.items()}
            out, state = naive.recurrence(mechanism, row["q"], row["k"], row["v"], row["g"],
                                          row["beta"], initial_state=state[None], **options)
            state = state[0]
            o[n, t] = out[0, 0]
            slot = indices[n, t] if per_token else (indices[n] if t == T - 1 else -1)
            if slot >= 0:
                pool[slot] = state
    return o, pool


def test_decode_one_token_per_row_in_place():
    a = make_inputs("kda", B=4, T=1, initial_state=False)
    pool = torch.randn(6, 4, 16, 12)
    indices = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    o_ref, pool_ref = expected_decode("kda", a, pool, indices)
    o = flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism="kda",
                          state_pool=pool, state_indices=indices)
    tol = TOLERANCE[torch.float32]
    assert_close(o, o_ref, tol, "o")
    assert torch.all(o[1] == 0), "a padding row outputs zeros"
    assert_close(pool, pool_ref, tol, "pool")


@pytest.mark.parametrize("mechanism", ["kda", "gated_deltanet", "gla"])
def test_decode_speculative_per_token_slots(mechanism):
    a = make_inputs(mechanism, B=3, T=3, initial_state=False, qk_l2norm=True,
                    beta_sigmoid=True, gate_in_kernel=mechanism != "gla")
    options = dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=mechanism != "gla",
                   A_log=a["A_log"], dt_bias=a["dt_bias"])
    pool = torch.randn(10, 4, 16, 12)
    indices = torch.tensor([[0, 1, 2], [3, 4, -1], [-1, -1, -1]])
    accepted = torch.tensor([3, 1, 2])
    o_ref, pool_ref = expected_decode(mechanism, a, pool, indices, accepted.numpy(), **options)
    o = flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism=mechanism,
                          state_pool=pool, state_indices=indices, num_accepted_tokens=accepted,
                          **options)
    tol = TOLERANCE[torch.float32]
    assert_close(o, o_ref, tol, f"{mechanism} o")
    assert_close(pool, pool_ref, tol, f"{mechanism} pool")


def test_decode_multi_token_final_slot_and_reference():
    a = make_inputs("gated_deltanet", B=2, T=4, initial_state=False)
    pool = torch.randn(3, 4, 16, 12)
    indices = torch.tensor([2, 0])
    o_ref, pool_ref = expected_decode("gated_deltanet", a, pool, indices)
    for module in (flashdelta, flashdelta.reference):
        p = pool.clone()
        o = module.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism="gated_deltanet",
                          state_pool=p, state_indices=indices)
        tol = 1e-12 if module is flashdelta.reference else TOLERANCE[torch.float32]
        assert_close(o, o_ref, tol, f"{module.__name__} o")
        assert_close(p, pool_ref, TOLERANCE[torch.float32], f"{module.__name__} pool")


@pytest.mark.parametrize("fn,mechanism", [("fused_recurrent_kda", "kda"),
                                          ("fused_recurrent_gated_delta_rule", "gated_deltanet")])
def test_fla_serving_form(fn, mechanism):
    """vLLM-style: initial_state is the pool, ssm_state_indices address it, updated in place."""
    a = make_inputs(mechanism, B=3, T=2, initial_state=False, state_v_first=True)
    pool = torch.randn(4, 4, 12, 16)  # V-first [P, HV, V, K]
    indices = torch.tensor([[1, 2], [0, 3], [-1, -1]])
    accepted = torch.tensor([1, 2, 1])
    o_ref, pool_ref = expected_decode(mechanism, a, pool, indices, accepted.numpy(),
                                      state_v_first=True)
    o, returned = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], beta=a["beta"],
                                          initial_state=pool, state_v_first=True,
                                          ssm_state_indices=indices,
                                          num_accepted_tokens=accepted, inplace_final_state=True)
    assert returned is pool
    tol = TOLERANCE[torch.float32]
    assert_close(o, o_ref, tol, f"{fn} o")
    assert_close(pool, pool_ref, tol, f"{fn} pool")


def test_decode_numpy():
    a = make_inputs("kda", B=2, T=1, initial_state=False, numpy=True)
    pool = np.random.default_rng(3).standard_normal((3, 4, 16, 12)).astype(np.float32)
    indices = np.array([2, 0], dtype=np.int64)
    o_ref, pool_ref = expected_decode("kda", a, pool, indices)
    o = flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism="kda",
                          state_pool=pool, state_indices=indices)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32
    assert_close(o, o_ref, 2e-4, "o")
    assert_close(pool, pool_ref, 2e-4, "pool")



def _serving_args(mechanism):
    a = make_inputs(mechanism, B=2, T=1, initial_state=False)
    pool = torch.randn(3, 4, 16, 12)  # K-first [P, HV, K, V]
    return a, pool, torch.tensor([2, 0])


_KDA, _GDN = "fused_recurrent_kda", "fused_recurrent_gated_delta_rule"


def _serving_call(form):
    """(function name, positional arguments, keywords) of one serving call. form: the function
    (kda / gdn), its gates (the Gated DeltaNet function serves a scalar gate g, KDA's gate gk,
    both, whose decays multiply, or none: DeltaNet), then options."""
    name, gates, *options = form.split("/")
    fn = _KDA if name == "kda" else _GDN
    mechanism = {"vector": "kda", "scalar": "gated_deltanet", "gk": "kda", "gk+g": "kda",
                 "no-gate": "deltanet"}[gates]
    gate_in_kernel, steps = "gate-in-kernel" in options, 2 if "accepted" in options else 1
    a = make_inputs(mechanism, B=3, T=steps, initial_state=False, qk_l2norm=gate_in_kernel,
                    beta_sigmoid=gate_in_kernel, gate_in_kernel=gate_in_kernel)
    kw = dict(initial_state=torch.randn(5, 4, 16, 12), ssm_state_indices=torch.tensor([3, -1, 0]))
    if steps == 2:
        kw.update(ssm_state_indices=torch.tensor([[1, 2], [0, 3], [-1, -1]]),
                  num_accepted_tokens=torch.tensor([1, 2, 1]))
    if gate_in_kernel:
        kw.update(use_gate_in_kernel=True, A_log=a["A_log"], dt_bias=a["dt_bias"],
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if "state-v-first" in options:
        kw.update(initial_state=torch.randn(5, 4, 12, 16), state_v_first=True)
    beta = None if "beta-none" in options else a["beta"]
    if fn == _KDA:
        return fn, (a["q"], a["k"], a["v"], a["g"], beta), kw
    g, gk = a["g"], None
    if gates.startswith("gk"):
        g, gk = None, a["g"]
        if gates == "gk+g":
            g = make_inputs("gated_deltanet", B=3, T=steps, seed=1)["g"]
    return fn, (a["q"], a["k"], a["v"], g), dict(kw, gk=gk, beta=beta)


_SERVING_FORMS = ["kda/vector", "kda/vector/gate-in-kernel", "kda/vector/accepted",
                  "kda/vector/state-v-first", "gdn/scalar", "gdn/scalar/gate-in-kernel",
                  "gdn/scalar/accepted", "gdn/scalar/state-v-first", "gdn/scalar/beta-none",
                  "gdn/gk", "gdn/gk+g", "gdn/gk/accepted", "gdn/no-gate",
                  "gdn/no-gate/state-v-first"]


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing: calls under it take the custom op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Subclass(torch.Tensor):
    """A tensor subclass that changes nothing: a pool of this class takes the custom op."""


@pytest.mark.parametrize("form", _SERVING_FORMS)
def test_fla_serving_form_fallbacks_match_the_fast_path(form, monkeypatch):
    """The plain eager serving call skips serving_call (the ops' one-frame fast path,
    _torch_ops.serving_direct); calls it declines (another keyword, a torch function mode, a
    tensor subclass) take serving_call and give the same outputs and pool bit for bit."""
    from flashdelta.ops import gated_delta_rule, kda
    fn, args, kw = _serving_call(form)
    module = kda if fn == _KDA else gated_delta_rule
    calls = []
    real = module.serving_call
    monkeypatch.setattr(module, "serving_call", lambda *args: calls.append(1) or real(*args))
    pool = kw["initial_state"]

    def run(mode=None, wrap=lambda x: x, **extra):
        p = wrap(pool.clone())
        with mode or contextlib.nullcontext():
            o, returned = getattr(flashdelta, fn)(*args, **dict(kw, initial_state=p), **extra)
        assert returned is p
        return o, p

    o_fast, pool_fast = run()
    assert not calls, "the plain eager call took serving_call"
    assert not torch.equal(pool_fast, pool), "the fast path left the pool as it was"
    for name, how in (("schedule", dict(schedule="recurrent")),
                      ("ignored keyword", dict(use_graph=True)),
                      ("mode", dict(mode=_PassThroughMode())),
                      ("subclass", dict(wrap=lambda x: x.as_subclass(_Subclass)))):
        calls.clear()
        o, p = run(**how)
        assert calls, f"{name}: the call did not take serving_call"
        assert torch.equal(o, o_fast), f"{name}: o differs from the fast path's"
        assert torch.equal(p, pool_fast), f"{name}: the pool differs from the fast path's"


# Bad serving calls: (id, change to a good call's keywords, error, what the message names).
_SERVING_ERRORS = [
    ("accepted-without-indices", dict(ssm_state_indices=None,
                                      num_accepted_tokens=torch.tensor([1, 1])),
     ValueError, "argument 'ssm_state_indices'"),
    ("inplace-without-indices", dict(ssm_state_indices=None, inplace_final_state=True),
     ValueError, "argument 'ssm_state_indices'"),
    ("not-inplace", dict(inplace_final_state=False), NotImplementedError,
     "argument 'inplace_final_state'"),
    ("inplace-none", dict(inplace_final_state=None), NotImplementedError,
     "argument 'inplace_final_state'"),
    ("no-pool", dict(initial_state=None), ValueError, "argument 'initial_state'"),
    ("neg-eigval-without-sigmoid", dict(allow_neg_eigval=True), ValueError,
     "argument 'allow_neg_eigval'"),
    ("gate-without-A_log", dict(use_gate_in_kernel=True, A_log=None), ValueError,
     "argument 'A_log'"),
    ("unknown-keyword", dict(not_a_keyword=1), TypeError, "not_a_keyword"),
    ("not-inplace-with-schedule", dict(inplace_final_state=False, schedule="recurrent"),
     NotImplementedError, "argument 'inplace_final_state'"),
]
# The Gated DeltaNet function's own checks, made before the serving form's.
_GDN_SERVING_ERRORS = [
    ("gv", dict(gv=torch.zeros(2, 1, 4, 12)), NotImplementedError, "argument 'gv'"),
    ("gk-shape", dict(gk=torch.zeros(2, 1, 4, 15)), ValueError,
     r"argument 'gk': expected shape .*\[2, 1, 4, 16\].*got \[2, 1, 4, 15\]"),
    ("gk-with-gate-in-kernel", dict(gk=torch.zeros(2, 1, 4, 16), use_gate_in_kernel=True,
                                    A_log=torch.zeros(4)), NotImplementedError, "argument 'gk'"),
    ("numpy-beta", dict(beta=np.ones((2, 1, 4), np.float32)), TypeError,
     "argument 'beta': expected a torch.Tensor like q, got numpy.ndarray"),
]


@pytest.mark.parametrize("fn,mechanism,change,error,match", [
    pytest.param(fn, mechanism, change, error, match, id=f"{short}-{name}")
    for fn, mechanism, short, errors in ((_KDA, "kda", "kda", _SERVING_ERRORS),
                                         (_GDN, "gated_deltanet", "gdn",
                                          _SERVING_ERRORS + _GDN_SERVING_ERRORS))
    for name, change, error, match in errors])
def test_fla_serving_form_errors(fn, mechanism, change, error, match):
    """Bad serving calls raise the serving form's errors, naming the argument, and leave the
    pool as it was (its data and its version counter)."""
    a, pool, indices = _serving_args(mechanism)
    before, version = pool.clone(), pool._version
    kw = dict(beta=a["beta"], initial_state=pool, ssm_state_indices=indices)
    kw.update(change)
    if kw["ssm_state_indices"] is None:
        del kw["ssm_state_indices"]
    with pytest.raises(error, match=match):
        getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], **kw)
    assert torch.equal(pool, before) and pool._version == version
