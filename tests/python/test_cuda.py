"""CUDA tensors: the recurrent schedule (fused_recurrent_*, flashdelta.forward) and the serving
entry point (flashdelta.decode, fused_recurrent_*(ssm_state_indices=...)) on the GPU give the
results of the same call on the CPU; index tensors stay on the GPU; the work runs on the
current stream and can be captured in a CUDA graph (no host synchronisation); decode takes no
gradient. Gradients of CUDA tensors: test_cuda_backward.py. Skipped without a GPU."""

import pytest

import naive
from problems import make_inputs

torch = pytest.importorskip("torch")
import flashdelta  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# GPU vs CPU, both accumulating in float32 (naive.error: max abs error over max(|CPU|, 1)).
# Low-precision results are rounded to their dtype on both sides: one unit in the last place
# apart at most (bf16 has 8 significant bits, fp16 11).
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}
MECHANISMS = ["linear", "simple_gla", "gla", "deltanet", "gated_deltanet", "kda"]


def cuda(a):
    return {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in a.items()}


def assert_same(gpu, cpu, tol, what):
    assert gpu.device.type == "cuda", f"{what}: result on {gpu.device}, expected cuda"
    assert gpu.dtype == cpu.dtype, f"{what}: dtype {gpu.dtype} != CPU's {cpu.dtype}"
    err = naive.error(gpu, cpu)
    assert err <= tol, f"{what}: GPU vs CPU error {err:.3e} exceeds {tol:.1e}"


def delta(mechanism):
    return mechanism in ("deltanet", "gated_deltanet", "kda")


def gated(mechanism):
    return mechanism in ("simple_gla", "gla", "gated_deltanet", "kda")


# (name, make_inputs arguments, forward options): options every mechanism takes, then the
# fused transforms where they apply.
FORWARD_CASES = [
    ("plain", {}, {}),
    ("no_initial_state", dict(initial_state=False), {}),
    ("varlen", dict(seqlens=[7, 0, 1, 12]), {}),
    ("state_v_first", dict(state_v_first=True), dict(state_v_first=True)),
    ("gva_odd_dims", dict(H=2, HV=6, K=5, V=7), {}),
    ("k128_v128", dict(B=2, T=5, H=2, HV=4, K=128, V=128), {}),
    ("k256_v64", dict(B=1, T=3, H=1, HV=2, K=256, V=64), {}),
    ("bf16", dict(dtype="bfloat16"), {}),
    ("fp16", dict(dtype="float16"), {}),
    ("qk_l2norm", dict(qk_l2norm=True), dict(qk_l2norm=True)),
]
FUSED_DELTA = dict(qk_l2norm=True, beta_sigmoid=True)
FUSED_GATE = dict(gate_in_kernel=True)


def forward_cases():
    for mechanism in MECHANISMS:
        for name, cfg, opts in FORWARD_CASES:
            yield pytest.param(mechanism, cfg, opts, id=f"{mechanism}-{name}")
        if delta(mechanism):
            yield pytest.param(mechanism, dict(FUSED_DELTA), dict(FUSED_DELTA),
                               id=f"{mechanism}-beta_sigmoid")
            yield pytest.param(mechanism, dict(FUSED_DELTA, allow_neg_eigval=True),
                               dict(FUSED_DELTA, allow_neg_eigval=True),
                               id=f"{mechanism}-neg_eigval")
        if mechanism in ("gated_deltanet", "kda"):
            for name, extra in (("gate_softplus", {}), ("gate_lower_bound",
                                                         dict(lower_bound=-5.0))):
                cfg = dict(FUSED_DELTA, gate_in_kernel=True, dtype="bfloat16", **extra)
                yield pytest.param(mechanism, cfg, dict(cfg), id=f"{mechanism}-{name}-bf16")


def forward_call(mechanism, a, opts, **extra):
    opts = {n: x for n, x in opts.items() if n != "dtype"}
    if opts.get("gate_in_kernel"):
        opts.update(A_log=a["A_log"], dt_bias=a["dt_bias"])
    return flashdelta.forward(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism=mechanism,
                              initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
                              output_final_state=True, schedule="recurrent", **opts, **extra)


@pytest.mark.parametrize("mechanism,cfg,opts", list(forward_cases()))
def test_forward_recurrent_matches_cpu(mechanism, cfg, opts):
    a = make_inputs(mechanism, **cfg)
    o_cpu, s_cpu = forward_call(mechanism, a, opts)
    o, s = forward_call(mechanism, cuda(a), opts)
    tol = TOLERANCE[cfg.get("dtype", "float32")]
    assert_same(o, o_cpu, tol, "o")
    assert_same(s, s_cpu, TOLERANCE["float32"] if tol < 1e-3 else 1e-3, "final_state")


def fla_calls():
    """(id, mechanism, make_inputs arguments, call(a) -> (o, final_state))."""
    kda_fused = dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True, dtype="bfloat16")

    def kda(a):
        return flashdelta.fused_recurrent_kda(
            a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"], dt_bias=a["dt_bias"],
            initial_state=a["initial_state"], output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True)

    def kda_varlen(a):
        return flashdelta.fused_recurrent_kda(
            a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
            output_final_state=True, cu_seqlens=a["cu_seqlens"])

    def gdn(a):
        return flashdelta.fused_recurrent_gated_delta_rule(
            a["q"], a["k"], a["v"], a["g"], beta=a["beta"], initial_state=a["initial_state"],
            output_final_state=True, use_qk_l2norm_in_kernel=True)

    def gdn_gk(a):  # the per-key gate form of fused_recurrent_gated_delta_rule is KDA
        return flashdelta.fused_recurrent_gated_delta_rule(
            a["q"], a["k"], a["v"], gk=a["g"], beta=a["beta"],
            initial_state=a["initial_state"], output_final_state=True)

    def gdn_gate_in_kernel(a):
        return flashdelta.fused_recurrent_gated_delta_rule(
            a["q"], a["k"], a["v"], a["g"], beta=a["beta"], initial_state=a["initial_state"],
            output_final_state=True, use_gate_in_kernel=True, A_log=a["A_log"],
            dt_bias=a["dt_bias"], use_beta_sigmoid_in_kernel=True)

    def deltanet(a):
        return flashdelta.fused_recurrent_delta_rule(
            a["q"], a["k"], a["v"], beta=a["beta"], initial_state=a["initial_state"],
            output_final_state=True)

    def gla(a):
        return flashdelta.fused_recurrent_gla(
            a["q"], a["k"], a["v"], gk=a["g"], initial_state=a["initial_state"],
            output_final_state=True)

    def linear(a):
        return flashdelta.fused_recurrent_linear_attn(
            a["q"], a["k"], a["v"], initial_state=a["initial_state"], output_final_state=True,
            normalize=False)

    return [
        ("fused_recurrent_kda", "kda", kda_fused, kda),
        ("fused_recurrent_kda-varlen", "kda", dict(seqlens=[3, 0, 9]), kda_varlen),
        ("fused_recurrent_gated_delta_rule", "gated_deltanet", dict(qk_l2norm=True), gdn),
        ("fused_recurrent_gated_delta_rule-gk", "kda", {}, gdn_gk),
        ("fused_recurrent_gated_delta_rule-gate_in_kernel", "gated_deltanet",
         dict(gate_in_kernel=True, beta_sigmoid=True, dtype="bfloat16"), gdn_gate_in_kernel),
        ("fused_recurrent_delta_rule", "deltanet", {}, deltanet),
        ("fused_recurrent_gla", "gla", {}, gla),
        ("fused_recurrent_linear_attn", "linear", {}, linear),
    ]


@pytest.mark.parametrize("mechanism,cfg,call", [c[1:] for c in fla_calls()],
                         ids=[c[0] for c in fla_calls()])
def test_fla_functions_on_cuda_match_cpu(mechanism, cfg, call):
    a = make_inputs(mechanism, **cfg)
    o_cpu, s_cpu = call(a)
    o, s = call(cuda(a))
    assert_same(o, o_cpu, TOLERANCE[cfg.get("dtype", "float32")], "o")
    assert_same(s, s_cpu, 1e-3, "final_state")


POISON = 1e30


def poisoned_at_start(pool):
    """Elements holding the poison value, in the pool's dtype (1e30 rounds in bfloat16)."""
    return pool == torch.tensor(POISON, dtype=pool.dtype)


def pool_and_indices(N, T, HV, K, V, *, per_token, index_dtype, padding, v_first=False,
                     pool_dtype=torch.float32, seed=0):
    """A pool with more slots than the rows use, the unused ones poisoned (1e30), and slot
    indices: [N] or [N, T] per-token slots, with padding rows (-1) when asked."""
    gen = torch.Generator().manual_seed(seed)
    slots_needed = N * (T if per_token else 1)
    P = slots_needed + 5
    shape = (P, HV, V, K) if v_first else (P, HV, K, V)
    pool = torch.full(shape, POISON, dtype=torch.float32)
    perm = torch.randperm(P, generator=gen)
    used = perm[:slots_needed]
    pool[used] = torch.randn((slots_needed,) + shape[1:], generator=gen)
    indices = used.view(N, T) if per_token else used.clone()
    if padding:
        indices = indices.clone()
        indices[1] = -1  # a padding row
    accepted = None
    if per_token:
        # Row n resumes from the state after its accepted prefix: slot indices[n, a_n - 1],
        # which must hold a real state (the poisoned slots are never read).
        accepted = torch.randint(1, T + 1, (N,), generator=gen)
        for n in range(N):
            for t in range(T):
                if indices[n, t] >= 0 and t != accepted[n] - 1:
                    pool[indices[n, t]] = POISON  # written before it is read, if at all
        accepted = accepted.to(index_dtype)
    return pool.to(pool_dtype), indices.to(index_dtype), accepted


DECODE_CASES = [
    # id, mechanism, N, T, per_token, index dtype, padding, v_first, dtype, pool dtype, extra
    ("kda-T1-int32-padding", "kda", 6, 1, False, torch.int32, True, False, "float32",
     torch.float32, {}),
    ("kda-T1-int64-bf16", "kda", 6, 1, False, torch.int64, True, False, "bfloat16",
     torch.float32, dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("kda-T2-final-slot", "kda", 4, 2, False, torch.int64, False, False, "bfloat16",
     torch.float32, {}),
    ("kda-T4-spec-int32", "kda", 5, 4, True, torch.int32, True, False, "bfloat16",
     torch.float32, dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("kda-T4-spec-int64-vfirst", "kda", 5, 4, True, torch.int64, True, True, "bfloat16",
     torch.float32, dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("kda-T1-bf16-pool", "kda", 6, 1, False, torch.int32, True, False, "bfloat16",
     torch.bfloat16, dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("gdn-T1-int64", "gated_deltanet", 6, 1, False, torch.int64, True, False, "bfloat16",
     torch.float32, dict(qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("gdn-T2-spec-vfirst", "gated_deltanet", 3, 2, True, torch.int32, False, True, "float32",
     torch.float32, {}),
    ("gla-T1", "gla", 4, 1, False, torch.int32, True, False, "float32", torch.float32, {}),
    ("deltanet-T3-spec", "deltanet", 3, 3, True, torch.int64, True, False, "float16",
     torch.float32, {}),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
@pytest.mark.parametrize("dims", [(2, 4, 16, 12), (4, 8, 128, 128)], ids=["small", "k128"])
def test_decode_matches_cpu(case, dims):
    _, mechanism, N, T, per_token, index_dtype, padding, v_first, dtype, pool_dtype, opts = case
    H, HV, K, V = dims
    a = make_inputs(mechanism, B=N, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype,
                    initial_state=False, **opts)
    pool, indices, accepted = pool_and_indices(N, T, HV, K, V, per_token=per_token,
                                               index_dtype=index_dtype, padding=padding,
                                               v_first=v_first, pool_dtype=pool_dtype)
    kw = dict(opts, state_v_first=v_first)
    if opts.get("gate_in_kernel"):
        kw.update(A_log=a["A_log"], dt_bias=a["dt_bias"])

    def call(a, pool, indices, accepted, **kw):
        return flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism=mechanism,
                                 state_pool=pool, state_indices=indices,
                                 num_accepted_tokens=accepted, **kw)

    pool_cpu = pool.clone()
    o_cpu = call(a, pool_cpu, indices, accepted, **kw)
    g = cuda(a)
    kw_gpu = {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    pool_gpu = pool.cuda()
    idx_gpu = indices.cuda()
    acc_gpu = None if accepted is None else accepted.cuda()
    o = call(g, pool_gpu, idx_gpu, acc_gpu, **kw_gpu)

    assert_same(o, o_cpu, TOLERANCE[dtype], "o")
    # Slots poisoned at the start that the CPU left alone must be bit-for-bit untouched on the
    # GPU too; every other element agrees with the CPU's result.
    poisoned = poisoned_at_start(pool) & (pool_cpu == pool)
    assert bool(poisoned.any()), "the test poisons unused slots"
    assert torch.equal(pool_gpu.cpu()[poisoned], pool[poisoned]), "a poisoned slot was written"
    state_tol = 1e-4 if pool_dtype == torch.float32 else 1.6e-2
    assert_same(pool_gpu.float()[~poisoned.cuda()], pool_cpu.float()[~poisoned], state_tol,
                "pool")
    if padding:
        assert torch.all(o[1] == 0), "a padding row outputs zeros"


def test_fla_serving_form_on_cuda():
    """vLLM-style: fused_recurrent_kda(initial_state=pool, ssm_state_indices=...,
    num_accepted_tokens=..., inplace_final_state=True): the pool on the GPU is updated in place
    and returned, as on the CPU."""
    N, T, H, HV, K, V = 4, 3, 2, 4, 64, 64
    a = make_inputs("kda", B=N, T=T, H=H, HV=HV, K=K, V=V, dtype="bfloat16",
                    initial_state=False, qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)
    pool, indices, accepted = pool_and_indices(N, T, HV, K, V, per_token=True,
                                               index_dtype=torch.int32, padding=True)

    def call(a, pool, indices, accepted):
        return flashdelta.fused_recurrent_kda(
            a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"], dt_bias=a["dt_bias"],
            initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, ssm_state_indices=indices,
            num_accepted_tokens=accepted, inplace_final_state=True)

    pool_cpu = pool.clone()
    o_cpu, _ = call(a, pool_cpu, indices, accepted)
    pool_gpu = pool.cuda()
    o, returned = call(cuda(a), pool_gpu, indices.cuda(), accepted.cuda())
    assert returned is pool_gpu
    assert_same(o, o_cpu, TOLERANCE["bfloat16"], "o")
    assert_same(pool_gpu, pool_cpu, 1e-4, "pool")


def serving_step_inputs(N=8, HV=4, K=32, V=32, device="cuda"):
    a = make_inputs("kda", B=N, T=1, H=HV, HV=HV, K=K, V=V, dtype="bfloat16",
                    initial_state=False, qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True)
    a = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    pool = torch.randn(N + 3, HV, K, V, device=device)
    indices = torch.randperm(N + 3, device=device)[:N].to(torch.int32)
    indices[2] = -1
    return a, pool, indices


def serving_step(a, pool, indices):
    return flashdelta.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], mechanism="kda",
                             state_pool=pool, state_indices=indices, qk_l2norm=True,
                             beta_sigmoid=True, gate_in_kernel=True, A_log=a["A_log"],
                             dt_bias=a["dt_bias"])


def test_decode_runs_on_the_current_stream():
    """The inputs are written on a side stream behind a long matrix product, then decode runs
    on that stream: work queued on any other stream would read them before they are written."""
    a, pool, indices = serving_step_inputs()
    expected_pool = pool.clone()
    expected = serving_step(a, expected_pool, indices)
    late = {n: (torch.zeros_like(x) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    late_pool = torch.zeros_like(pool)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            big = big @ big
            big /= big.norm()
        for n, x in a.items():
            if isinstance(x, torch.Tensor):
                late[n].copy_(x)
        late_pool.copy_(pool)
        o = serving_step(late, late_pool, indices)
    side.synchronize()
    assert torch.equal(o, expected)
    assert torch.equal(late_pool, expected_pool)


def test_decode_is_cuda_graph_capturable():
    """Captured in a CUDA graph (which fails on any host synchronisation or work on another
    stream), replays give the eager results for new inputs copied into the static ones."""
    a, pool, indices = serving_step_inputs()
    static = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    static_pool = pool.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        serving_step(static, static_pool.clone(), indices)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o = serving_step(static, static_pool, indices)
    for step in range(3):
        fresh, _, _ = serving_step_inputs()
        fresh = {n: (x * (1 + 0.1 * step) if isinstance(x, torch.Tensor) and n in
                     ("q", "k", "v", "g", "beta") else x) for n, x in fresh.items()}
        eager_pool = static_pool.clone()
        expected = serving_step(fresh, eager_pool, indices)
        for n in ("q", "k", "v", "g", "beta"):
            static[n].copy_(fresh[n])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_o, expected), f"replay {step}: o differs from eager"
        assert torch.equal(static_pool, eager_pool), f"replay {step}: pool differs"


def test_forward_is_cuda_graph_capturable():
    a = cuda(make_inputs("gated_deltanet", seqlens=[3, 5, 1]))
    kw = dict(initial_state=a["initial_state"], output_final_state=True,
              cu_seqlens=a["cu_seqlens"])
    expected = flashdelta.fused_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["g"],
                                                           beta=a["beta"], **kw)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashdelta.fused_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["g"],
                                                    beta=a["beta"], **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, final = flashdelta.fused_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["g"],
                                                               beta=a["beta"], **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, expected[0]) and torch.equal(final, expected[1])


def test_compiled_serving_step_on_cuda():
    torch._dynamo.reset()
    a, pool, indices = serving_step_inputs()
    eager_pool, compiled_pool = pool.clone(), pool.clone()
    o_eager = serving_step(a, eager_pool, indices)
    step = torch.compile(serving_step, fullgraph=True, backend="aot_eager")
    o_compiled = step(a, compiled_pool, indices)
    assert torch.equal(o_eager, o_compiled)
    assert torch.equal(eager_pool, compiled_pool)


def test_cuda_decode_takes_no_gradient():
    """decode is a serving step (the pool updated in place, no autograd formula): an input
    that requires grad is read as a value, and o carries no gradient, as on the CPU."""
    a, pool, indices = serving_step_inputs()
    q = a["q"].clone().requires_grad_()
    o = flashdelta.decode(q, a["k"], a["v"], a["g"], a["beta"], mechanism="kda",
                          state_pool=pool, state_indices=indices)
    assert o.device.type == "cuda" and not o.requires_grad


def test_index_tensors_must_be_on_the_gpu():
    a, pool, indices = serving_step_inputs()
    with pytest.raises(ValueError, match="'state_indices'"):
        serving_step(a, pool, indices.cpu())
    b = cuda(make_inputs("kda", seqlens=[2, 3]))
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        flashdelta.fused_recurrent_kda(b["q"], b["k"], b["v"], b["g"], b["beta"],
                                       cu_seqlens=b["cu_seqlens"].cpu())


def test_chunk_schedule_on_cuda_matches_cpu():
    """chunk_* on CUDA tensors runs the CUDA chunk schedule (bfloat16 tensor-core operands,
    float32 accumulation: agreement to bfloat16 precision)."""
    a = make_inputs("kda")
    call = lambda a: flashdelta.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"],  # noqa
                                          initial_state=a["initial_state"],
                                          output_final_state=True)
    o, s = call(cuda(a))
    o_cpu, s_cpu = call(a)
    assert_same(o, o_cpu, 1e-2, "o")
    assert_same(s, s_cpu, 1e-2, "final_state")


def test_chunk_forward_in_pieces_matches_one_piece_and_is_cuda_graph_capturable(monkeypatch):
    """FLASHDELTA_CHUNK_PIECES=3: each piece's state kernel on the library's second stream,
    forked from and joined to torch's current stream by events: the same bits as one piece,
    eagerly on a torch side stream and replayed from a CUDA graph (whose capture fails on work
    left unjoined on another stream)."""
    a = cuda(make_inputs("kda", B=1, T=300, H=2, HV=4, K=64, V=64, dtype="bfloat16"))
    call = lambda: flashdelta.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"],  # noqa
                                        initial_state=a["initial_state"],
                                        output_final_state=True)
    monkeypatch.setenv("FLASHDELTA_CHUNK_PIECES", "off")
    expected = call()
    monkeypatch.setenv("FLASHDELTA_CHUNK_PIECES", "3")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, final = call()
    graph.replay()
    torch.cuda.synchronize()
    for what, got in (("eager", eager), ("graph", (o, final))):
        assert torch.equal(got[0], expected[0]), f"{what}: o differs from one piece"
        assert torch.equal(got[1], expected[1]), f"{what}: final state differs from one piece"


def test_chunk_states_on_cuda_match_cpu():
    """return_intermediate_states: the CUDA state kernel writes h from its registers
    (bfloat16 products: agreement to bfloat16 precision); varlen with device-resident offsets
    (counted on the host by a copy); the recurrent schedule refuses it, naming the argument."""
    for cfg in (dict(B=2, T=150, K=128, V=128, dtype="bfloat16"),
                dict(seqlens=[0, 1, 64, 65, 130, 7], state_v_first=True)):
        a = make_inputs("kda", **cfg)
        v_first = cfg.get("state_v_first", False)
        with torch.inference_mode():
            results = [flashdelta.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                            initial_state=x["initial_state"],
                                            cu_seqlens=x["cu_seqlens"], output_final_state=True,
                                            state_v_first=v_first,
                                            return_intermediate_states=True)
                       for x in (cuda(a), a)]
        for what, gpu, cpu in zip(("o", "final_state", "h"), *results):
            assert_same(gpu, cpu, 2e-2, what)
    b = cuda(a)
    with pytest.raises(NotImplementedError, match="'chunk_states'"):
        flashdelta.chunk_kda(b["q"], b["k"], b["v"], b["g"], b["beta"],
                             cu_seqlens=b["cu_seqlens"], schedule="recurrent",
                             return_intermediate_states=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu_while_the_first_is_current():
    a, pool, indices = serving_step_inputs(device="cuda:0")
    expected_pool = pool.clone()
    expected = serving_step(a, expected_pool, indices)
    b = {n: (x.to("cuda:1") if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    pool1 = pool.to("cuda:1")
    with torch.cuda.device(0):
        o = serving_step(b, pool1, indices.to("cuda:1"))
    assert o.device == torch.device("cuda:1")
    assert torch.equal(o.cpu(), expected.cpu()) and torch.equal(pool1.cpu(), expected_pool.cpu())
    with pytest.raises(ValueError, match="cuda:1"):
        serving_step(a, pool, indices.to("cuda:1"))
