"""FlashDelta: the delta-rule family of linear attention as one recurrence.

Per sequence and value head, with state S (K x V), for each token t:

    S <- Diag(exp(g_t)) S                      forget (no gate | scalar | per key channel)
    delta rule:  S <- S + beta_t k_t (v_t - S^T k_t)^T      linear:  S <- S + k_t v_t^T
    o_t = S^T (scale q_t)

The fla-named functions (chunk_kda, fused_recurrent_gated_delta_rule, ...) are drop-in
replacements for flash-linear-attention's `fla.ops`: same names, parameters, defaults and
return values. `forward`, `decode` and `backward` are the generic entry points;
`flashdelta.reference` is the fp64 reference. torch is optional: NumPy arrays work for
forward calls on the CPU; torch tensors get autograd and torch.compile support through
torch.library custom ops (flashdelta::forward, flashdelta::backward, flashdelta::decode, and
the inference-only flashdelta::forward_chunk_states behind return_intermediate_states).
Gradients come from the fp64 reference backward on the CPU and from the chunkwise CUDA
backward on CUDA tensors (tf32 tensor-core products, float32 sums, deterministic).
"""

try:
    # torch first: its shared libraries (libgomp among them) must load before the extension's,
    # or the extension's system OpenMP runtime shadows torch's and torch's import can abort.
    import torch  # noqa: F401
except ImportError:  # torch is optional
    pass

from . import _C
from ._api import backward, decode, forward
from .ops import (chunk_delta_rule, chunk_gated_delta_rule, chunk_gdn, chunk_gla, chunk_kda,
                  chunk_linear_attn, chunk_simple_gla, fused_recurrent_delta_rule,
                  fused_recurrent_gated_delta_rule, fused_recurrent_gdn, fused_recurrent_gla,
                  fused_recurrent_kda, fused_recurrent_linear_attn)
from . import ops, reference

__version__ = _C.version()
cpu_simd_target = _C.cpu_simd_target

__all__ = ["forward", "decode", "backward", "reference", "ops", "cpu_simd_target",
           "__version__"] + list(ops.FLA_FUNCTIONS) + ["chunk_gdn", "fused_recurrent_gdn"]
