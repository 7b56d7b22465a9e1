"""bench/model/chunk_backward.py, the written-out chunkwise KDA backward that the CUDA
backward follows, against torch.autograd of the token-by-token recurrence (float64, CPU);
and bench/model/backward_rounding.py's exact path against it."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "model", "chunk_backward.py")
_spec = importlib.util.spec_from_file_location("chunk_backward_model", _PATH)
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


# T = 1 (one partial chunk), 64 (one full), 65 (a one-token tail), 150 (three chunks);
# odd K and V.
@pytest.mark.parametrize("T", [1, 64, 65, 150])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunk_backward_matches_autograd(T, seed):
    errors = model.max_relative_errors(T=T, K=12, V=20, seed=seed)
    assert max(errors.values()) < 1e-10, errors


# A scalar gate's short form (cuda/backward_chunk.cu): the pairs' share of dG summed over
# the channels (all a scalar gate's gradient needs) is rowsum(M) - colsum(M) of one C x C
# matrix. Random lower-triangular dA_qk and strictly lower dA_kk; chunks of 64, 37 and 1
# tokens.
@pytest.mark.parametrize("C", [64, 37, 1])
def test_scalar_gate_pairs_sum_over_channels(C):
    q, k, v, g, beta, S0, _, _ = model.random_problem(C, 12, 20, seed=C)
    g = g[:, :1].expand(-1, 12).contiguous()  # one gate per token
    x = model.chunk_tensors(q, k, v, g, beta, S0)
    gen = torch.Generator().manual_seed(C)
    dAqk = torch.tril(torch.randn(C, C, generator=gen, dtype=torch.float64))
    dAkk_b = torch.tril(torch.randn(C, C, generator=gen, dtype=torch.float64), -1)
    per_channel = model.pair_dG(x, dAqk, dAkk_b).sum(1)
    short = model.scalar_gate_pair_dG(x, dAqk, dAkk_b)
    assert torch.allclose(short, per_channel, rtol=1e-10, atol=1e-12)


def _load(name):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "model", name + ".py")
    spec = importlib.util.spec_from_file_location(name + "_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounding_model_without_roundings_is_the_chunk_backward():
    """bench/model/backward_rounding.py (numpy, every head, factorised pairwise sums) with no
    rounding gives chunk_backward's gradients, so its error figures measure roundings only."""
    rounding = _load("backward_rounding")
    x = rounding.training_inputs(150, 1, 16, 24)
    gen = torch.Generator().manual_seed(3)
    d_o = torch.randn(150, 1, 24, generator=gen, dtype=torch.float64)
    d_final = torch.randn(1, 16, 24, generator=gen, dtype=torch.float64)
    got = rounding.backward(x, d_o.numpy(), d_final.numpy(), {})
    inputs = [torch.from_numpy(x[n][:, 0]) for n in ("q", "k", "v", "g", "beta")]
    want = model.chunk_backward(*inputs, torch.from_numpy(x["h0"][0]), d_o[:, 0], d_final[0])
    for name, w in zip(rounding.GRADS, want):
        g = got[name][0] if name == "dh0" else got[name][:, 0]
        err = abs(g - w.numpy()).max() / abs(w.numpy()).max()
        assert err < 1e-12, (name, err)
