"""The opt-in to keep the forward's per-chunk states for the backward (flashdelta.forward's
keep_chunk_states, chunk_kda's disable_recompute as in fla): the backward reads the states
instead of recomputing them. Gradients match those of recomputing (gradcheck in float64
across several 64-token chunks, varlen included), the states are really saved by the forward,
the op passes opcheck, and the NumPy backward takes the states forward returns. CPU here; the
CUDA path is checked in tests/cuda/test_cuda_backward.cpp and test_cuda_backward.py."""

import pytest

from problems import make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402

# Sequences that cross 64-token chunk boundaries, with an empty one between them.
LONG = dict(T=135, H=1, HV=2, K=3, V=2, seqlens=[70, 0, 65], gate_in_kernel=True,
            qk_l2norm=True)


def differentiable(a):
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
             if a[n] is not None]
    return names, [a[n].clone().requires_grad_() for n in names]


def kda(a, names, tensors, keep):
    args = dict(a, **dict(zip(names, tensors)))
    return flashdelta.chunk_kda(
        args["q"], args["k"], args["v"], args["g"], args["beta"],
        initial_state=args["initial_state"], output_final_state=True,
        cu_seqlens=args["cu_seqlens"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=args["A_log"], dt_bias=args["dt_bias"], disable_recompute=keep)


def test_gradcheck_with_kept_states():
    a = make_inputs("kda", dtype=torch.float64, **LONG)
    names, tensors = differentiable(a)
    assert torch.autograd.gradcheck(lambda *xs: kda(a, names, xs, True), tensors, eps=1e-6,
                                    atol=1e-6, rtol=1e-4)


def gradients(a, keep, mechanism="kda", state_v_first=False):
    names, tensors = differentiable(a)
    args = dict(a, **dict(zip(names, tensors)))
    o, final = flashdelta.forward(
        args["q"], args["k"], args["v"], args["g"], args["beta"], mechanism=mechanism,
        initial_state=args["initial_state"], output_final_state=True,
        cu_seqlens=args["cu_seqlens"], qk_l2norm=True, state_v_first=state_v_first,
        chunk_size=64, keep_chunk_states=keep)
    torch.manual_seed(1)
    loss = (o.double() * torch.randn(o.shape, dtype=torch.float64)).sum() + final.sum()
    loss.backward()
    return {n: t.grad for n, t in zip(names, tensors)}


@pytest.mark.parametrize("mechanism,cfg", [
    ("kda", dict(B=2, T=150)),
    ("gated_deltanet", dict(T=200, seqlens=[1, 64, 0, 135], state_v_first=True)),
    ("linear", dict(T=130, initial_state=False)),
], ids=["kda", "gated_deltanet_varlen_v_first", "linear"])
def test_float32_kept_states_give_the_recomputed_gradients(mechanism, cfg):
    """float32 inputs run the CPU chunk forward; its float32 states, kept, give the gradients
    of the fp64 recomputation up to their rounding."""
    a = make_inputs(mechanism, H=2, HV=4, K=8, V=6, qk_l2norm=True, **cfg)
    v_first = cfg.get("state_v_first", False)
    kept = gradients(a, True, mechanism, v_first)
    recomputed = gradients(a, False, mechanism, v_first)
    for name, grad in recomputed.items():
        err = ((kept[name] - grad).abs().max() / grad.abs().max()).item()
        assert err < 1e-5, f"d{name}: relative difference {err}"


def test_forward_saves_the_states_only_when_asked():
    """With keep_chunk_states the forward saves one [C, HV, K, V] float32 tensor more (C = 3
    chunks of the two sequences of 150 tokens here): proof the option is not ignored."""
    a = make_inputs("kda", B=2, T=150, H=2, HV=4, K=8, V=6)
    for keep in (False, True):
        shapes = []

        def pack(t):
            shapes.append((tuple(t.shape), t.dtype))
            return t

        names, tensors = differentiable(a)
        args = dict(a, **dict(zip(names, tensors)))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            flashdelta.forward(args["q"], args["k"], args["v"], args["g"], args["beta"],
                               mechanism="kda", initial_state=args["initial_state"],
                               keep_chunk_states=keep)
        kept = ((2 * 3, 4, 8, 6), torch.float32)
        assert (kept in shapes) == keep, shapes


def test_backward_reads_the_kept_states():
    """Zeroing the kept states between forward and backward (an unpack hook) changes dq: the
    backward reads them rather than recomputing."""
    a = make_inputs("kda", B=2, T=150, H=2, HV=4, K=8, V=6)
    kept_shape = (2 * 3, 4, 8, 6)
    dq = {}
    for spoil in (False, True):
        def unpack(t):
            return torch.zeros_like(t) if spoil and tuple(t.shape) == kept_shape else t

        names, tensors = differentiable(a)
        args = dict(a, **dict(zip(names, tensors)))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            o, _ = flashdelta.forward(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                      mechanism="kda", initial_state=args["initial_state"],
                                      keep_chunk_states=True)
        o.sum().backward()
        dq[spoil] = tensors[0].grad
    assert (dq[True] - dq[False]).abs().max() > 1e-3 * dq[False].abs().max()


def test_opcheck_forward_keeping_states():
    a = make_inputs("kda", dtype=torch.float64, T=70, seqlens=[65, 5], gate_in_kernel=True)
    args = [a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"], a["cu_seqlens"],
            a["A_log"], a["dt_bias"], "kda", 0.25, False, False, False, True, None, False, 64,
            True, "chunk", True]
    for i in range(9):
        if args[i] is not None and args[i].is_floating_point():
            args[i].requires_grad_()
    torch.library.opcheck(torch.ops.flashdelta.forward.default, tuple(args))


def test_numpy_backward_takes_the_forward_states():
    a = make_inputs("kda", dtype="float64", numpy=True, T=140, seqlens=[70, 70])
    options = dict(mechanism="kda", initial_state=a["initial_state"],
                   cu_seqlens=a["cu_seqlens"], schedule="reference")
    o, final, h = flashdelta.forward(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                     output_final_state=True, output_chunk_states=True,
                                     **options)
    assert h.shape[:2] == (1, 4)
    rng = __import__("numpy").random.default_rng(3)
    d_o = rng.standard_normal(o.shape)
    grads = {}
    for states in (None, h):
        grads[states is None] = flashdelta.backward(
            a["q"], a["k"], a["v"], a["g"], a["beta"], d_o=d_o, chunk_states=states,
            **{k: v for k, v in options.items() if k != "schedule"})
    for name, recomputed in grads[True].items():
        err = abs(grads[False][name] - recomputed).max() / abs(recomputed).max()
        assert err < 1e-12, f"d{name}: relative difference {err}"
    with pytest.raises(ValueError, match="chunk_states"):
        flashdelta.backward(a["q"], a["k"], a["v"], a["g"], a["beta"], d_o=d_o,
                            chunk_states=h[0],
                            **{k: v for k, v in options.items() if k != "schedule"})
