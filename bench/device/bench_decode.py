"""Decode (recurrent schedule, in-place state pool) on the GPU: FlashDelta vs fla, side by side
in one process, on the same inputs.

For each case both implementations run the vLLM-style serving step: q, k, v, g, beta of T
tokens per sequence, the state pool updated in place at the slots `ssm_state_indices` names
(per-token slots [N, T] plus `num_accepted_tokens` for speculative steps), with q/k L2 norm,
beta sigmoid and the gate activation (A_log, dt_bias) fused in the kernel:

  fla   fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd (inplace_final_state=True); for
        Gated DeltaNet, whose fla 0.6.0 recurrent kernel has no state pool, the plain form
        fused_recurrent_gated_delta_rule_fwd(initial_state=pool[slots], output_final_state)
        (the same state traffic: every state read once and written once)
  ours  flashdelta.fused_recurrent_kda / fused_recurrent_gated_delta_rule(initial_state=pool,
        ssm_state_indices=..., inplace_final_state=True): the drop-in call

Timing. Per call, CUDA events around the call, with every call queued behind a long
torch.cuda._sleep so that the host never starves the GPU (the times are the GPU's, of every
kernel the call launches); the pool slots and input sets rotate over enough sets that the
states do not sit in the L2 (at least 4 sets, and at least 4x the L2 of state); median of
--reps calls after warm-up. For N=1 also the wall-clock time per call from Python (a loop,
one synchronisation at the end: host overhead included; the implementations take turns over
--wall-rounds rounds and each keeps its median round, since the host's speed drifts between
and within runs), the time per call of 100 calls
captured in a CUDA graph (replays timed: no host overhead, but the gaps between kernels),
and the kernels' own device time per call (CUPTI's start to end of each launch, through
torch.profiler). State bandwidth = state bytes moved per call
(read once, written once per slot written) / time; the copy bandwidth is measured in the same
run (a >= 1 GiB device-to-device copy, bytes read + written / time, median).

What is timed is the library call alone: its arguments are bound once per input set
(functools.partial), and the written states are gathered only for the correctness check.

Correctness: one call of each on copies of the same pool; the max relative difference
(max |ours - fla| / max |fla|) of o and of the written states is recorded.

--variants also times ours under other settings of its environment variables, in the same
process on the same inputs (each NAME=VALUE, several joined by '+'; comma-separated), e.g.
--variants FLASHDELTA_RECURRENT_ORDER=state-first: a line per variant under each case, with
its time, % of copy, the N=1 graph and CUPTI times, and its largest difference from ours.

Outputs under --out: bench_decode.txt (the table), bench_decode.json (everything, with the
device, versions, date and command), bench_decode.png (plot). Every case fails soft: an
implementation that raises is recorded with its error and the rest still runs.

    python3 bench/device/bench_decode.py --out $OUT            # on the GPU
    python3 bench/device/bench_decode.py --device cpu --out /tmp/bd  # dry run: tiny shapes,
        # FlashDelta on the CPU against its fp64 reference (exercises every code path)
"""

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback


def parse_args(argv):
    p = argparse.ArgumentParser(description="FlashDelta vs fla decode benchmark",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--out", default=".", help="output folder (default: .)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, on the CPU unless --device cuda (checks the code paths)")
    p.add_argument("--reps", type=int, default=100, help="timed calls per case (default 100)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--wall-rounds", type=int, default=5,
                   help="rounds of the N=1 wall-clock loop, implementations in turn (default 5)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--layouts", default="k_first,v_first")
    p.add_argument("--no-fla", action="store_true", help="time FlashDelta alone")
    p.add_argument("--variants", default="",
                   help="comma-separated variants of ours to time beside it, each NAME=VALUE "
                        "(several joined by '+') of its environment variables")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds; cases that would start later are skipped (default: none)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Cases

def cases(dry):
    """(name, parameters). The issue's targets: H200, KDA, K=V=128, bf16 inputs, fp32 state,
    T=1, in place; N in {1, 64, 256} x HV=32, and the extra reports."""
    base = dict(mech="kda", N=1, T=1, H=32, HV=32, K=128, V=128, state="float32",
                spec=False)
    if dry:  # tiny and fast on the CPU
        base.update(H=4, HV=4, K=16, V=16)
    big = 4 if dry else 256
    mid = 2 if dry else 64
    out = [
        ("kda_n1", dict(base, N=1)),
        ("kda_n64", dict(base, N=mid)),
        ("kda_n256", dict(base, N=big)),
        ("kda_gva_h16_n256", dict(base, N=big, H=base["H"] // 2)),
        ("kda_k256_n64", dict(base, N=mid, K=2 * base["K"], V=2 * base["V"])),
        ("kda_spec_t4_n64", dict(base, N=mid, T=4, spec=True)),
        ("kda_bf16state_n256", dict(base, N=big, state="bfloat16")),
        ("gdn_n256", dict(base, N=big, mech="gdn")),
    ]
    return out


# ---------------------------------------------------------------------------------------------
# Inputs

class Problem:
    """Input sets and one state pool for a case. Set r uses pool slots
    [r * N * S, (r + 1) * N * S) (S = T with per-token slots, else 1), so rotating r moves
    the state traffic over the whole pool."""

    def __init__(self, torch, p, layout, sets, device, seed=0):
        N, T, H, HV, K, V = p["N"], p["T"], p["H"], p["HV"], p["K"], p["V"]
        self.p, self.layout, self.sets = p, layout, sets
        self.v_first = layout == "v_first"
        gen = torch.Generator(device="cpu").manual_seed(seed)
        bf = torch.bfloat16

        def randn(*shape, scale=1.0, dtype=bf):
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

        gdn = p["mech"] == "gdn"
        self.inputs = []
        for _ in range(sets):
            self.inputs.append(dict(
                q=randn(N, T, H, K), k=randn(N, T, H, K), v=randn(N, T, HV, V),
                g=randn(N, T, HV) if gdn else randn(N, T, HV, K), beta=randn(N, T, HV)))
        self.A_log = (torch.rand(HV, generator=gen) * 1.5 - 1.0).to(device)
        self.dt_bias = randn(HV if gdn else HV * K, scale=0.5, dtype=torch.float32)
        S = T if p["spec"] else 1
        self.S = S
        slots = sets * N * S
        shape = (slots, HV, V, K) if self.v_first else (slots, HV, K, V)
        state_dtype = getattr(torch, p["state"])
        self.pool = torch.empty(shape, dtype=state_dtype, device=device)
        self.pool.normal_(0.0, 0.05, generator=None)
        self.indices, self.accepted = [], []
        for r in range(sets):
            idx = torch.arange(r * N * S, (r + 1) * N * S, dtype=torch.int32, device=device)
            self.indices.append(idx.view(N, S) if p["spec"] else idx)
            self.accepted.append(torch.randint(1, T + 1, (N,), generator=gen, dtype=torch.int32)
                                 .to(device) if p["spec"] else None)
        self.scale = K ** -0.5

    def block(self, r):
        """Pool slots of set r (for fla's Gated DeltaNet, which takes states [N, ...])."""
        n = self.p["N"] * self.S
        return slice(r * n, (r + 1) * n)

    def state_bytes(self):
        """Bytes of state moved per call: each row reads one state and writes one per slot
        written (T with per-token slots, else 1)."""
        p = self.p
        per_state = p["HV"] * p["K"] * p["V"] * self.pool.element_size()
        return p["N"] * per_state * (1 + (p["T"] if p["spec"] else 1))


# ---------------------------------------------------------------------------------------------
# The implementations: step(flashdelta, prob, r, pool=None) -> (fn, read). fn() is one
# serving step on set r, the library call alone, bound to its arguments (functools.partial),
# so that the timed loops run nothing else; read(fn()) -> (o, states written) for the
# correctness check (the states: pool slots of set r).

def serving_kwargs(prob, r, pool):
    """The fla serving-form keywords of one step on set r (ours and the reference share them)."""
    kw = dict(initial_state=pool, ssm_state_indices=prob.indices[r], inplace_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=prob.A_log,
              dt_bias=prob.dt_bias, use_beta_sigmoid_in_kernel=True,
              state_v_first=prob.v_first, scale=prob.scale)
    if prob.p["spec"]:
        kw["num_accepted_tokens"] = prob.accepted[r]
    return kw


def serving_step(module, prob, r, pool=None):
    """module.fused_recurrent_kda / fused_recurrent_gated_delta_rule's serving form on set r,
    bound; read gives (o, the pool slots of set r). With module = flashdelta it is ours."""
    pool = prob.pool if pool is None else pool
    x = prob.inputs[r]
    common = serving_kwargs(prob, r, pool)
    if prob.p["mech"] == "gdn":
        fn = functools.partial(module.fused_recurrent_gated_delta_rule, x["q"], x["k"], x["v"],
                               x["g"], beta=x["beta"], **common)
    else:
        fn = functools.partial(module.fused_recurrent_kda, x["q"], x["k"], x["v"], x["g"],
                               x["beta"], **common)
    return fn, lambda result: (result[0], pool[prob.block(r)])


def reference_step(flashdelta, prob, r, pool=None):
    """The dry run's baseline: FlashDelta's fp64 reference (o cast to the inputs' dtype)."""
    fn, read = serving_step(flashdelta.reference, prob, r, pool)
    dtype = prob.inputs[r]["v"].dtype
    return fn, lambda result: (result[0].to(dtype), read(result)[1])


def failing(message):
    """An implementation that cannot run (its error is recorded for every case)."""
    def step(*args, **kwargs):
        raise RuntimeError(message)
    return step


def make_fla_step():
    """fla's serving step, or raises ImportError."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd

    def step(flashdelta, prob, r, pool=None):
        pool = prob.pool if pool is None else pool
        x = prob.inputs[r]
        if prob.p["mech"] == "gdn":
            fn = functools.partial(
                fused_recurrent_gated_delta_rule_fwd,
                q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=prob.A_log,
                dt_bias=prob.dt_bias, scale=prob.scale, initial_state=pool[prob.block(r)],
                output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, state_v_first=prob.v_first)
            return fn, lambda result: result  # (o, final)
        fn = functools.partial(
            fused_recurrent_kda_fwd,
            q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=prob.A_log,
            dt_bias=prob.dt_bias, initial_state=pool, scale=prob.scale,
            output_final_state=False, inplace_final_state=True, state_v_first=prob.v_first,
            ssm_state_indices=prob.indices[r],
            num_accepted_tokens=prob.accepted[r] if prob.p["spec"] else None,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True)
        return fn, lambda result: (result[0], pool[prob.block(r)])

    return step


# ---------------------------------------------------------------------------------------------
# Timing

class Timer:
    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def per_call(self, fn, sets, reps, warmup):
        """Median, p10, p90 seconds of one call, rotating over the sets."""
        torch = self.torch
        for i in range(warmup):
            fn(i % sets)
        self.sync()
        if not self.cuda:
            times = []
            for i in range(reps):
                t0 = time.perf_counter()
                fn(i % sets)
                times.append(time.perf_counter() - t0)
            return summary(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        # Hold the stream while the host queues every call: the events then time the GPU
        # work alone. The hold is sized from a measured host time per call.
        t0 = time.perf_counter()
        fn(0)
        host = time.perf_counter() - t0
        self.sync()
        torch.cuda._sleep(int(min(2e9, max(1e6, 2.0 * reps * host * 2e9))))
        for i in range(reps):
            starts[i].record()
            fn(i % sets)
            ends[i].record()
        self.sync()
        return summary([s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)])

    def wall(self, fn, sets, reps, warmup):
        """Seconds per call from Python in a loop, synchronising only at the end."""
        for i in range(warmup):
            fn(i % sets)
        self.sync()
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i % sets)
        self.sync()
        return (time.perf_counter() - t0) / reps

    def kernel(self, fn, sets, calls=200):
        """The kernels' own device time per call, from CUPTI's start and end of every launch
        (torch.profiler; no launch gaps, no replay): seconds per call summed over the kernels
        a call launches, and the median of the longest kernel's launches."""
        from torch.profiler import ProfilerActivity, profile
        for i in range(10):
            fn(i % sets)
        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                fn(i % sets)
            self.sync()
        launches = {}
        for e in prof.events():
            if e.device_type == self.torch.autograd.DeviceType.CUDA:
                launches.setdefault(e.name, []).append(e.device_time_total * 1e-6)
        if not launches:
            return None
        main = max(launches.values(), key=sum)
        return dict(total=sum(map(sum, launches.values())) / calls,
                    longest_median=statistics.median(main), kernels=len(launches))

    def graph(self, fn, sets, calls=100, replays=20):
        """Seconds per call of `calls` calls captured in a CUDA graph (median replay)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(i % sets)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % sets)
        graph.replay()
        self.sync()
        times = []
        for _ in range(replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            self.sync()
            times.append(s.elapsed_time(e) * 1e-3 / calls)
        del graph
        return statistics.median(times)


def summary(times):
    times = sorted(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return dict(median=statistics.median(times), p10=q(0.1), p90=q(0.9), n=len(times))


def copy_bandwidth(torch, device, timer, nbytes=1 << 30, reps=20):
    """Bytes read + written per second of a device-to-device copy of nbytes (median)."""
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    timer.sync()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            timer.sync()
            times.append(s.elapsed_time(e) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def rel_diff(torch, a, b):
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def variant_settings(impl):
    """The environment settings of impl: {} for 'ours', 'kept' and 'fla', else impl is a
    variant of ours (bench_backward.py, bench_chunk.py --variants), 'NAME=VALUE+NAME=VALUE...'."""
    if impl in ("ours", "kept", "fla", "reference"):
        return {}
    pairs = [p.split("=", 1) for p in impl.split("+")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        sys.exit(f"a variant is NAME=VALUE pairs joined by '+', got {impl!r}")
    return dict(pairs)


@contextlib.contextmanager
def environment_of(impl):
    """impl's environment settings applied for the block, the previous values restored."""
    settings = variant_settings(impl)
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def error_text(e):
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 600 else text[:600] + " ..."


def kernel_times(torch, step, steps):
    """{kernel name: (ms per step, launches per step)} of `steps` calls of step() under
    torch.profiler (device time of every CUDA kernel, summed over its launches)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total / 1e3
            count[e.name] += 1
    return {n: (t / steps, count[n] / steps) for n, t in total.items()}


# ---------------------------------------------------------------------------------------------
# One case

def wall_rounds(timer, fns, row, sets, args):
    """The wall-clock time per call from Python of every implementation in fns, in turns
    (round 1: each once, round 2: each again, ...): the host's speed drifts, and turns spread
    the drift over all of them. Keeps each one's median round, and every round."""
    rounds = {label: [] for label in fns}
    for _ in range(max(1, args.wall_rounds)):
        for label, fn in fns.items():
            try:
                with environment_of(label):
                    rounds[label].append(timer.wall(fn, sets, max(args.reps, 200),
                                                    args.warmup))
            except Exception as e:  # noqa: BLE001
                row["impls"][label]["wall_error"] = error_text(e)
    for label, times in rounds.items():
        if times:
            row["impls"][label]["wall_s_per_call"] = statistics.median(times)
            row["impls"][label]["wall_s_rounds"] = times


def run_case(torch, flashdelta, name, p, layout, impls, device, args, l2_bytes):
    timer = Timer(torch, device)
    row = dict(case=name, layout=layout, params=p, impls={})
    # Sets: at least 4, and at least 4x the L2 in state bytes.
    per_set = p["N"] * p["HV"] * p["K"] * p["V"] * (2 if p["state"] == "bfloat16" else 4) * \
        (p["T"] if p["spec"] else 1)
    sets = max(4, min(512, math.ceil(4 * l2_bytes / per_set)))
    row["sets"] = sets
    try:
        prob = Problem(torch, p, layout, sets, device)
    except Exception as e:  # noqa: BLE001 (fail soft: recorded)
        row["error"] = "setup: " + error_text(e)
        return row
    state_bytes = prob.state_bytes()
    row["state_bytes_per_call"] = state_bytes

    # Correctness: one call of each on copies of the pool, set 0.
    results = {}
    for label, step in impls.items():
        entry = row["impls"].setdefault(label, {})
        try:
            pool = prob.pool.clone()
            with environment_of(label):
                fn, read = step(flashdelta, prob, 0, pool)
                o, states = read(fn())
            timer.sync()
            results[label] = (o.detach().clone(), states.detach().clone())
            o = states = fn = read = pool = None  # the clone's last references
        except Exception as e:  # noqa: BLE001
            entry["error"] = error_text(e)
            entry["traceback"] = traceback.format_exc(limit=4)
    labels = list(impls)
    if len(labels) >= 2 and labels[0] in results and "ours" in results:
        (o_a, s_a), (o_b, s_b) = results["ours"], results[labels[0]]
        try:
            row["max_rel_diff"] = dict(o=rel_diff(torch, o_a, o_b),
                                       state=rel_diff(torch, s_a, s_b))
        except Exception as e:  # noqa: BLE001
            row["max_rel_diff"] = dict(error=error_text(e))
    for label in labels[2:]:  # variants of ours, against ours
        if label in results and "ours" in results:
            (o_a, s_a), (o_b, s_b) = results[label], results["ours"]
            row["impls"][label]["max_rel_diff_vs_ours"] = dict(
                o=rel_diff(torch, o_a, o_b), state=rel_diff(torch, s_a, s_b))
    results.clear()

    fns = {}
    for label, step in impls.items():
        entry = row["impls"][label]
        if "error" in entry:
            continue
        try:
            steps = [step(flashdelta, prob, r)[0] for r in range(sets)]
            fn = lambda r, steps=steps: steps[r]()  # noqa: E731
            with environment_of(label):
                t = timer.per_call(fn, sets, args.reps, args.warmup)
                entry["time_s"] = t
                entry["state_GBps"] = state_bytes / t["median"] / 1e9
                fns[label] = fn
                if p["N"] == 1:
                    if device.type == "cuda":
                        entry["graph_s_per_call"] = timer.graph(fn, sets)
                        k = timer.kernel(fn, sets)
                        if k:
                            entry["kernel_s_per_call"] = k["total"]
                            entry["kernel_longest_median_s"] = k["longest_median"]
        except Exception as e:  # noqa: BLE001
            entry["error"] = error_text(e)
            entry["traceback"] = traceback.format_exc(limit=4)
    if p["N"] == 1:
        wall_rounds(timer, fns, row, sets, args)
    fn = fns = steps = prob = None  # frees the pool before the next case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------
# Reports

def fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def table(rows, baseline, copy_runs, gpu):
    copy_bw = max(copy_runs)
    lines = []
    head = (f"{'case':<22} {'layout':<8} {baseline + ' ms':>10} {'ours ms':>10} {'speedup':>8} "
            f"{'ours GB/s':>10} {'ours %copy':>10} {baseline + ' %copy':>10} "
            f"{'diff o':>9} {'diff S':>9}")
    lines += [head, "-" * len(head)]
    notes = []
    for row in rows:
        b, o = row["impls"].get(baseline, {}), row["impls"].get("ours", {})
        tb = b.get("time_s", {}).get("median")
        to = o.get("time_s", {}).get("median")
        d = row.get("max_rel_diff", {})
        lines.append(
            f"{row['case']:<22} {row['layout']:<8} {fmt(tb and tb * 1e3, '10.4f'):>10} "
            f"{fmt(to and to * 1e3, '10.4f'):>10} "
            f"{fmt(tb / to if tb and to else None, '7.2f') + ('x' if tb and to else ''):>8} "
            f"{fmt(o.get('state_GBps'), '10.0f'):>10} {fmt(o.get('pct_copy_bw'), '9.1f'):>10} "
            f"{fmt(b.get('pct_copy_bw'), '9.1f'):>10} {fmt(d.get('o'), '9.2e'):>9} "
            f"{fmt(d.get('state'), '9.2e'):>9}")
        if row["params"]["N"] == 1:
            for key, what in (("wall_s_per_call", "wall/call from Python"),
                              ("graph_s_per_call", "graph replay/call"),
                              ("kernel_s_per_call", "kernel time/call (CUPTI)")):
                wb, wo = b.get(key), o.get(key)
                if wb or wo:
                    ratio = f"  ({wb / wo:.2f}x)" if wb and wo else ""
                    if key == "wall_s_per_call":  # the spread of the rounds (wall_rounds)
                        ratio += "".join(
                            f"; {lb} rounds {min(r) * 1e6:.1f}-{max(r) * 1e6:.1f}" for lb, r in
                            ((baseline, b.get("wall_s_rounds")), ("ours", o.get("wall_s_rounds")))
                            if r)
                    lines.append(f"{'':<22} {'':<8} {what}: {baseline} "
                                 f"{fmt(wb and wb * 1e6, '.1f')} us, ours "
                                 f"{fmt(wo and wo * 1e6, '.1f')} us{ratio}")
        for label, v in row["impls"].items():  # variants of ours (--variants)
            if label in (baseline, "ours") or "error" in v:
                continue
            tv = v.get("time_s", {}).get("median")
            extra = "".join(f", {what} {v[key] * 1e6:.1f} us" for key, what in (
                ("graph_s_per_call", "graph"), ("kernel_s_per_call", "CUPTI")) if v.get(key))
            dv = v.get("max_rel_diff_vs_ours", {})
            lines.append(f"{'':<22} {'':<8} variant {label}: {fmt(tv and tv * 1e3, '.4f')} ms "
                         f"(ours / variant {fmt(to / tv if to and tv else None, '.3f')}), "
                         f"{fmt(v.get('pct_copy_bw'), '.1f')}% copy{extra}; diff vs ours o "
                         f"{fmt(dv.get('o'), '.1e')}, S {fmt(dv.get('state'), '.1e')}")
        for label, entry in row["impls"].items():
            if "error" in entry:
                notes.append(f"{row['case']}/{row['layout']} {label}: {entry['error']}")
        if "error" in row:
            notes.append(f"{row['case']}/{row['layout']}: {row['error']}")
    lines.append("")
    runs = (f"the higher of {copy_runs[0] / 1e9:.0f} before and {copy_runs[1] / 1e9:.0f} after "
            f"the cases" if len(copy_runs) == 2 else "measured before the cases")
    lines.append(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s, {runs}. "
                 f"Times: median "
                 f"{'GPU time per call (CUDA events)' if gpu else 'host time per call'}; "
                 f"speedup = {baseline} / ours; diff = max |ours - {baseline}| / max "
                 f"|{baseline}| of o and of the written states.")
    if notes:
        lines.append("")
        lines.append("errors:")
        lines += ["  " + n.replace("\n", " ") for n in notes]
    return "\n".join(lines)


def plot(rows, baseline, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [f"{r['case']}\n{r['layout']}" for r in rows]
    get = lambda r, lb, k: r["impls"].get(lb, {}).get(k)  # noqa: E731
    t_b = [(get(r, baseline, "time_s") or {}).get("median", 0) * 1e6 for r in rows]
    t_o = [(get(r, "ours", "time_s") or {}).get("median", 0) * 1e6 for r in rows]
    p_b = [get(r, baseline, "pct_copy_bw") or 0 for r in rows]
    p_o = [get(r, "ours", "pct_copy_bw") or 0 for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.9 * len(rows)), 8), sharex=True)
    xs = range(len(rows))
    w = 0.4
    axes[0].bar([x - w / 2 for x in xs], t_b, w, label=baseline)
    axes[0].bar([x + w / 2 for x in xs], t_o, w, label="FlashDelta")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("time per call (us, log)")
    axes[0].legend()
    axes[1].bar([x - w / 2 for x in xs], p_b, w, label=baseline)
    axes[1].bar([x + w / 2 for x in xs], p_o, w, label="FlashDelta")
    axes[1].axhline(95, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("state bandwidth, % of copy")
    axes[1].set_xticks(list(xs))
    axes[1].set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    fig.suptitle("Decode step, in-place state pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions(torch):
    v = dict(python=platform.python_version(), torch=torch.__version__)
    for mod in ("triton", "fla", "flashdelta", "numpy"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            v[mod] = f"unavailable ({type(e).__name__}: {e})"[:200]
    v["git"] = git_version()
    return v


def git_version():
    """The commit the measured tree is: FLASHDELTA_COMMIT when the caller names it (the device
    tool copies the working tree onto a checkout of another commit, so HEAD there is not the
    tree's), else HEAD, marked +dirty when tracked files differ from it."""
    named = os.environ.get("FLASHDELTA_COMMIT")
    if named:
        return named

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return None
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001
        return None


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch
    try:
        import flashdelta
        flashdelta_error = None
    except Exception as e:  # noqa: BLE001 (fail soft: fla is still timed)
        flashdelta, flashdelta_error = None, "import flashdelta: " + error_text(e)
        print(flashdelta_error, flush=True)

    dry = args.dry_run
    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev_name)
    if device.type == "cpu":
        dry = True  # the full shapes are for the GPU
    os.makedirs(args.out, exist_ok=True)
    if dry:
        args.reps = min(args.reps, 20)
        args.warmup = min(args.warmup, 2)

    impls = {}
    baseline = "fla"
    if device.type != "cuda":
        baseline = "reference"  # fla's kernels are Triton: GPU only
        impls["reference"] = reference_step
    elif not args.no_fla:
        try:
            impls["fla"] = make_fla_step()
        except Exception as e:  # noqa: BLE001
            print(f"fla unavailable: {error_text(e)}", flush=True)
    impls["ours"] = serving_step if flashdelta is not None else failing(flashdelta_error)
    for variant in filter(None, args.variants.split(",")):
        variant_settings(variant)  # exits on a malformed one, before any case runs
        impls[variant] = serving_step if flashdelta is not None else failing(flashdelta_error)
    if flashdelta is None and "reference" in impls:
        impls["reference"] = failing(flashdelta_error)

    timer = Timer(torch, device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev_desc = dict(name=props.name, sms=props.multi_processor_count,
                        l2_bytes=getattr(props, "L2_cache_size", 50 << 20),
                        memory_bytes=props.total_memory,
                        capability=f"{props.major}.{props.minor}")
    else:
        dev_desc = dict(name=platform.processor() or platform.machine(), l2_bytes=1 << 20)
    # The copy is measured before and after the cases and the higher is the reference for
    # % copy: one measurement has come out 5-10% low (bench/NOTES.md (ag)).
    copy_runs = [copy_bandwidth(torch, device, timer)]
    print(f"device: {dev_desc['name']}; copy bandwidth {copy_runs[0] / 1e9:.0f} GB/s", flush=True)

    wanted = set(filter(None, args.cases.split(",")))
    layouts = [x for x in args.layouts.split(",") if x]
    rows = []
    last = 0.0
    # Layout outermost: every K-first case (fla's default layout, the targets') comes first.
    for layout in layouts:
        for name, p in cases(dry):
            if wanted and name not in wanted:
                continue
            elapsed = time.perf_counter() - t_start
            if args.time_budget and elapsed + last > args.time_budget:
                rows.append(dict(case=name, layout=layout, params=p, impls={},
                                 error=f"skipped: time budget ({args.time_budget:.0f} s)"))
                print(f"{name:<22} {layout:<8} skipped (time budget)", flush=True)
                continue
            t0 = time.perf_counter()
            row = run_case(torch, flashdelta, name, p, layout, impls, device, args,
                           dev_desc["l2_bytes"])
            row["seconds"] = last = time.perf_counter() - t0
            rows.append(row)
            ours = row["impls"].get("ours", {})
            base = row["impls"].get(baseline, {})
            print(f"{name:<22} {layout:<8} {baseline}: "
                  f"{fmt((base.get('time_s') or {}).get('median'), '.3e')} s "
                  f"{'ERROR ' + base['error'][:80] if 'error' in base else ''} | ours: "
                  f"{fmt((ours.get('time_s') or {}).get('median'), '.3e')} s "
                  f"{'ERROR ' + ours['error'][:80] if 'error' in ours else ''} "
                  f"[{row['seconds']:.1f} s]", flush=True)

    try:
        copy_runs.append(copy_bandwidth(torch, device, timer))
    except Exception as e:  # noqa: BLE001 (a failed case can leave the device unusable)
        print(f"copy bandwidth after the cases: {error_text(e)}", flush=True)
    copy_bw = max(copy_runs)
    for row in rows:
        for entry in row["impls"].values():
            if "state_GBps" in entry:
                entry["pct_copy_bw"] = 100.0 * entry["state_GBps"] * 1e9 / copy_bw
    text = table(rows, baseline, copy_runs, device.type == "cuda")
    header = (f"bench_decode: {dev_desc['name']}, {datetime.datetime.now().isoformat(' ', 'seconds')}"
              f"\ncommand: {' '.join([sys.executable] + sys.argv)}\n")
    print("\n" + header + text, flush=True)
    with open(os.path.join(args.out, "bench_decode.txt"), "w") as f:
        f.write(header + text + "\n")
    record = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                  command=" ".join([sys.executable] + sys.argv), dry_run=dry,
                  device=dev_desc, versions=versions(torch), copy_bandwidth_Bps=copy_bw,
                  copy_bandwidth_before_after_Bps=copy_runs,
                  baseline=baseline, reps=args.reps, warmup=args.warmup,
                  flashdelta_error=flashdelta_error, rows=rows)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    try:
        plot(rows, baseline, os.path.join(args.out, "bench_decode.png"))
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {error_text(e)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
