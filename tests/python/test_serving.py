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


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing: calls under it take the custom op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fn,mechanism", [("fused_recurrent_kda", "kda"),
                                          ("fused_recurrent_gated_delta_rule", "gated_deltanet")])
def test_fla_serving_form_fallbacks_match_the_fast_path(fn, mechanism, monkeypatch):
    """The plain eager serving call skips serving_call (the ops' one-frame fast path,
    _torch_ops.serving_direct); calls it declines (another keyword, a torch function mode)
    take serving_call and give the same outputs and pool bit for bit."""
    from flashdelta.ops import gated_delta_rule, kda
    module = kda if fn == "fused_recurrent_kda" else gated_delta_rule
    calls = []
    real = module.serving_call
    monkeypatch.setattr(module, "serving_call", lambda *args: calls.append(1) or real(*args))
    a, pool, indices = _serving_args(mechanism)
    step = getattr(flashdelta, fn)

    def run(mode=None, **extra):
        p = pool.clone()
        with mode or contextlib.nullcontext():
            o, returned = step(a["q"], a["k"], a["v"], a["g"], beta=a["beta"], initial_state=p,
                               ssm_state_indices=indices, **extra)
        assert returned is p
        return o, p

    o_fast, pool_fast = run()
    assert not calls, "the plain eager call took serving_call"
    for name, kw in (("schedule", dict(schedule="recurrent")),
                     ("mode", dict(mode=_PassThroughMode()))):
        calls.clear()
        o, p = run(**kw)
        assert calls, f"{name}: the call did not take serving_call"
        assert torch.equal(o, o_fast), f"{name}: o differs from the fast path's"
        assert torch.equal(p, pool_fast), f"{name}: the pool differs from the fast path's"


@pytest.mark.parametrize("fn,mechanism", [("fused_recurrent_kda", "kda"),
                                          ("fused_recurrent_gated_delta_rule", "gated_deltanet")])
@pytest.mark.parametrize("change,error,match", [
    (dict(ssm_state_indices=None, num_accepted_tokens=torch.tensor([1, 1])), ValueError,
     "argument 'ssm_state_indices'"),
    (dict(inplace_final_state=False), NotImplementedError, "argument 'inplace_final_state'"),
    (dict(initial_state=None), ValueError, "argument 'initial_state'"),
    (dict(allow_neg_eigval=True), ValueError, "argument 'allow_neg_eigval'"),
    (dict(use_gate_in_kernel=True, A_log=None), ValueError, "argument 'A_log'"),
    (dict(not_a_keyword=1), TypeError, "not_a_keyword"),
])
def test_fla_serving_form_errors(fn, mechanism, change, error, match):
    """Bad serving calls raise the serving form's errors, naming the argument, and leave the
    pool as it was."""
    a, pool, indices = _serving_args(mechanism)
    before = pool.clone()
    kw = dict(beta=a["beta"], initial_state=pool, ssm_state_indices=indices)
    kw.update(change)
    if kw["ssm_state_indices"] is None:
        del kw["ssm_state_indices"]
    with pytest.raises(error, match=match):
        getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], **kw)
    assert torch.equal(pool, before)
