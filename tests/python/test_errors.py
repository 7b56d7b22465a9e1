"""Bad input raises ValueError / TypeError / NotImplementedError naming the argument: never a
crash, never a silent wrong answer."""

import numpy as np
import pytest

from problems import make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402


def kda_call(**changes):
    a = make_inputs("kda", seqlens=None)
    a.update(changes.pop("inputs", {}))
    kw = dict(initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
              output_final_state=True)
    kw.update(changes)
    return lambda: flashdelta.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)


def expect(error, names, call):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for name in names:
        assert f"'{name}'" in message or f"{name}(" in message, \
            f"{error.__name__} does not name {name!r}: {message}"


BASE = make_inputs("kda")
# The first batch row alone (B = 1), for the variable-length cases.
ONE_ROW = {n: BASE[n][:1] for n in ("q", "k", "v", "g", "beta")}

CASES = {
    # shapes
    "k shape": (ValueError, ["k"], kda_call(inputs=dict(k=BASE["k"][:, :, :1]))),
    "v heads not a multiple": (ValueError, ["v"],
                               kda_call(inputs=dict(v=torch.randn(2, 19, 3, 12)))),
    "q rank": (ValueError, ["q"], kda_call(inputs=dict(q=BASE["q"][0]))),
    "g scalar for kda": (ValueError, ["g"], kda_call(inputs=dict(g=BASE["g"][..., 0]))),
    "beta shape": (ValueError, ["beta"], kda_call(inputs=dict(beta=BASE["beta"][:, :3]))),
    "K too large": (ValueError, ["q"], kda_call(inputs=dict(
        q=torch.randn(1, 2, 1, 300), k=torch.randn(1, 2, 1, 300), v=torch.randn(1, 2, 1, 4),
        g=-torch.rand(1, 2, 1, 300), beta=torch.rand(1, 2, 1), initial_state=None))),
    "state shape": (ValueError, ["initial_state"],
                    kda_call(initial_state=torch.randn(2, 4, 12, 16))),
    "state rank": (ValueError, ["initial_state"], kda_call(initial_state=torch.randn(4, 16, 12))),
    "5-d input": (ValueError, ["q"], kda_call(inputs=dict(q=BASE["q"][None]))),
    # dtypes
    "int q": (TypeError, ["q"], kda_call(inputs=dict(q=BASE["q"].to(torch.int32)))),
    "complex v": (TypeError, ["v"], kda_call(inputs=dict(v=BASE["v"].to(torch.complex64)))),
    "bool beta": (TypeError, ["beta"], kda_call(inputs=dict(beta=BASE["beta"] > 0.5))),
    "bf16 state": (TypeError, ["initial_state"],
                   kda_call(initial_state=BASE["initial_state"].bfloat16())),
    "float cu_seqlens": (TypeError, ["cu_seqlens"], kda_call(
        inputs=ONE_ROW, initial_state=None, cu_seqlens=torch.tensor([0.0, 19.0]))),
    # variable-length tables
    "cu_seqlens with B > 1": (ValueError, ["cu_seqlens"], kda_call(
        initial_state=None, cu_seqlens=torch.tensor([0, 19]))),
    "cu_seqlens end": (ValueError, ["cu_seqlens"], kda_call(
        inputs=ONE_ROW, initial_state=None, cu_seqlens=torch.tensor([0, 5, 18]))),
    "cu_seqlens decreasing": (ValueError, ["cu_seqlens"], kda_call(
        inputs=ONE_ROW, initial_state=None, cu_seqlens=torch.tensor([0, 12, 5, 19]))),
    "states per sequence": (ValueError, ["initial_state"], kda_call(
        inputs=ONE_ROW, cu_seqlens=torch.tensor([0, 5, 9, 19]))),
    # gate activation and options
    "gate without A_log": (ValueError, ["A_log"], kda_call(use_gate_in_kernel=True)),
    "A_log shape": (ValueError, ["A_log"], kda_call(use_gate_in_kernel=True,
                                                    A_log=torch.zeros(3))),
    "dt_bias shape": (ValueError, ["dt_bias"], kda_call(use_gate_in_kernel=True,
                                                        A_log=torch.zeros(4),
                                                        dt_bias=torch.zeros(5))),
    "positive lower bound": (ValueError, ["lower_bound"], kda_call(
        use_gate_in_kernel=True, A_log=torch.zeros(4), lower_bound=1.0)),
    "safe gate range": (ValueError, ["lower_bound"], kda_call(
        use_gate_in_kernel=True, A_log=torch.zeros(4), lower_bound=-7.0, safe_gate=True)),
    "neg eigval without sigmoid": (ValueError, ["allow_neg_eigval"],
                                   kda_call(allow_neg_eigval=True)),
    "chunk size": (ValueError, ["chunk_size"], kda_call(chunk_size=48)),
    "scale": (ValueError, ["scale"], kda_call(scale=float("nan"))),
    "unknown keyword": (TypeError, ["chunk_kda"], kda_call(use_qk_l2_norm=True)),
    "schedule": (ValueError, ["schedule"], kda_call(schedule="fast")),
    # arrays of the wrong kind or device
    "list input": (TypeError, ["k"], kda_call(inputs=dict(k=[[1.0]]))),
    "numpy among torch": (TypeError, ["v"], kda_call(inputs=dict(v=BASE["v"].numpy()))),
    "device mix": (ValueError, ["g"], kda_call(inputs=dict(g=BASE["g"].to("meta")))),
    # unsupported fla features
    "context parallel": (NotImplementedError, ["cp_context"], kda_call(cp_context=object())),
    # per-chunk states are inference-only, as in fla
    "intermediate states with grad": (NotImplementedError, ["return_intermediate_states"],
                                      kda_call(return_intermediate_states=True, inputs=dict(
                                          v=BASE["v"].clone().requires_grad_()))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_names_the_argument(case):
    error, names, call = CASES[case]
    expect(error, names, call)


def test_other_functions_name_arguments():
    a = make_inputs("gla")
    expect(ValueError, ["g"], lambda: flashdelta.chunk_gla(a["q"], a["k"], a["v"], None))
    expect(NotImplementedError, ["gv"], lambda: flashdelta.fused_recurrent_gla(
        a["q"], a["k"], a["v"], a["g"], gv=a["v"]))
    expect(NotImplementedError, ["gv"], lambda: flashdelta.fused_recurrent_gated_delta_rule(
        a["q"], a["k"], a["v"], gv=a["v"]))
    expect(NotImplementedError, ["return_intermediate_states"], lambda: flashdelta.
           fused_recurrent_gla(a["q"], a["k"], a["v"], a["g"], return_intermediate_states=True))
    expect(ValueError, ["g_gamma"], lambda: flashdelta.chunk_simple_gla(
        a["q"], a["k"], a["v"], g=a["g"][..., 0], g_gamma=torch.zeros(4)))
    expect(ValueError, ["g_gamma"], lambda: flashdelta.chunk_simple_gla(
        a["q"], a["k"], a["v"], g_gamma=torch.zeros(3)))
    expect(TypeError, ["initial_state"], lambda: flashdelta.chunk_linear_attn(
        a["q"], a["k"], a["v"], initial_state=(a["initial_state"], None), normalize=False))
    expect(ValueError, ["A_log"], lambda: flashdelta.chunk_gated_delta_rule(
        a["q"], a["k"], a["v"], a["g"][..., 0], torch.rand(2, 19, 4), use_gate_in_kernel=True))
    expect(ValueError, ["mechanism"], lambda: flashdelta.forward(
        a["q"], a["k"], a["v"], mechanism="retnet"))
    expect(TypeError, ["q"], lambda: flashdelta.forward(
        None, a["k"], a["v"], mechanism="linear"))


def test_nothing_is_written_on_error():
    """Validation happens before anything is written: a failing serving call leaves the pool."""
    a = make_inputs("kda", B=2, T=1, initial_state=False)
    pool = torch.randn(4, 4, 16, 12)
    before = pool.clone()
    with pytest.raises(ValueError, match="state_indices"):
        flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism="kda",
                          state_pool=pool, state_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="state_indices"):
        flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism="kda",
                          state_pool=pool, state_indices=torch.tensor([0, 4]))
    assert torch.equal(pool, before)


def test_numpy_errors():
    a = make_inputs("kda", numpy=True)
    expect(ValueError, ["k"], lambda: flashdelta.chunk_kda(a["q"], a["k"][:, :3], a["v"], a["g"],
                                                           a["beta"]))
    expect(TypeError, ["q"], lambda: flashdelta.chunk_kda(a["q"].astype(np.int64), a["k"],
                                                          a["v"], a["g"], a["beta"]))
    expect(TypeError, ["g"], lambda: flashdelta.chunk_kda(a["q"], a["k"], a["v"],
                                                          torch.from_numpy(a["g"]), a["beta"]))
    readonly = a["initial_state"].copy()
    readonly.setflags(write=False)
    pool_args = dict(mechanism="kda", state_pool=readonly, state_indices=np.array([0, 1]))
    expect(TypeError, ["state_pool"], lambda: flashdelta.decode(
        a["q"][:, :1], a["k"][:, :1], a["v"][:, :1], a["g"][:, :1], a["beta"][:, :1],
        **pool_args))
