"""The fp64 reference: the scalar recurrence in double precision, token by token, exactly as
documented. It is the truth every fast path is tested against.

Every function here returns float64 outputs and states whatever the input dtypes:
- forward / decode: flashdelta.forward / flashdelta.decode on the reference schedule;
- the fla-named functions (chunk_kda, fused_recurrent_gla, ...) with the same signatures
  as flashdelta's, run on the reference schedule.
Gradients (torch autograd or flashdelta.backward) of these CPU calls come from the reference
backward.
"""

import functools

from . import _api, ops

__all__ = ["forward", "decode"] + list(ops.FLA_FUNCTIONS)


def forward(q, k, v, g=None, beta=None, **kwargs):
    """flashdelta.forward on the reference schedule (float64 o and final state)."""
    return _api.forward(q, k, v, g, beta, schedule="reference", **kwargs)


def decode(q, k, v, g=None, beta=None, **kwargs):
    """flashdelta.decode on the reference schedule (float64 o; the pool keeps its dtype)."""
    return _api.decode(q, k, v, g, beta, schedule="reference", **kwargs)


def _on_reference(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return fn(*args, schedule="reference", **kwargs)

    run.__doc__ = f"fp64 reference of flashdelta.{fn.__name__} (float64 results).\n\n{fn.__doc__}"
    return run


for _name in ops.FLA_FUNCTIONS:
    globals()[_name] = _on_reference(getattr(ops, _name))
del _name
