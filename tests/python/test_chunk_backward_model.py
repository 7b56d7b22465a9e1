"""bench/model/chunk_backward.py, the written-out chunkwise KDA backward that the CUDA
backward follows, against torch.autograd of the token-by-token recurrence (float64, CPU)."""
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
