"""Per-call host overhead of the Python layer, on a problem so small that the library's own
work is negligible (N=1, T=1, H=HV=1, K=V=1 by default).

Runs on the CPU (no GPU needed) or, with --device cuda, on a GPU (then the times include the
kernel launch, and torch.cuda.synchronize() runs only at the end). Prints microseconds per
call (median of --repeats runs of --calls calls) for the layers of one serving step:

    _C.decode        the nanobind call alone, options prebuilt (conversion + validation +
                     the library)
    op decode        torch.ops.flashdelta.decode (torch.library dispatch + the op body)
    flashdelta.decode                 the generic entry point
    fused_recurrent_kda (serving)     the fla-named serving form
    fused_recurrent_kda (forward)     the fla-named forward form (initial_state, output_final_state)
    fla fused_recurrent_kda_fwd       fla's serving call on the same tensors, when fla imports
                                      (CUDA only: its kernels are Triton)

    python3 bench/device/overhead.py [--device cpu|cuda] [--hv 1 --k 1 --v 1] [--json PATH]
"""

import argparse
import json
import statistics
import sys
import time


def timed(fn, calls, repeats, sync):
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--hv", type=int, default=1)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--v", type=int, default=1)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch
    import flashdelta
    from flashdelta import _C

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    N, T, H, HV, K, V = args.n, 1, args.hv, args.hv, args.k, args.v
    bf = torch.bfloat16
    q = torch.randn(N, T, H, K, device=dev, dtype=bf)
    k = torch.randn(N, T, H, K, device=dev, dtype=bf)
    v = torch.randn(N, T, HV, V, device=dev, dtype=bf)
    g = torch.randn(N, T, HV, K, device=dev, dtype=bf)
    beta = torch.randn(N, T, HV, device=dev, dtype=bf)
    A_log = torch.zeros(HV, device=dev)
    dt_bias = torch.zeros(HV * K, device=dev)
    pool = torch.zeros(N + 1, HV, K, V, device=dev)
    idx = torch.arange(N, dtype=torch.int32, device=dev)
    state = torch.zeros(N, HV, K, V, device=dev)
    o = torch.empty(N, T, HV, V, device=dev, dtype=bf)
    fused = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True)

    results = {}

    if hasattr(_C, "Options"):
        opt = _C.Options()
        opt.mechanism = "kda"
        opt.qk_l2norm = opt.beta_sigmoid = opt.gate_in_kernel = True
        opt.num_threads = 1
        arrays = [x.detach() for x in (q, k, v, g, beta)]
        try:  # the stream argument exists from the CUDA bindings on
            _C.decode(*arrays, None, A_log, dt_bias, pool, idx, None, o, opt, "recurrent", 0)
            raw = lambda: _C.decode(*arrays, None, A_log, dt_bias, pool, idx, None, o, opt,
                                    "recurrent", 0)
        except TypeError:
            raw = lambda: _C.decode(*arrays, None, A_log, dt_bias, pool, idx, None, o, opt,
                                    "recurrent")
        results["_C.decode (options prebuilt)"] = timed(raw, args.calls, args.repeats, sync)

    op = torch.ops.flashdelta.decode.default
    scale = K ** -0.5
    results["torch.ops.flashdelta.decode"] = timed(
        lambda: op(q, k, v, g, beta, None, A_log, dt_bias, pool, idx, None, "kda", scale,
                   True, True, False, True, None, False, "recurrent"),
        args.calls, args.repeats, sync)
    results["flashdelta.decode"] = timed(
        lambda: flashdelta.decode(q, k, v, g, beta, mechanism="kda", state_pool=pool,
                                  state_indices=idx, qk_l2norm=True, beta_sigmoid=True,
                                  gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias),
        args.calls, args.repeats, sync)
    results["fused_recurrent_kda (serving)"] = timed(
        lambda: flashdelta.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                               initial_state=pool, ssm_state_indices=idx,
                                               inplace_final_state=True, **fused),
        args.calls, args.repeats, sync)
    results["fused_recurrent_kda (forward)"] = timed(
        lambda: flashdelta.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                               initial_state=state, output_final_state=True,
                                               **fused),
        args.calls, args.repeats, sync)
    if dev.type == "cuda":
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        except Exception as e:  # noqa: BLE001 (optional)
            print(f"fla unavailable: {type(e).__name__}: {e}")
        else:
            results["fla fused_recurrent_kda_fwd"] = timed(
                lambda: fused_recurrent_kda_fwd(
                    q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                    initial_state=pool, scale=scale, output_final_state=False,
                    inplace_final_state=True, ssm_state_indices=idx,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True),
                args.calls, args.repeats, sync)
    results["torch.empty (reference point)"] = timed(
        lambda: q.new_empty((N, T, HV, V)), args.calls, args.repeats, sync)

    print(f"per-call time, us (device {dev}, N={N} HV={HV} K={K} V={V}, torch "
          f"{torch.__version__}, flashdelta {flashdelta.__version__})")
    for name, us in results.items():
        print(f"  {name:<34} {us:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "shape": dict(N=N, HV=HV, K=K, V=V),
                       "us_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
