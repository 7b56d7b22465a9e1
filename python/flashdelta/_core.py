"""Framework-neutral calls into the C++ library (flashdelta._C).

Everything here works on any DLPack array: the caller allocates the outputs (torch.empty in
the torch custom ops, numpy.empty for NumPy and other arrays) and the library writes them in
place. This module resolves options, shapes and output dtypes; it adds no math.
"""

from . import _C

MECHANISMS = ("linear", "simple_gla", "gla", "deltanet", "gated_deltanet", "kda")
SCHEDULES = ("reference", "recurrent", "chunk")
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")

# Gate kind and delta rule of each mechanism (the library's MechanismTraits).
GATE_KIND = {"linear": None, "simple_gla": "scalar", "gla": "vector",
             "deltanet": None, "gated_deltanet": "scalar", "kda": "vector"}
HAS_DELTA = {"linear": False, "simple_gla": False, "gla": False,
             "deltanet": True, "gated_deltanet": True, "kda": True}

# The names of the tensors a forward call reads, in the order the custom ops take them.
FORWARD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")
# Gradients the backward can produce, named after their input.
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
# Tokens between consecutive per-chunk states (fla's chunk size; kChunkStateTokens in C++).
CHUNK_STATE_TOKENS = 64


def make_options(mechanism, scale=None, qk_l2norm=False, beta_sigmoid=False,
                 allow_neg_eigval=False, gate_in_kernel=False, lower_bound=None,
                 state_v_first=False, chunk_size=16, num_threads=0):
    """A _C.Options; the library validates every field when it runs."""
    o = _C.Options()
    o.mechanism = mechanism
    o.scale = None if scale is None else float(scale)
    o.qk_l2norm = bool(qk_l2norm)
    o.beta_sigmoid = bool(beta_sigmoid)
    o.allow_neg_eigval = bool(allow_neg_eigval)
    o.gate_in_kernel = bool(gate_in_kernel)
    o.lower_bound = None if lower_bound is None else float(lower_bound)
    o.state_layout = "v_first" if state_v_first else "k_first"
    o.chunk_size = int(chunk_size)
    o.num_threads = int(num_threads)
    return o


def dtype_name(x):
    """'float32', 'bfloat16', ... for a torch tensor or a NumPy-like array."""
    name = str(x.dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def output_dtypes(q_dtype, state_dtype, schedule):
    """Dtype names of (o, final_state).

    o follows q (as in fla); the state is float32. The reference schedule returns both in
    float64 (it is the fp64 truth), and float64 inputs keep float64 throughout.
    """
    wide = schedule == "reference" or q_dtype == "float64"
    o = "float64" if wide else q_dtype
    state = "float64" if wide or state_dtype == "float64" else "float32"
    return o, state


def forward_shapes(q_shape, v_shape, cu_seqlens_shape, state_v_first):
    """Shapes of o [B, T, HV, V] and the state [N, HV, K, V] (or [N, HV, V, K])."""
    B, T, _, K = q_shape
    HV, V = v_shape[2], v_shape[3]
    N = cu_seqlens_shape[0] - 1 if cu_seqlens_shape is not None else B
    state = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    return (B, T, HV, V), state


def kept_chunk_count(B, T, N, varlen):
    """Entries of the per-chunk states a training forward keeps for its backward, from the
    shapes alone (so torch's fake tensors agree): B ceil(T / 64), or with cu_seqlens the bound
    T // 64 + min(N, T) that the library accepts for device-resident offsets (entries past
    the real count are neither written nor read)."""
    if not varlen:
        return B * -(-T // CHUNK_STATE_TOKENS)
    return T // CHUNK_STATE_TOKENS + min(N, T)


def chunks_per_row(T, offsets):
    """NT of the per-chunk states [B, NT, HV, K, V]: ceil(T / 64) for batch rows of T tokens,
    or with offsets (cu_seqlens as host ints) the 64-token chunks of all sequences."""
    if offsets is None:
        return -(-T // CHUNK_STATE_TOKENS)
    return sum(max(0, -(-(end - start) // CHUNK_STATE_TOKENS))
               for start, end in zip(offsets, offsets[1:]))


def chunk_states_shape(q_shape, v_shape, num_chunks, state_v_first):
    """fla's h: [B, NT, HV, K, V] ([B, NT, HV, V, K] V-first), B = 1 with cu_seqlens."""
    B, K, HV, V = q_shape[0], q_shape[3], v_shape[2], v_shape[3]
    return (B, num_chunks, HV, V, K) if state_v_first else (B, num_chunks, HV, K, V)


def run_forward(inputs, o, final_state, options, schedule, chunk_states=None):
    """Runs flashdelta::forward. inputs: dict name -> array or None (FORWARD_INPUTS);
    chunk_states: the library's [B * NT, HV, K, V] view of fla's h, or None."""
    _C.forward(*(inputs[n] for n in FORWARD_INPUTS), o, final_state, chunk_states, options,
               schedule)


def run_backward(inputs, d_o, d_final_state, grads, options, schedule, chunk_states=None):
    """Runs flashdelta::backward. grads: dict input name -> gradient array or None;
    chunk_states: the forward's kept per-chunk states [C, HV, K, V] (read instead of
    recomputed), or None."""
    _C.backward(*(inputs[n] for n in FORWARD_INPUTS), d_o, d_final_state,
                *(grads.get(n) for n in GRAD_INPUTS), options, schedule,
                chunk_states=chunk_states)


def run_decode(inputs, state_pool, state_indices, num_accepted_tokens, o, options, schedule):
    """Runs flashdelta::decode; state_pool is updated in place."""
    _C.decode(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
              inputs["cu_seqlens"], inputs["A_log"], inputs["dt_bias"], state_pool,
              state_indices, num_accepted_tokens, o, options, schedule)
