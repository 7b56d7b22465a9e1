"""Chunkwise forward (prefill) on the GPU: FlashDelta vs fla's Triton kernels, side by side in
one process, on the same inputs (issue 5's cases).

  fla   fla.ops.kda.chunk_kda / fla.ops.gated_delta_rule.chunk_gated_delta_rule, with
        FLA_FLASH_KDA=0 (the Triton path, not the CUTLASS FlashKDA kernel)
  ours  flashdelta.chunk_kda / chunk_gated_delta_rule: the same call, the same keywords

KDA cases run fla's headline configuration: bf16 q, k, v, g; the gate computed in the kernel
from A_log and dt_bias with lower_bound=-5 (safe_gate), q/k L2 norm and beta sigmoid in the
kernel, V-first fp32 states, an initial state in and the final state out. The training shape
takes a precomputed log-space gate without a lower bound. Gated DeltaNet uses fla's form:
precomputed scalar log gate, sigmoid-activated beta, q/k L2 norm in the kernel.

Timing: CUDA events around each call with the stream held by torch.cuda._sleep while the host
queues the calls (GPU time of every kernel a call launches, allocations included); inputs
rotate over 2 sets; median of --reps calls after warm-up.

Floor: FLOPs of the chunk form at C = 64 (lower-triangular products counted once:
1.5 C^2 K + C^2 V + 3 C K V multiply-adds per chunk and head) over 680 TFLOP/s (DESIGN.md
section 5), or the input and output bytes over the copy bandwidth measured in this run,
whichever is larger.

Accuracy (first case): relative Frobenius error of o against an fp64 token-by-token
recurrence run with torch on the GPU from the same bf16 inputs, for fla and for FlashDelta.

--variants also times ours under other settings of its environment variables, in the same
process on the same inputs, each reported with its speedup and its output's difference from
ours, e.g. --variants FLASHDELTA_CHUNK_STATE_SEGMENTS=1,FLASHDELTA_CHUNK_STATE_SEGMENTS=2
(the state kernel's split, src/cuda/chunk_state.cuh).

Kernels: each implementation's time per call kernel by kernel (torch.profiler over
--kernel-calls calls after the timing; 0 skips it), summed per kernel name, e.g. ours'
chunk_prepare_kernel and chunk_state_kernel; in the table and as <impl>_kernels_ms in the
JSON.

Outputs under --out: bench_chunk.txt, bench_chunk.json, bench_chunk.png (time against
sequence length, B=1 H=32).

    FLA_FLASH_KDA=0 python3 bench/device/bench_chunk.py --out $OUT
"""

import argparse
import datetime
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("FLA_FLASH_KDA", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import (Timer, copy_bandwidth, environment_of, error_text,  # noqa: E402
                          kernel_times, versions)

PEAK_FLOPS = 680e12
CHUNK = 64


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cases", default="",
                   help="comma-separated case names (default: all but the other key widths, "
                        "kda_T8192_H64_K64 and kda_T8192_H32_K256, which run only when named)")
    p.add_argument("--no-sweep", action="store_true", help="skip the sequence-length sweep")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--accuracy-all", action="store_true",
                   help="the error against fp64 for every case (default: the first case only)")
    p.add_argument("--kernel-calls", type=int, default=3,
                   help="calls profiled for the per-kernel times (0: none)")
    p.add_argument("--variants", default="",
                   help="comma-separated variants of ours to time beside it, each NAME=VALUE "
                        "pairs joined by '+' (environment settings), e.g. "
                        "FLASHDELTA_CHUNK_STATE_SEGMENTS=2")
    return p.parse_args(argv)


# name, mechanism, B, T (or seqlens), H, gate in kernel, target speedup (issue 5)
CASES = [
    ("kda_T8192_H64", "kda", 1, 8192, 64, True, 2.9),
    ("kda_T8192_H96", "kda", 1, 8192, 96, True, 3.7),
    ("kda_varlen_H64", "kda", 1, [1300, 547, 2048, 963, 271, 3063], 64, True, 3.6),
    ("kda_T32768_H32", "kda", 1, 32768, 32, True, 4.0),
    ("kda_train_B8_T4096_H16", "kda", 8, 4096, 16, False, 3.0),
    ("gdn_T8192_H64", "gdn", 1, 8192, 64, False, 2.0),
]
SWEEP = [("kda_sweep_T%d_H32" % t, "kda", 1, t, 32, True, None) for t in (2048, 8192, 32768)]
# Run only when named in --cases (each new shape costs fla ~90 s of autotuning): issue 5's
# other key widths ("128 tuned; 64 and 256 fast"), the first case's options, K = V, no target.
OTHER_WIDTHS = [("kda_T8192_H64_K64", "kda", 1, 8192, 64, True, None, 64),
                ("kda_T8192_H32_K256", "kda", 1, 8192, 32, True, None, 256)]


class Inputs:
    def __init__(self, torch, mech, B, T, H, gate_in_kernel, K=128, V=128, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev, bf = "cuda", torch.bfloat16
        self.seqlens = T if isinstance(T, list) else None
        total = sum(T) if self.seqlens else T
        N = len(T) if self.seqlens else B
        self.mech, self.B, self.T, self.H, self.N, self.K, self.V = mech, B, total, H, N, K, V
        self.gate_in_kernel = gate_in_kernel
        rn = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
        self.q = rn(B, total, H, K).to(bf)
        self.k = rn(B, total, H, K).to(bf)
        self.v = rn(B, total, H, V).to(bf)
        self.cu_seqlens = None
        if self.seqlens:
            offs = [0]
            for n in self.seqlens:
                offs.append(offs[-1] + n)
            self.cu_seqlens = torch.tensor(offs, dtype=torch.int64, device=dev)
        if mech == "kda":
            if gate_in_kernel:
                self.g = rn(B, total, H, K).to(bf)  # raw gate
                self.A_log = torch.log(torch.rand(H, device=dev, generator=g) * 15 + 1)
                self.dt_bias = rn(H * K) * 0.5
            else:  # a precomputed log-space gate, no lower bound
                self.g = torch.nn.functional.logsigmoid(rn(B, total, H, K) + 4).to(bf)
            self.beta = rn(B, total, H).to(bf)  # raw: sigmoid in the kernel
            self.h0 = rn(N, H, V, K) * 0.1      # V-first
        else:
            self.g = torch.nn.functional.logsigmoid(rn(B, total, H) + 4).to(bf)
            self.beta = torch.sigmoid(rn(B, total, H)).to(bf)
            self.h0 = rn(N, H, K, V) * 0.1

    def kwargs(self):
        kw = dict(initial_state=self.h0, output_final_state=True, cu_seqlens=self.cu_seqlens,
                  use_qk_l2norm_in_kernel=True)
        if self.mech == "kda":
            kw.update(use_beta_sigmoid_in_kernel=True, state_v_first=True)
            if self.gate_in_kernel:
                kw.update(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                          safe_gate=True, lower_bound=-5.0)
        return kw

    def flops(self):
        K, V, C = self.K, self.V, CHUNK
        macs = 1.5 * C * C * K + C * C * V + 3 * C * K * V
        lens = self.seqlens or [self.T] * self.B
        chunks = sum((n + C - 1) // C for n in lens)
        return 2 * macs * chunks * self.H

    def bytes(self):
        K, V, rows = self.K, self.V, self.B * self.T * self.H
        per_token = 2 * (2 * K + V + V) + 2 + (2 * K if self.mech == "kda" else 2)
        return rows * per_token + 2 * self.N * self.H * K * V * 4


def call_of(impl, torch, x):
    if impl == "fla":
        if x.mech == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    else:
        import flashdelta
        fn = flashdelta.chunk_kda if x.mech == "kda" else flashdelta.chunk_gated_delta_rule
    kw = x.kwargs()
    return lambda: fn(x.q, x.k, x.v, x.g, x.beta, **kw)


def reference_o(torch, x):
    """fp64 token-by-token recurrence on the GPU from the same inputs (DESIGN.md section 1)."""
    f = torch.float64
    q, k, v = x.q.to(f), x.k.to(f), x.v.to(f)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if x.mech == "kda":
        beta = torch.sigmoid(x.beta.to(f))
        if x.gate_in_kernel:
            raw = x.g.to(f) + x.dt_bias.to(f).view(x.H, x.K)
            g = -5.0 * torch.sigmoid(torch.exp(x.A_log.to(f)).view(x.H, 1) * raw)
        else:
            g = x.g.to(f)
        S = x.h0.to(f).transpose(-1, -2).clone()  # K-first [N, H, K, V]
    else:
        beta, g = x.beta.to(f), x.g.to(f).unsqueeze(-1)
        S = x.h0.to(f).clone()
    scale = x.K ** -0.5
    o = torch.empty_like(v)
    lens = x.seqlens or [x.T] * x.B
    t0 = 0
    for n, length in enumerate(lens):
        b = 0 if x.seqlens else n
        s = S[n]
        for t in range(t0 if x.seqlens else 0, (t0 if x.seqlens else 0) + length):
            s = s * torch.exp(g[b, t]).unsqueeze(-1)
            pred = torch.einsum("hk,hkv->hv", k[b, t], s)
            r = beta[b, t].unsqueeze(-1) * (v[b, t] - pred)
            s = s + k[b, t].unsqueeze(-1) * r.unsqueeze(-2)
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, s)
        t0 += length
    return o


def rel_error(torch, a, ref):
    d = a.to(torch.float64) - ref
    return (d.norm() / ref.norm()).item()


def run_case(torch, timer, case, args, copy_bw, accuracy):
    name, mech, B, T, H, gate_in_kernel, target, *width = case
    K = width[0] if width else 128
    row = dict(name=name, mechanism=mech, B=B, T=T, H=H, K=K, V=K, gate_in_kernel=gate_in_kernel,
               target_speedup=target)
    sets = [Inputs(torch, mech, B, T, H, gate_in_kernel, K=K, V=K, seed=s) for s in range(2)]
    x = sets[0]
    row["gflop"] = x.flops() / 1e9
    row["mbytes"] = x.bytes() / 1e6
    row["floor_ms"] = max(x.flops() / PEAK_FLOPS, x.bytes() / copy_bw) * 1e3
    t0 = time.perf_counter()
    ref = reference_o(torch, x) if accuracy else None
    row["reference_s"] = time.perf_counter() - t0
    outs = {}
    variants = list(filter(None, args.variants.split(",")))
    row["variants"] = variants
    for impl in ("fla", "ours", *variants):
        try:
            calls = [call_of(impl, torch, s) for s in sets]
            with environment_of(impl):
                t0 = time.perf_counter()
                outs[impl] = calls[0]()
                torch.cuda.synchronize()
                row[impl + "_first_call_s"] = time.perf_counter() - t0  # compile / autotune
                t = timer.per_call(lambda i: calls[i](), len(calls), args.reps, args.warmup)
                if args.kernel_calls > 0:
                    try:
                        row[impl + "_kernels_ms"] = kernels_per_call(torch, calls[0],
                                                                     args.kernel_calls)
                    except Exception as e:  # noqa: BLE001 (the timing above still counts)
                        row[impl + "_kernels_error"] = error_text(e)
            row[impl + "_ms"] = t["median"] * 1e3
            row[impl + "_p10_ms"], row[impl + "_p90_ms"] = t["p10"] * 1e3, t["p90"] * 1e3
            if ref is not None:
                row[impl + "_rel_err"] = rel_error(torch, outs[impl][0], ref)
        except Exception as e:  # noqa: BLE001 (fail soft)
            row[impl + "_error"] = error_text(e)
            traceback.print_exc()
    if "fla" in outs and "ours" in outs:
        o_f, o_o = outs["fla"][0].float(), outs["ours"][0].float()
        row["o_diff_vs_fla"] = ((o_o - o_f).norm() / o_f.norm()).item()
        s_f, s_o = outs["fla"][1].float(), outs["ours"][1].float()
        row["state_diff_vs_fla"] = ((s_o - s_f).norm() / s_f.norm()).item()
    for impl in variants:
        if impl in outs and "ours" in outs:
            o_v, o_o = outs[impl][0].float(), outs["ours"][0].float()
            row[impl + "_o_diff_vs_ours"] = ((o_v - o_o).norm() / o_o.norm()).item()
    if "fla_ms" in row and "ours_ms" in row:
        row["speedup"] = row["fla_ms"] / row["ours_ms"]
        row["ours_over_floor"] = row["ours_ms"] / row["floor_ms"]
        row["fla_over_floor"] = row["fla_ms"] / row["floor_ms"]
    del sets, outs, ref
    torch.cuda.empty_cache()
    return row


def kernel_label(name):
    """A kernel's function name without return type, namespaces, template and call
    arguments: 'void a::(anonymous namespace)::k<(a::G)2, 128, true>(a::P)' -> 'k'."""
    name = re.sub(r"^void |\(anonymous namespace\)::|<unnamed>::", "", name)
    base = re.split(r"[<(]", name, maxsplit=1)[0]
    return base.split("::")[-1] or name


def kernels_per_call(torch, call, calls):
    """{kernel label: ms per call}, largest first (kernel_times, summed per label)."""
    per_label = {}
    for name, (ms, _) in kernel_times(torch, call, calls).items():
        label = kernel_label(name)
        per_label[label] = per_label.get(label, 0.0) + ms
    return dict(sorted(per_label.items(), key=lambda kv: -kv[1]))


def fmt(v, spec):
    if isinstance(v, (int, float)):
        return format(v, spec)
    return "-".rjust(int(spec.split(".")[0]))


def table(rows, copy_bw, gpu):
    lines = [f"# chunkwise forward, {gpu}; copy {copy_bw / 1e9:.0f} GB/s; "
             "times in ms (median); speedup = fla / ours",
             f"{'case':<26}{'fla':>9}{'ours':>9}{'speedup':>9}{'target':>8}{'floor':>8}"
             f"{'ours/fl':>8}{'fla/fl':>8}{'err fla':>9}{'err ours':>9}{'vs fla':>9}"]
    for r in rows:
        lines.append(f"{r['name']:<26}{fmt(r.get('fla_ms'), '9.3f')}{fmt(r.get('ours_ms'), '9.3f')}"
                     f"{fmt(r.get('speedup'), '9.2f')}{fmt(r.get('target_speedup'), '8.1f')}"
                     f"{fmt(r.get('floor_ms'), '8.3f')}{fmt(r.get('ours_over_floor'), '8.1f')}"
                     f"{fmt(r.get('fla_over_floor'), '8.1f')}{fmt(r.get('fla_rel_err'), '9.1e')}"
                     f"{fmt(r.get('ours_rel_err'), '9.1e')}{fmt(r.get('o_diff_vs_fla'), '9.1e')}")
        for impl in r.get("variants", []):
            if impl + "_ms" in r:
                speedup = r["fla_ms"] / r[impl + "_ms"] if "fla_ms" in r else None
                err = r.get(impl + "_rel_err")
                lines.append(f"    ours with {impl}: {r[impl + '_ms']:.3f} ms, speedup "
                             f"{fmt(speedup, '5.2f')}, o vs ours "
                             f"{fmt(r.get(impl + '_o_diff_vs_ours'), '7.1e')}"
                             + (f", err {err:.1e}" if err is not None else ""))
        for impl in ("fla", "ours", *r.get("variants", [])):
            kernels = r.get(impl + "_kernels_ms")
            if kernels:
                shown = ", ".join(f"{k} {v:.3f}" for k, v in list(kernels.items())[:5])
                more = f" (+{len(kernels) - 5} more)" if len(kernels) > 5 else ""
                lines.append(f"    {impl} kernels, ms per call: {shown}{more}")
        for impl in ("fla", "ours", *r.get("variants", [])):
            for key in ("_error", "_kernels_error"):
                if impl + key in r:
                    lines.append(f"    {impl}{key.replace('_', ' ')}: {r[impl + key][:300]}")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print("no plot:", e)
        return
    sweep = [r for r in rows if r["name"].startswith("kda_sweep")]
    if not sweep:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ts = [r["T"] for r in sweep]
    for key, label in (("fla_ms", "fla chunk_kda (Triton)"), ("ours_ms", "FlashDelta"),
                       ("floor_ms", "floor")):
        ax.plot(ts, [r.get(key, float("nan")) for r in sweep], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (B=1, H=32, K=V=128)")
    ax.set_ylabel("ms per forward")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    timer = Timer(torch, device)
    copy_bw = copy_bandwidth(torch, device, timer)
    gpu = torch.cuda.get_device_name(0)
    wanted = set(filter(None, args.cases.split(",")))
    cases = [c for c in CASES if not wanted or c[0] in wanted]
    if not args.no_sweep:
        cases += [c for c in SWEEP if not wanted or c[0] in wanted]
    cases += [c for c in OTHER_WIDTHS if c[0] in wanted]
    rows = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        rows.append(run_case(torch, timer, case, args, copy_bw,
                             accuracy=(i == 0 or args.accuracy_all) and not args.no_accuracy))
        print("\n".join(table(rows[-1:], copy_bw, gpu).splitlines()[2:]), flush=True)
        print(f"  ({time.perf_counter() - t0:.1f} s; " + ", ".join(
            f"{k} {v:.1f} s" for k, v in rows[-1].items() if k.endswith("_s")) + ")", flush=True)
    text = table(rows, copy_bw, gpu)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_chunk.txt"), "w") as f:
        f.write(text + "\n")
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), gpu=gpu,
                  command=" ".join(sys.argv), copy_bandwidth=copy_bw, peak_flops=PEAK_FLOPS,
                  env={"FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA")},
                  versions=versions(torch), rows=rows)
    with open(os.path.join(args.out, "bench_chunk.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(rows, os.path.join(args.out, "bench_chunk.png"))


if __name__ == "__main__":
    main()
