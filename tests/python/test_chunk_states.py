"""return_intermediate_states=True (fla's inference mode): the chunk_* functions return
(o, final_state, h), h [B, NT, HV, K, V] the state before tokens 0, 64, 128, ... of every
sequence. Checked against the independent fp64 recurrence run over each sequence's prefixes:
fixed length and varlen with empty and one-token sequences, T not a multiple of 64, both
state layouts, with and without an initial state, every chunk_* function, NumPy, the
reference, cu_seqlens_cpu, torch.compile. CUDA tensors: test_cuda.py."""

import numpy as np
import pytest

import naive
from problems import TOLERANCE, assert_close, make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402

CHUNK = 64

# (function, mechanism, extra arguments): every chunk_* function.
FUNCTIONS = [
    ("chunk_kda", "kda", {}),
    ("chunk_gated_delta_rule", "gated_deltanet", {}),
    ("chunk_delta_rule", "deltanet", {}),
    ("chunk_gla", "gla", {}),
    ("chunk_simple_gla", "simple_gla", {}),
    ("chunk_linear_attn", "linear", dict(normalize=False)),
    ("chunk_linear_attn", "linear", dict(normalize=True)),
]
SHAPES = [
    ("fixed", dict(B=2, T=150)),
    ("varlen_v_first", dict(seqlens=[0, 1, 64, 65, 130, 0, 7], state_v_first=True,
                            initial_state=False)),
    ("exact_multiple", dict(B=1, T=128, H=1, HV=2)),
]


def call(fn, mechanism, a, extra, **kw):
    """fn on the problem `a` (make_inputs), positional arguments as fla takes them."""
    args = [a["q"], a["k"], a["v"]]
    if naive.GATE[mechanism] is not None:
        args.append(a["g"])
    if naive.DELTA[mechanism]:
        args.append(a["beta"])
    if fn == "chunk_delta_rule":
        args = [a["q"], a["k"], a["v"], a["beta"]]
    return getattr(flashdelta, fn)(*args, initial_state=a["initial_state"],
                                   cu_seqlens=a["cu_seqlens"], **extra, **kw)


def sequences(a):
    """(batch row, first token, length) of each sequence of `a`."""
    B, T = a["q"].shape[:2]
    return naive.sequences(B, T, a["cu_seqlens"])


def expected_h(mechanism, a, state_v_first):
    """The state before every 64th token of every sequence, from the fp64 recurrence over that
    sequence's prefix alone: [B, NT, HV, K, V] (V-first when asked), B = 1 with cu_seqlens."""
    rows = []
    for n, (b, t0, length) in enumerate(sequences(a)):
        for t in range(0, length, CHUNK):
            cut = {name: (None if a[name] is None else a[name][b:b + 1, t0:t0 + t])
                   for name in ("q", "k", "v", "g", "beta")}
            h0 = None if a["initial_state"] is None else a["initial_state"][n:n + 1]
            _, state = naive.recurrence(mechanism, cut["q"], cut["k"], cut["v"], cut["g"],
                                        cut["beta"], initial_state=h0,
                                        state_v_first=state_v_first)
            rows.append(state[0])
    B = a["q"].shape[0] if a["cu_seqlens"] is None else 1
    HV, V, K = a["v"].shape[2], a["v"].shape[3], a["q"].shape[3]
    shape = (HV, V, K) if state_v_first else (HV, K, V)
    return np.array(rows).reshape((B, -1) + shape)


@pytest.mark.parametrize("shape,cfg", SHAPES, ids=[s for s, _ in SHAPES])
@pytest.mark.parametrize("fn,mechanism,extra", FUNCTIONS,
                         ids=[f"{f}{'_normalize' if e.get('normalize') else ''}"
                              for f, _, e in FUNCTIONS])
def test_h_is_the_state_entering_each_chunk(fn, mechanism, extra, shape, cfg):
    # fla's chunk_delta_rule and chunk_linear_attn have no state_v_first.
    v_first = cfg.get("state_v_first", False) and fn not in ("chunk_delta_rule",
                                                              "chunk_linear_attn")
    a = make_inputs(mechanism, **dict(cfg, state_v_first=v_first))
    if v_first:
        extra = dict(extra, state_v_first=True)
    with torch.inference_mode():
        o, final, h = call(fn, mechanism, a, extra, output_final_state=True,
                           return_intermediate_states=True)
        o2, final2 = call(fn, mechanism, a, extra, output_final_state=True)
    want = expected_h(mechanism, a, v_first)
    assert tuple(h.shape) == want.shape, f"h shape {tuple(h.shape)}, expected {want.shape}"
    assert h.dtype == a["q"].dtype
    assert_close(h, want, TOLERANCE[torch.float32], f"{fn} {shape}: h")
    # Recording the states changes nothing else.
    assert torch.equal(o, o2)
    finals = (final, final2) if not extra.get("normalize") else (final[0], final2[0])
    assert torch.equal(*finals)


def test_without_final_state_and_in_every_float_dtype():
    for dtype in ("float32", "bfloat16", "float16"):
        a = make_inputs("kda", B=1, T=100, dtype=dtype, initial_state=True)
        with torch.no_grad():
            o, final, h = flashdelta.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                               initial_state=a["initial_state"],
                                               return_intermediate_states=True)
        assert final is None
        assert h.dtype == getattr(torch, dtype) and tuple(h.shape) == (1, 2, 4, 16, 12)
        assert_close(h, expected_h("kda", a, False), TOLERANCE[h.dtype], f"h {dtype}")


def test_cu_seqlens_cpu_counts_the_chunks():
    a = make_inputs("gated_deltanet", seqlens=[70, 0, 3])
    with torch.inference_mode():
        *_, h = flashdelta.chunk_gated_delta_rule(
            a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
            cu_seqlens=a["cu_seqlens"], cu_seqlens_cpu=a["cu_seqlens"].clone(),
            return_intermediate_states=True)
    assert tuple(h.shape) == (1, 3, 4, 16, 12)
    assert_close(h, expected_h("gated_deltanet", a, False), TOLERANCE[torch.float32], "h")


def test_schedules_and_reference():
    a = make_inputs("kda", seqlens=[65, 1, 130])
    want = expected_h("kda", a, False)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    kw = dict(initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
              return_intermediate_states=True)
    with torch.inference_mode():
        for schedule in ("chunk", "recurrent"):
            for chunk_size in (16, 128):
                *_, h = flashdelta.chunk_kda(*args, schedule=schedule, chunk_size=chunk_size,
                                             **kw)
                assert_close(h, want, TOLERANCE[torch.float32], f"{schedule} C={chunk_size}")
        *_, h = flashdelta.reference.chunk_kda(*args, **kw)
    assert h.dtype == torch.float64
    assert_close(h, want, TOLERANCE[torch.float64], "reference")


def test_numpy_inputs():
    a = make_inputs("gla", B=1, T=70, numpy=True)
    o, final, h = flashdelta.chunk_gla(a["q"], a["k"], a["v"], a["g"],
                                       initial_state=a["initial_state"], output_final_state=True,
                                       return_intermediate_states=True)
    assert isinstance(h, np.ndarray) and h.dtype == np.float32 and h.shape == (1, 2, 4, 16, 12)
    assert_close(h, expected_h("gla", a, False), TOLERANCE[torch.float32], "numpy h")
    o2, h2 = flashdelta.forward(a["q"], a["k"], a["v"], a["g"], mechanism="gla",
                                initial_state=a["initial_state"], chunk_size=64,
                                output_chunk_states=True)[::2]
    assert np.array_equal(o, o2) and np.array_equal(h, h2)


def test_inference_only():
    a = make_inputs("kda")
    q = a["q"].clone().requires_grad_()
    args = (q, a["k"], a["v"], a["g"], a["beta"])
    with pytest.raises(NotImplementedError, match="'return_intermediate_states'.*'q'"):
        flashdelta.chunk_kda(*args, return_intermediate_states=True)
    with pytest.raises(NotImplementedError, match="'output_chunk_states'"):
        flashdelta.forward(*args, mechanism="kda", output_chunk_states=True)
    with torch.no_grad():  # without autograd the same call runs
        *_, h = flashdelta.chunk_kda(*args, return_intermediate_states=True)
    assert not h.requires_grad
    with pytest.raises(NotImplementedError, match="'return_intermediate_states'"):
        flashdelta.fused_recurrent_kda(*args, return_intermediate_states=True)


def test_opcheck_and_compile():
    a = make_inputs("kda", B=1, T=70, dtype=torch.float64)
    K = a["q"].shape[-1]
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"], None, None, None,
            "kda", K ** -0.5, False, False, False, False, None, False, 64, True, "chunk", 2)
    torch.library.opcheck(torch.ops.flashdelta.forward_chunk_states.default, args)

    def step(q, k, v, g, beta, h0):
        o, final, h = flashdelta.chunk_kda(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True,
                                           return_intermediate_states=True)
        return o * 2, h.sum(1)

    b = make_inputs("kda", B=2, T=70)
    inputs = (b["q"], b["k"], b["v"], b["g"], b["beta"], b["initial_state"])
    with torch.inference_mode():
        compiled = torch.compile(step, fullgraph=True, backend="eager")(*inputs)
        eager = step(*inputs)
    assert all(torch.equal(x, y) for x, y in zip(compiled, eager))


def test_chunk_kda_refuses_fla_32_token_h():
    """fla's chunk_kda(chunk_size=32) returns h per 32 tokens (NT = ceil(T / 32)); FlashDelta
    records h per 64 tokens whatever chunk_size (a CPU schedule knob here) says, so that call
    is refused by name rather than answered with an h of another shape. 16 and 128, which fla
    refuses, keep their FlashDelta meaning (test_schedules_and_reference)."""
    a = make_inputs("kda", B=1, T=70)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    with torch.inference_mode():
        with pytest.raises(NotImplementedError, match="'chunk_size'.*32.*64"):
            flashdelta.chunk_kda(*args, chunk_size=32, return_intermediate_states=True)
        o, _ = flashdelta.chunk_kda(*args, chunk_size=32)  # without h, 32 is a schedule knob
        *_, h = flashdelta.chunk_kda(*args, chunk_size=64, return_intermediate_states=True)
    assert tuple(h.shape) == (1, 2, 4, 16, 12)
