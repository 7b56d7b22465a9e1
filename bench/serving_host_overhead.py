"""Host time of the Python layers of the N=1 serving call, on the CPU (no GPU needed).

Times flashdelta.fused_recurrent_kda's serving form as bench/device/bench_decode.py's
`serving_step` binds it (functools.partial; KDA, H = HV = 32, K = V = 128, bf16 inputs, a
float32 pool of 64 slots) with the library call `_C.decode` replaced by a no-op, so only the
Python and torch layers remain; then each layer below it entered directly with the same
arguments, and the torch calls they make. CPU tensors take the non-CUDA branch of the stream
lookup; its CUDA branch adds q.get_device(), torch._C._cuda_getDevice() and
torch._C._cuda_getCurrentRawStream(index), three small C calls.

    taskset -c 1 python bench/serving_host_overhead.py [--calls 20000] [--repeats 9]
                                                        [--v-first 0|1]

Prints microseconds per call: rows are timed in turn, `repeats` rounds of `calls` calls, and
each row keeps its best round (a busy machine shifts rounds, not the best one).
"""

import argparse
import functools
import time

import torch

import flashdelta
from flashdelta import _api, _torch_ops
from flashdelta.ops import _common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--v-first", type=int, default=1)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    HV, K, V, P = 32, 128, 128, 64
    bf = torch.bfloat16
    q, k, v, g = (torch.randn(1, 1, HV, K, dtype=bf) for _ in range(4))
    beta = torch.randn(1, 1, HV, dtype=bf)
    pool = torch.zeros(P, HV, K, V, dtype=torch.float32)
    idx = torch.tensor([3], dtype=torch.int32)
    A_log = torch.randn(HV)
    dt_bias = torch.randn(HV * K)
    scale = K ** -0.5
    v_first = bool(args.v_first)
    kw = dict(initial_state=pool, ssm_state_indices=idx, inplace_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
              dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=v_first,
              scale=scale)
    kda_step = functools.partial(flashdelta.fused_recurrent_kda, q, k, v, g, beta, **kw)
    g_gdn, dt_gdn = torch.randn(1, 1, HV, dtype=bf), torch.randn(HV)
    gdn_step = functools.partial(flashdelta.fused_recurrent_gated_delta_rule, q, k, v, g_gdn,
                                 beta=beta, **dict(kw, dt_bias=dt_gdn))
    kda_step()  # once with the library, so a broken call fails here, not silently stubbed

    def stub(*a):
        return None

    rows = [
        ("fused_recurrent_kda (whole call, functools.partial)", kda_step),
        ("fused_recurrent_gated_delta_rule (whole call)", gdn_step),
        ("flashdelta.decode (whole call)", lambda: flashdelta.decode(
            q, k, v, g, beta, mechanism="kda", state_pool=pool, state_indices=idx, scale=scale,
            qk_l2norm=True, beta_sigmoid=True, gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias, state_v_first=v_first)),
        ("ops' serving_call", lambda: _common.serving_call(
            "kda", q, k, v, g, beta, A_log, dt_bias, scale, pool, True, True, True, False,
            None, v_first, None, {"ssm_state_indices": idx, "inplace_final_state": True},
            "fused_recurrent_kda")),
        ("_api.decode_positional", lambda: _api.decode_positional(
            q, k, v, g, beta, None, A_log, dt_bias, pool, idx, None, "kda", scale, True, True,
            False, True, None, v_first, "recurrent")),
        ("_torch_ops.decode_direct", lambda: _torch_ops.decode_direct(
            q, k, v, g, beta, None, A_log, dt_bias, pool, idx, None, "kda", scale, True, True,
            False, True, None, v_first, "recurrent")),
        ("  _torch_ops.direct(11 tensors)", functools.partial(
            _torch_ops.direct, (q, k, v, g, beta, None, A_log, dt_bias, pool, idx, None))),
        ("  torch.empty_like(v, dtype=, memory_format=)", lambda: torch.empty_like(
            v, dtype=bf, memory_format=torch.contiguous_format)),
        ("  torch.empty(v.shape, dtype=, device=)", lambda: torch.empty(
            v.shape, dtype=bf, device=v.device)),
        ("  v.new_empty(v.shape)", lambda: v.new_empty(v.shape)),
        ("  _increment_version((pool,))", lambda: _torch_ops._increment_version((pool,))),
        ("  the no-op library call (15 arguments)", lambda: stub(
            q, k, v, g, beta, None, A_log, dt_bias, pool, idx, None, None, None, "recurrent",
            0)),
        ("  q.is_cuda", lambda: q.is_cuda),
        ("  q.get_device()", lambda: q.get_device()),
        ("  an empty lambda (the loop's own cost)", lambda: None),
    ]
    # The current package's single-frame serving path, where it has one.
    if hasattr(_torch_ops, "serving_direct"):
        rows.insert(3, ("_torch_ops.serving_direct", lambda: _torch_ops.serving_direct(
            "kda", q, k, v, g, beta, A_log, dt_bias, scale, pool, True, True, True, False,
            None, v_first, None, idx, None, True)))

    best = [float("inf")] * len(rows)
    real_decode = flashdelta._C.decode
    flashdelta._C.decode = stub
    try:
        for _ in range(args.repeats):
            for i, (_, fn) in enumerate(rows):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                best[i] = min(best[i], time.perf_counter() - t0)
    finally:
        flashdelta._C.decode = real_decode

    print(f"torch {torch.__version__}, {args.calls} calls, best of {args.repeats}, "
          f"state_v_first={v_first}")
    for (name, _), t in zip(rows, best):
        print(f"{t / args.calls * 1e6:8.3f} us  {name}")


if __name__ == "__main__":
    main()
