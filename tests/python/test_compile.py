"""torch integration: the custom ops pass torch.library.opcheck (schema, fake tensors,
autograd registration, AOT dispatch), and torch.compile(fullgraph=True) traces a small KDA
block, forward and backward, without graph breaks and with eager's results."""

import pytest

from problems import make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402


def forward_op_args(mechanism, cfg, output_final_state=True, schedule="chunk"):
    a = make_inputs(mechanism, **cfg)
    K = a["q"].shape[-1]
    return (a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"], a["cu_seqlens"],
            a["A_log"], a["dt_bias"], mechanism, K ** -0.5, cfg.get("qk_l2norm", False),
            cfg.get("beta_sigmoid", False), False, cfg.get("gate_in_kernel", False),
            cfg.get("lower_bound"), cfg.get("state_v_first", False), 64, output_final_state,
            schedule)


OPCHECK_CASES = [
    ("kda", dict(T=9, qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True), True),
    ("gated_deltanet", dict(T=9, seqlens=[4, 5]), True),
    ("gla", dict(T=9, state_v_first=True, initial_state=False), False),
]


@pytest.mark.parametrize("mechanism,cfg,final", OPCHECK_CASES,
                         ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_forward(mechanism, cfg, final):
    args = forward_op_args(mechanism, dict(cfg, dtype=torch.float64), final)
    for i in range(9):  # every present float tensor takes part in autograd
        if args[i] is not None and args[i].is_floating_point():
            args[i].requires_grad_()
    torch.library.opcheck(torch.ops.flashdelta.forward.default, args)


def test_opcheck_decode():
    a = make_inputs("kda", B=3, T=1, initial_state=False)
    pool = torch.randn(5, 4, 16, 12)
    indices = torch.tensor([4, -1, 0])
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], None, None, None, pool, indices, None,
            "kda", 0.25, False, False, False, False, None, False, "recurrent")
    torch.library.opcheck(torch.ops.flashdelta.decode.default, args)


class KDABlock(torch.nn.Module):
    """A small KDA layer as fla's KDA layer calls it: projections, fused transforms, state."""

    def __init__(self, hidden=32, heads=2, value_heads=4, head_dim=8, keep_states=False):
        super().__init__()
        self.H, self.HV, self.K = heads, value_heads, head_dim
        self.keep_states = keep_states  # fla's disable_recompute
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, value_heads * head_dim, bias=False)
        self.g_proj = torch.nn.Linear(hidden, value_heads * head_dim, bias=False)
        self.b_proj = torch.nn.Linear(hidden, value_heads, bias=False)
        self.o_proj = torch.nn.Linear(value_heads * head_dim, hidden, bias=False)
        self.A_log = torch.nn.Parameter(torch.linspace(-1.0, 0.5, value_heads))
        self.dt_bias = torch.nn.Parameter(0.1 * torch.randn(value_heads * head_dim))

    def forward(self, x, state):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.K)
        k = self.k_proj(x).view(B, T, self.H, self.K)
        v = self.v_proj(x).view(B, T, self.HV, self.K)
        g = self.g_proj(x).view(B, T, self.HV, self.K)
        beta = self.b_proj(x)
        o, state = flashdelta.chunk_kda(
            q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, state_v_first=True,
            disable_recompute=self.keep_states)
        return self.o_proj(o.reshape(B, T, -1)), state


def run_block(block, x, state):
    for p in block.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    y, final = block(x, state)
    (y.square().mean() + final.square().mean()).backward()
    return [y, final, x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compile_kda_block_fullgraph(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    block = KDABlock()
    x = torch.randn(2, 24, 32)
    state = torch.randn(2, 4, 8, 8)
    eager = run_block(block, x, state)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    for _ in range(2):  # the second call runs the cached graph
        got = run_block(compiled, x, state)
    for i, (e, c) in enumerate(zip(eager, got)):
        assert c is not None and c.shape == e.shape, f"result {i}: {c} vs {e.shape}"
        err = ((c - e).abs().max() / e.abs().max().clamp_min(1)).item()
        assert err <= 1e-5, f"result {i}: compiled vs eager error {err:.3e} > 1e-5"


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compile_kda_block_keeping_chunk_states(backend):
    """disable_recompute=True (the forward keeps its per-chunk states for the backward, a third
    output of the forward op saved for autograd) traces without graph breaks and gives eager's
    results without it, over two 64-token chunks."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    block = KDABlock()
    x = torch.randn(2, 100, 32)
    state = torch.randn(2, 4, 8, 8)
    eager = run_block(block, x, state)
    block.keep_states = True
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = run_block(compiled, x, state)
    for i, (e, c) in enumerate(zip(eager, got)):
        err = ((c - e).abs().max() / e.abs().max().clamp_min(1)).item()
        assert err <= 1e-5, f"result {i}: compiled, states kept, vs eager error {err:.3e}"


def test_compile_serving_step_fullgraph():
    """decode mutates the state pool in place; compiled and eager steps agree."""
    torch._dynamo.reset()
    a = make_inputs("gated_deltanet", B=3, T=2, initial_state=False, qk_l2norm=True)
    pool = torch.randn(6, 4, 16, 12)
    indices = torch.tensor([[5, 2], [-1, -1], [0, 1]])
    accepted = torch.tensor([2, 1, 1])

    def step(q, k, v, g, beta, pool):
        return flashdelta.decode(q, k, v, g, beta, mechanism="gated_deltanet", state_pool=pool,
                                 state_indices=indices, num_accepted_tokens=accepted,
                                 qk_l2norm=True)

    eager_pool, compiled_pool = pool.clone(), pool.clone()
    o_eager = step(a["q"], a["k"], a["v"], a["g"], a["beta"], eager_pool)
    o_compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(
        a["q"], a["k"], a["v"], a["g"], a["beta"], compiled_pool)
    assert torch.equal(o_eager, o_compiled)
    assert torch.equal(eager_pool, compiled_pool)
    assert not torch.equal(eager_pool, pool), "the pool was not updated"


def test_compile_dynamic_shapes():
    """One compiled function serves several sequence lengths and varlen tables."""
    torch._dynamo.reset()
    fn = torch.compile(flashdelta.chunk_gated_delta_rule, fullgraph=True, dynamic=True,
                       backend="aot_eager")
    for seqlens in ([5, 7], [3, 1, 11]):
        a = make_inputs("gated_deltanet", seqlens=seqlens)
        o, final = fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                      output_final_state=True, cu_seqlens=a["cu_seqlens"])
        o_ref, final_ref = flashdelta.chunk_gated_delta_rule(
            a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
            output_final_state=True, cu_seqlens=a["cu_seqlens"])
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
