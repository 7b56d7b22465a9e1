"""fla-compatible functions, one module per family as in fla.ops:
`from flashdelta.ops.kda import chunk_kda` replaces `from fla.ops.kda import chunk_kda`."""

from .delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from .gated_delta_rule import (chunk_gated_delta_rule, chunk_gdn, fused_recurrent_gated_delta_rule,
                               fused_recurrent_gdn)
from .gla import chunk_gla, fused_recurrent_gla
from .kda import chunk_kda, fused_recurrent_kda
from .linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
from .simple_gla import chunk_simple_gla

FLA_FUNCTIONS = ("chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule",
                 "fused_recurrent_gated_delta_rule", "chunk_delta_rule",
                 "fused_recurrent_delta_rule", "chunk_gla", "fused_recurrent_gla",
                 "chunk_simple_gla", "chunk_linear_attn", "fused_recurrent_linear_attn")

__all__ = list(FLA_FUNCTIONS) + ["chunk_gdn", "fused_recurrent_gdn"]
