"""Training step (forward + backward) on the GPU: FlashDelta vs fla's Triton kernels, side by
side in one process, on the same inputs (issue 6's cases).

  fla   fla.ops.kda.chunk_kda / fla.ops.gated_delta_rule.chunk_gated_delta_rule, with
        FLA_FLASH_KDA=0 (the Triton path, not the CUTLASS FlashKDA kernel)
  ours  flashdelta.chunk_kda / chunk_gated_delta_rule: the same call, the same keywords; on
        CUDA tensors autograd runs the chunkwise CUDA backward (src/cuda/backward*)
  kept  ours with disable_recompute=True (KDA only, as fla's signature has it): the forward
        keeps its per-chunk states for the backward instead of the backward recomputing them
        (issue 6's opt-in: memory for time)

Every case is the training form: bf16 q, k, v, g, beta, K = V = 128, q/k L2 norm in the
kernel (use_qk_l2norm_in_kernel=True), a precomputed log-space gate (no gate activation in
the kernel; per key channel [B, T, HV, K] for KDA, scalar [B, T, HV] for Gated DeltaNet),
beta already in (0, 1) (sigmoid taken outside), an fp32 initial state [B, HV, K, V] that
requires grad, and the final state out. Every input is a leaf with requires_grad=True.

One step = the forward call + torch.autograd.backward of (o, final_state) with fixed random
gradients (d_o, d_final, made once per case); the .grad fields are set to None before each
step. Timing: CUDA events around each step with the stream held by torch.cuda._sleep while
the host queues the steps (GPU time of every kernel a step launches, allocations included);
median of --reps steps after --warmup. fla's first call autotunes its kernels (tens of
seconds per shape); it is recorded apart (*_first_call_s) and never timed.

Peak memory: torch.cuda.reset_peak_memory_stats(), one step, then max_memory_allocated()
minus what was allocated before the step (inputs and d_o/d_final excluded; the gradients the
step produces, its saved activations and workspaces included), in MiB.

Gradients vs fla: max |ours - fla| / max |fla| per gradient, from the last step of each.

--variants also times ours under other settings of its environment variables, in the same
process, each reported with its largest gradient difference from ours: a comma-separated
list of variants, each NAME=VALUE pairs joined by '+', e.g.
    --variants FLASHDELTA_BACKWARD_SCANS=tiles
FLASHDELTA_BACKWARD_SCANS=tiles runs the tile scans instead of the scans with the state in
tensor-core registers (the default for K <= 128).
FLASHDELTA_BACKWARD_SCAN_COLUMNS sets the tile scans' columns per block (`auto` when unset;
every output column is summed in the same order at any width: expected difference 0), e.g.
FLASHDELTA_BACKWARD_SCANS=tiles+FLASHDELTA_BACKWARD_SCAN_COLUMNS=32.
FLASHDELTA_BACKWARD_GATE_PAIRS=general runs a scalar gate (Gated DeltaNet) through the vector
gate's per-channel records and gradient kernels instead of its own short form.

Accuracy (first case, at B=2 T=1024 H=4 with the same options, so that fp64 is affordable):
dq, dk, dv, dg, dbeta, dh0 of fla and of FlashDelta against torch autograd of an fp64
token-by-token recurrence run on the GPU from the same bf16 inputs; max |got - ref| / max
|ref| per gradient.

fla's Gated DeltaNet backward is known to fail with Triton 3.6 on Hopper: its error is
recorded and ours is reported without a ratio. Every implementation fails soft.

Targets (speedup over fla): kda_B8_T4096_H16 2.5x (fla measured 10.17 ms forward + backward in
an earlier run), kda_B1_T32768_H16 3x, kda_gva_B8_T4096_H8_HV16 2.5x.

Outputs under --out: bench_backward.txt, bench_backward.json (both rewritten after every case,
so a run cut short keeps the cases it finished).

    FLA_FLASH_KDA=0 python3 bench/device/bench_backward.py --out $OUT
"""

import argparse
import datetime
import json
import os
import sys
import time
import traceback

os.environ.setdefault("FLA_FLASH_KDA", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import Timer, environment_of, error_text, versions  # noqa: E402

MIB = 1 << 20
DEVICE = "cuda"  # where Inputs lives (a check of this script's logic may point it at the CPU)
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")  # in the order of Inputs.NAMES


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--variants", default="",
                   help="comma-separated variants of ours to time beside it, each NAME=VALUE "
                        "environment settings joined by '+'")
    p.add_argument("--no-timing", action="store_true",
                   help="only the accuracy (fla autotunes each shape: the two rarely fit one call)")
    return p.parse_args(argv)


# name, mechanism, B, T, H (q/k heads), HV (v/g/beta heads), target speedup (issue 6)
CASES = [
    ("kda_B8_T4096_H16", "kda", 8, 4096, 16, 16, 2.5),
    ("kda_B1_T32768_H16", "kda", 1, 32768, 16, 16, 3.0),
    ("kda_gva_B8_T4096_H8_HV16", "kda", 8, 4096, 8, 16, 2.5),
    ("gdn_B8_T4096_H16", "gdn", 8, 4096, 16, 16, None),
]
# The accuracy shape: small enough for an fp64 recurrence under autograd (a few GiB).
ACCURACY_SHAPE = dict(B=2, T=1024, H=4)


class Inputs:
    """The leaves of one case (requires_grad) and the fixed gradients of its outputs."""

    NAMES = ("q", "k", "v", "g", "beta", "h0")

    def __init__(self, torch, mech, B, T, H, HV, K=128, V=128, seed=0):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        bf = torch.bfloat16
        rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
        self.mech, self.B, self.T, self.H, self.HV, self.K, self.V = mech, B, T, H, HV, K, V
        self.q = rn(B, T, H, K).to(bf)
        self.k = rn(B, T, H, K).to(bf)
        self.v = rn(B, T, HV, V).to(bf)
        # Log-space decay, mostly close to 0 (a realistic forget rate): per key channel for
        # KDA, one scalar per token and head for Gated DeltaNet.
        gate_shape = (B, T, HV, K) if mech == "kda" else (B, T, HV)
        self.g = torch.nn.functional.logsigmoid(rn(*gate_shape) + 4).to(bf)
        self.beta = torch.sigmoid(rn(B, T, HV)).to(bf)  # in (0, 1): no sigmoid in the kernel
        self.h0 = rn(B, HV, K, V) * 0.1                 # fp32, K-first (fla's default)
        for t in self.leaves():
            t.requires_grad_()
        self.d_o = rn(B, T, HV, V).to(bf)
        self.d_final = rn(B, HV, K, V)

    def leaves(self):
        return [getattr(self, n) for n in self.NAMES]

    def clear_grads(self):
        for t in self.leaves():
            t.grad = None

    def grads(self):
        return [t.grad for t in self.leaves()]

    def kwargs(self):
        return dict(initial_state=self.h0, output_final_state=True, use_qk_l2norm_in_kernel=True)


def function_of(impl, mech):
    """The function impl ('fla', 'ours', 'kept' or a variant of ours) calls, or None where it
    has none."""
    if impl == "kept" and mech != "kda":
        return None
    if impl == "fla":
        if mech == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    else:
        import flashdelta
        fn = flashdelta.chunk_kda if mech == "kda" else flashdelta.chunk_gated_delta_rule
    return fn


def step_of(impl, torch, x):
    """One training step of impl on x: forward, then backward of (o, final state)."""
    fn = function_of(impl, x.mech)
    kw = dict(x.kwargs(), disable_recompute=True) if impl == "kept" else x.kwargs()

    def step():
        x.clear_grads()  # host only: frees the last step's gradients, launches nothing
        o, final = fn(x.q, x.k, x.v, x.g, x.beta, **kw)
        torch.autograd.backward((o, final), (x.d_o, x.d_final))
    return step


def peak_extra_bytes(torch, x, step):
    """Peak memory of one step above what was allocated before it (inputs, d_o, d_final)."""
    x.clear_grads()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def max_rel(torch, got, ref):
    ref = ref.to(torch.float64)
    scale = ref.abs().max().item()
    return (got.to(torch.float64) - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def reference_grads(torch, x):
    """Gradients of sum(o * d_o) + sum(S_T * d_final) through an fp64 token-by-token
    recurrence on the GPU, from the same (bf16-rounded) inputs, vectorised over batch and
    heads (T steps). Per value head, state S [K, V]:
        S = exp(g_t)[:, None] * S;  r = beta_t (v_t - k_t S);  S = S + k_t r^T;
        o_t = (scale q_t) S,   q and k L2-normalised first, scale = K^-0.5."""
    f = torch.float64
    leaves = [t.detach().to(f).requires_grad_() for t in x.leaves()]
    q, k, v, g, beta, h0 = leaves
    l2 = lambda a: a / torch.sqrt((a * a).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    rep = x.HV // x.H  # GVA: value head j reads key head j // rep (as fla)
    qn = l2(q).repeat_interleave(rep, dim=2) * x.K ** -0.5
    kn = l2(k).repeat_interleave(rep, dim=2)
    decay = torch.exp(g) if g.dim() == 4 else torch.exp(g).unsqueeze(-1)  # [B, T, HV, K|1]
    S, outs = h0, []
    for t in range(x.T):
        S = decay[:, t].unsqueeze(-1) * S
        r = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kn[:, t], S))
        S = S + kn[:, t].unsqueeze(-1) * r.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", qn[:, t], S))
    o = torch.stack(outs, dim=1)
    loss = (o * x.d_o.to(f)).sum() + (S * x.d_final.to(f)).sum()
    return torch.autograd.grad(loss, leaves)


def accuracy(torch, case, variants=()):
    """fla's and our gradients (recomputed and kept chunk states, and the variants of ours)
    against the fp64 reference, on the accuracy shape with the first case's mechanism and GVA
    ratio."""
    _, mech, _, _, H, HV, _ = case
    s = ACCURACY_SHAPE
    x = Inputs(torch, mech, s["B"], s["T"], s["H"], s["H"] * HV // H, seed=1)
    res = dict(mechanism=mech, B=x.B, T=x.T, H=x.H, HV=x.HV)
    t0 = time.perf_counter()
    ref = reference_grads(torch, x)
    torch.cuda.synchronize()
    res["reference_s"] = time.perf_counter() - t0
    res["variants"] = list(variants)
    for impl in ["ours", "kept", *variants, "fla"]:
        if function_of(impl, mech) is None:
            continue
        try:
            with environment_of(impl):
                step_of(impl, torch, x)()
            res[impl] = {n: max_rel(torch, got, r) for n, got, r in zip(GRADS, x.grads(), ref)}
        except Exception as e:  # noqa: BLE001 (fail soft)
            res[impl + "_error"] = error_text(e)
            traceback.print_exc()
        x.clear_grads()
    del x, ref
    torch.cuda.empty_cache()
    return res


def run_case(torch, timer, case, args):
    name, mech, B, T, H, HV, target = case
    x = Inputs(torch, mech, B, T, H, HV)
    row = dict(name=name, mechanism=mech, B=B, T=T, H=H, HV=HV, K=x.K, V=x.V,
               target_speedup=target)
    grads = {}
    variants = list(filter(None, args.variants.split(",")))
    # Ours first: should fla's kernels leave the CUDA context broken, ours is measured.
    for impl in ["ours", "kept", *variants, "fla"]:
        if function_of(impl, mech) is None:
            continue
        try:
            with environment_of(impl):
                step = step_of(impl, torch, x)
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                row[impl + "_first_call_s"] = time.perf_counter() - t0  # compile / autotune
                t = timer.per_call(lambda i: step(), 1, args.reps, args.warmup)
                row[impl + "_ms"] = t["median"] * 1e3
                row[impl + "_p10_ms"], row[impl + "_p90_ms"] = t["p10"] * 1e3, t["p90"] * 1e3
                row[impl + "_peak_mib"] = peak_extra_bytes(torch, x, step) / MIB
                grads[impl] = x.grads()
        except Exception as e:  # noqa: BLE001 (fail soft)
            row[impl + "_error"] = error_text(e)
            traceback.print_exc()
        x.clear_grads()
    if "fla" in grads and "ours" in grads:
        row["grad_diff_vs_fla"] = {n: max_rel(torch, o, f)
                                   for n, o, f in zip(GRADS, grads["ours"], grads["fla"])}
    if "fla_ms" in row and "ours_ms" in row:
        row["speedup"] = row["fla_ms"] / row["ours_ms"]
        if target:
            row["meets_target"] = row["speedup"] >= target
    if "fla_ms" in row and "kept_ms" in row:
        row["kept_speedup"] = row["fla_ms"] / row["kept_ms"]
    row["variants"] = variants
    for impl in ["kept", *variants]:
        if "ours" in grads and impl in grads:
            row[impl + "_grad_diff_vs_ours"] = {
                n: max_rel(torch, k, o) for n, k, o in zip(GRADS, grads[impl], grads["ours"])}
        if "fla_ms" in row and impl + "_ms" in row and impl != "kept":
            row[impl + "_speedup"] = row["fla_ms"] / row[impl + "_ms"]
    del x, grads
    torch.cuda.empty_cache()
    return row


def fmt(v, spec):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    return "-".rjust(int(spec.split(".")[0] or 1))


def one_line(text, n=300):
    return " ".join(text.split())[:n]


def table(rows, acc, gpu, args):
    lines = [f"# training step (forward + backward), {gpu}; times in ms (median of {args.reps}); "
             "speedup = fla / ours; MiB = peak memory of a step above its inputs",
             f"{'case':<27}{'fla':>9}{'ours':>9}{'speedup':>9}{'target':>8}"
             f"{'fla MiB':>10}{'ours MiB':>10}{'vs fla':>9}"
             f"{'kept':>9}{'speedup':>9}{'kept MiB':>10}{'vs ours':>9}"]
    for r in rows:
        diff = max(r["grad_diff_vs_fla"].values()) if "grad_diff_vs_fla" in r else None
        kept_diff = (max(r["kept_grad_diff_vs_ours"].values())
                     if "kept_grad_diff_vs_ours" in r else None)
        lines.append(f"{r['name']:<27}{fmt(r.get('fla_ms'), '9.3f')}{fmt(r.get('ours_ms'), '9.3f')}"
                     f"{fmt(r.get('speedup'), '9.2f')}{fmt(r.get('target_speedup'), '8.1f')}"
                     f"{fmt(r.get('fla_peak_mib'), '10.0f')}{fmt(r.get('ours_peak_mib'), '10.0f')}"
                     f"{fmt(diff, '9.1e')}{fmt(r.get('kept_ms'), '9.3f')}"
                     f"{fmt(r.get('kept_speedup'), '9.2f')}{fmt(r.get('kept_peak_mib'), '10.0f')}"
                     f"{fmt(kept_diff, '9.1e')}")
        for impl in r.get("variants", []):
            if impl + "_ms" not in r:
                continue
            d = r.get(impl + "_grad_diff_vs_ours")
            lines.append(f"    ours with {impl}: {r[impl + '_ms']:.3f} ms, speedup "
                         f"{fmt(r.get(impl + '_speedup'), '.2f')}, peak "
                         f"{fmt(r.get(impl + '_peak_mib'), '.0f')} MiB, gradients vs ours "
                         f"{fmt(max(d.values()) if d else None, '.1e')}")
        for impl in ["fla", "ours", "kept", *r.get("variants", [])]:
            if impl + "_error" in r:
                lines.append(f"    {impl}: {one_line(r[impl + '_error'])}")
    lines.append("  (vs fla: the largest max |ours - fla| / max |fla| over the six gradients; kept:"
                 " ours with disable_recompute=True, the forward's chunk states kept; vs ours: its"
                 " largest difference from ours)")
    if acc:
        lines += ["", f"# accuracy: {acc['mechanism']} B={acc['B']} T={acc['T']} H={acc['H']} "
                  f"HV={acc['HV']}, gradients against an fp64 recurrence (torch autograd): "
                  "max |got - ref| / max |ref|",
                  f"{'grad':<8}{'fla':>10}{'ours':>10}{'kept':>10}"]
        for n in GRADS:
            lines.append(f"{n:<8}{fmt(acc.get('fla', {}).get(n), '10.1e')}"
                         f"{fmt(acc.get('ours', {}).get(n), '10.1e')}"
                         f"{fmt(acc.get('kept', {}).get(n), '10.1e')}")
        for impl in acc.get("variants", []):
            if impl in acc:
                lines.append(f"  ours with {impl}: " + ", ".join(
                    f"{n} {acc[impl][n]:.1e}" for n in GRADS))
        for impl in ["fla", "ours", "kept", *acc.get("variants", [])]:
            if impl + "_error" in acc:
                lines.append(f"    {impl}: {one_line(acc[impl + '_error'])}")
    return "\n".join(lines)


def save(args, rows, acc, gpu, torch):
    text = table(rows, acc, gpu, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_backward.txt"), "w") as f:
        f.write(text + "\n")
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), gpu=gpu,
                  command=" ".join(sys.argv), reps=args.reps, warmup=args.warmup,
                  env={"FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA")},
                  versions=versions(torch), rows=rows, accuracy=acc)
    with open(os.path.join(args.out, "bench_backward.json"), "w") as f:
        json.dump(record, f, indent=1)
    return text


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_backward.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    timer = Timer(torch, torch.device(DEVICE))
    gpu = torch.cuda.get_device_name(0)
    wanted = set(filter(None, args.cases.split(",")))
    unknown = wanted - {c[0] for c in CASES}
    if unknown:
        sys.exit(f"unknown cases: {', '.join(sorted(unknown))}; known: "
                 f"{', '.join(c[0] for c in CASES)}")
    cases = [c for c in CASES if not wanted or c[0] in wanted]
    rows, acc = [], None
    if cases and not args.no_accuracy:
        t0 = time.perf_counter()
        acc = accuracy(torch, cases[0], list(filter(None, args.variants.split(","))))
        print(f"accuracy ({time.perf_counter() - t0:.1f} s): {json.dumps(acc)}", flush=True)
        save(args, rows, acc, gpu, torch)
    for case in [] if args.no_timing else cases:
        t0 = time.perf_counter()
        rows.append(run_case(torch, timer, case, args))
        print(table(rows[-1:], None, gpu, args).splitlines()[2], flush=True)
        print(f"  ({time.perf_counter() - t0:.1f} s; " + ", ".join(
            f"{k} {v:.1f} s" for k, v in rows[-1].items() if k.endswith("_s")) + ")", flush=True)
        save(args, rows, acc, gpu, torch)  # after every case: a run cut short keeps its rows
    print(save(args, rows, acc, gpu, torch))


if __name__ == "__main__":
    main()
