"""Gradients of CUDA tensors (the chunkwise CUDA backward through autograd): every chunk_*
function and option of test_autograd.py on the GPU gives the gradients of the same call on
the CPU (the fp64 reference backward), on lengths past several 64-token chunks; two runs are
bitwise identical; flashdelta.forward with schedule="recurrent" differentiates too. Skipped
without a GPU."""

import pytest

import naive
from problems import make_inputs
from test_autograd import CASES, call, differentiable

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# float32 on both sides; the GPU accumulates in float32 over chunks of 64 tokens, the CPU
# reference in float64 (naive.error: max abs error over max(|CPU|, 1)).
TOLERANCE = 2e-3
SHAPE = dict(B=2, T=150, H=2, HV=4, K=32, V=24, dtype="float32")


def gradients(fn, a, cfg, extra, device, seed=1):
    """Gradients of a fixed random projection of (o, final state) for every present input."""
    a = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    names, leaves = differentiable(a)
    o, final = call(fn, a, cfg, extra, names, leaves)
    gen = torch.Generator().manual_seed(seed)
    d_o = torch.randn(o.shape, generator=gen).to(device, o.dtype)
    d_final = torch.randn(final.shape, generator=gen).to(device, final.dtype)
    loss = (o * d_o).sum() + (final * d_final).sum()
    return names, torch.autograd.grad(loss, leaves)


def problem(mechanism, cfg, seed):
    shape = dict(SHAPE)
    if "seqlens" in cfg:  # longer sequences: several chunks, one partial, one empty
        cfg = dict(cfg, seqlens=[130, 0, 64, 1, 77])
    return make_inputs(mechanism, seed=seed, **dict(shape, **cfg)), cfg


@pytest.mark.parametrize("fn,mechanism,cfg,extra", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_cuda_gradients_match_cpu_reference(fn, mechanism, cfg, extra):
    a, cfg = problem(mechanism, cfg, seed=11)
    names, cpu = gradients(fn, a, cfg, extra, "cpu")
    _, gpu = gradients(fn, a, cfg, extra, "cuda")
    for name, c, g in zip(names, cpu, gpu):
        assert g.device.type == "cuda" and g.dtype == c.dtype and g.shape == c.shape, name
        err = naive.error(g.cpu(), c)
        assert err <= TOLERANCE, f"d{name}: GPU vs CPU error {err:.3e} exceeds {TOLERANCE:.0e}"


def test_cuda_gradients_are_deterministic():
    cfg = dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)
    a = make_inputs("kda", seed=3, **dict(SHAPE, T=300, dtype="bfloat16", **cfg))
    _, first = gradients("chunk_kda", a, cfg, {}, "cuda")
    _, second = gradients("chunk_kda", a, cfg, {}, "cuda")
    for x, y in zip(first, second):
        assert torch.equal(x, y)


def test_cuda_recurrent_forward_differentiates():
    import flashdelta
    a = make_inputs("gated_deltanet", seed=5, **SHAPE)
    grads = {}
    for device in ("cpu", "cuda"):
        q = a["q"].to(device).detach().requires_grad_()
        o, _ = flashdelta.forward(q, a["k"].to(device), a["v"].to(device), a["g"].to(device),
                                  a["beta"].to(device), mechanism="gated_deltanet",
                                  schedule="recurrent" if device == "cuda" else "chunk")
        (o * o).sum().backward()
        grads[device] = q.grad
    assert naive.error(grads["cuda"].cpu(), grads["cpu"]) <= TOLERANCE


@pytest.mark.parametrize("cfg", [dict(), dict(seqlens=True, state_v_first=True)],
                         ids=["batch", "varlen_v_first"])
def test_cuda_kept_chunk_states_give_the_reference_gradients(cfg):
    """chunk_kda(disable_recompute=True) on CUDA: the forward's float32 chunk states (with
    device cu_seqlens, sized to the bound T // 64 + N) replace the backward's states pass.
    Against the CPU reference as the main test, with twice its tolerance: the kept states
    carry the forward's rounding (bfloat16 operands) where the recomputed ones carry the
    backward's (tf32)."""
    a, cfg = problem("kda", dict(cfg, qk_l2norm=True), seed=13)
    names, cpu = gradients("chunk_kda", a, cfg, {}, "cpu")
    _, kept = gradients("chunk_kda", a, cfg, dict(disable_recompute=True), "cuda")
    for name, c, k in zip(names, cpu, kept):
        err = naive.error(k.cpu(), c)
        assert err <= 2 * TOLERANCE, f"d{name}: kept states vs CPU reference {err:.3e}"
