"""Against flash-linear-attention's own pure-PyTorch references (fla.ops.*.naive) on the CPU,
when fla can be imported here (its Triton paths need a GPU). fla's naive code computes in
float32, so the tolerance is float32's."""

import importlib

import pytest

from problems import TOLERANCE, assert_close, make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402


def fla_naive(module):
    try:
        return importlib.import_module(f"fla.ops.{module}.naive")
    except Exception:  # not installed, or not importable without a GPU
        pytest.skip("flash-linear-attention is not importable here")


TOL = TOLERANCE[torch.float32]


def compare(ours, theirs, what):
    assert_close(ours[0], theirs[0], TOL, f"{what}: o")
    assert_close(ours[1], theirs[1], TOL, f"{what}: final state")


@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
def test_kda_vs_fla_naive(fn):
    naive = fla_naive("kda")
    a = make_inputs("kda", T=33, dtype=torch.float64)  # GVA: H = 2, HV = 4
    ours = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=0.3,
                                   initial_state=a["initial_state"], output_final_state=True)
    theirs = naive.naive_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=0.3,
                                       initial_state=a["initial_state"],
                                       output_final_state=True)
    compare(ours, theirs, fn)


@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_gated_delta_rule_vs_fla_naive(fn):
    naive = fla_naive("gated_delta_rule")
    a = make_inputs("gated_deltanet", T=33, HV=2, dtype=torch.float64)  # fla's naive: HV = H
    ours = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"], beta=a["beta"],
                                   initial_state=a["initial_state"], output_final_state=True)
    theirs = naive.naive_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["beta"], a["g"],
                                                    initial_state=a["initial_state"],
                                                    output_final_state=True)
    compare(ours, theirs, fn)


@pytest.mark.parametrize("fn", ["chunk_delta_rule", "fused_recurrent_delta_rule"])
def test_delta_rule_vs_fla_naive(fn):
    naive = fla_naive("delta_rule")
    a = make_inputs("deltanet", T=33, HV=2, dtype=torch.float64)
    ours = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["beta"],
                                   initial_state=a["initial_state"], output_final_state=True)
    head_first = [a[n].transpose(1, 2) for n in ("q", "k", "v", "beta")]  # [B, H, T, ...]
    o, S = naive.delta_rule_recurrence(*head_first, initial_state=a["initial_state"],
                                       output_final_state=True)
    compare(ours, (o.transpose(1, 2), S), fn)


@pytest.mark.parametrize("fn", ["chunk_gla", "fused_recurrent_gla"])
def test_gla_vs_fla_naive(fn):
    naive = fla_naive("gla")
    a = make_inputs("gla", T=33, HV=2, dtype=torch.float64)
    ours = getattr(flashdelta, fn)(a["q"], a["k"], a["v"], a["g"],
                                   initial_state=a["initial_state"], output_final_state=True)
    theirs = naive.naive_recurrent_gla(a["q"], a["k"], a["v"], a["g"],
                                       initial_state=a["initial_state"], output_final_state=True)
    compare(ours, theirs, fn)


def test_simple_gla_vs_fla_naive():
    naive = fla_naive("simple_gla")
    a = make_inputs("simple_gla", T=33, HV=2, dtype=torch.float64)
    ours = flashdelta.chunk_simple_gla(a["q"], a["k"], a["v"], a["g"], scale=0.2,
                                       initial_state=a["initial_state"], output_final_state=True)
    theirs = naive.naive_recurrent_simple_gla(a["q"], a["k"], a["v"], a["g"], scale=0.2,
                                              initial_state=a["initial_state"],
                                              output_final_state=True)
    compare(ours, theirs, "chunk_simple_gla")


@pytest.mark.parametrize("fn", ["chunk_linear_attn", "fused_recurrent_linear_attn"])
@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attn_vs_fla_naive(fn, normalize):
    naive = fla_naive("linear_attn")
    a = make_inputs("linear", T=33, HV=2)  # float32: fla's naive code adds a float32 state
    q, k = a["q"].abs(), a["k"].abs()  # keeps the normaliser away from zero
    o, final = getattr(flashdelta, fn)(q, k, a["v"], initial_state=a["initial_state"],
                                       output_final_state=True, normalize=normalize)
    o_fla, final_fla = naive.naive_recurrent_linear_attn(
        q, k, a["v"], initial_state=a["initial_state"], output_final_state=True,
        normalize=normalize)
    if normalize:
        (S, z), (S_fla, z_fla) = final, final_fla
        assert_close(z, z_fla, TOL, f"{fn}: z state")
        final, final_fla = S, S_fla
    compare((o, final), (o_fla, final_fla), f"{fn} normalize={normalize}")
