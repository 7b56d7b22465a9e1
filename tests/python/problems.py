"""Random problems (fixed seeds, never zeros) and per-dtype tolerances, shared by the tests."""

import numpy as np

try:
    import torch
except ImportError:  # the NumPy tests run without torch
    torch = None

# Error bound (naive.error: max abs error over max(max |expected|, 1)) per input dtype, for
# results compared with the fp64 recurrence computed on the same (rounded) inputs. Low
# precision outputs are rounded to their dtype: bf16 has 8 significant bits, fp16 11.
TOLERANCE = {} if torch is None else {torch.float64: 1e-10, torch.float32: 2e-4,
                                       torch.float16: 4e-3, torch.bfloat16: 2e-2}
# The same for NumPy dtypes.
NUMPY_TOLERANCE = {np.dtype("float64"): 1e-10, np.dtype("float32"): 2e-4,
                   np.dtype("float16"): 4e-3}

GATE = {"linear": None, "simple_gla": "scalar", "gla": "vector",
        "deltanet": None, "gated_deltanet": "scalar", "kda": "vector"}
DELTA = {"linear": False, "simple_gla": False, "gla": False,
         "deltanet": True, "gated_deltanet": True, "kda": True}


def dtype_name(dtype):
    """'float32', 'bfloat16', ... for a torch dtype, a NumPy dtype or a name."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    return text if text == "bfloat16" else np.dtype(dtype).name


def make_inputs(mechanism="kda", *, B=2, T=19, H=2, HV=4, K=16, V=12, dtype="float32",
                seqlens=None, initial_state=True, state_v_first=False, qk_l2norm=False,
                beta_sigmoid=False, allow_neg_eigval=False, gate_in_kernel=False,
                lower_bound=None, with_A_log=True, with_dt_bias=True, gate_min=-1.0, seed=0,
                numpy=False):
    """A random problem as fla-named arrays: q, k, v, g, beta, initial_state, cu_seqlens,
    A_log, dt_bias (absent ones are None). torch tensors unless numpy=True. dtype: a torch or
    NumPy dtype or its name. Options that do not change the inputs (allow_neg_eigval) are
    accepted, so one dict configures a test."""
    name = dtype_name(dtype)
    dtype = np.dtype(name) if numpy else getattr(torch, name)
    rng = np.random.default_rng(seed)
    if seqlens is not None:
        B, T = 1, int(sum(seqlens))
    N = B if seqlens is None else len(seqlens)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if not qk_l2norm:  # unit keys keep the delta-rule transition contractive
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    a = dict(q=q, k=k, v=v, g=None, beta=None, initial_state=None, cu_seqlens=None,
             A_log=None, dt_bias=None)
    gate = GATE[mechanism]
    if gate is not None:
        shape = (B, T, HV, K) if gate == "vector" else (B, T, HV)
        if gate_in_kernel:
            a["g"] = rng.standard_normal(shape)
            if with_A_log:
                a["A_log"] = rng.uniform(-1.0, 0.5, HV)
            if with_dt_bias:
                a["dt_bias"] = rng.standard_normal(HV * K if gate == "vector" else HV)
        else:
            a["g"] = rng.uniform(gate_min, 0.0, shape)
    if DELTA[mechanism]:
        shape = (B, T, HV)
        a["beta"] = rng.standard_normal(shape) if beta_sigmoid else rng.uniform(0, 1, shape)
    if initial_state:
        a["initial_state"] = rng.standard_normal((N, HV, V, K) if state_v_first else
                                                 (N, HV, K, V))
    if seqlens is not None:
        a["cu_seqlens"] = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64)

    wide = name == "float64"

    def convert(name, x):
        if x is None:
            return None
        if name in ("initial_state", "A_log", "dt_bias"):
            # The state and layer parameters are float32 (float64 with float64 inputs).
            x = x.astype(np.float64 if wide else np.float32)
        elif name != "cu_seqlens":
            x = x.astype(dtype) if numpy else torch.from_numpy(x).to(dtype)
        return x if numpy or not isinstance(x, np.ndarray) else torch.from_numpy(x)

    return {name: convert(name, x) for name, x in a.items()}


def assert_close(actual, expected, tol, what):
    import naive
    err = naive.error(actual, expected)
    assert err <= tol, f"{what}: error {err:.3e} exceeds tolerance {tol:.1e}"
