"""Where a training step's GPU time goes, kernel by kernel: torch.profiler over a few steps of
bench_backward.py's cases, for ours (and variants of it) and fla, side by side.

    FLA_FLASH_KDA=0 python3 bench/device/profile_backward.py --cases kda_B8_T4096_H16 \
        --impls ours,FLASHDELTA_BACKWARD_SCANS=tiles,fla --out $OUT

Per implementation: every CUDA kernel's device time per step (the sum over its launches,
divided by the steps profiled), largest first, and the total. fla should be autotuned already
(bench_backward.py's first call, or a carried Triton cache): its first call is not profiled.
Output: profile_backward.txt under --out (rewritten after every implementation).
"""

import argparse
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_backward import CASES, Inputs, environment_of, step_of  # noqa: E402
from bench_decode import kernel_times  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="kda_B8_T4096_H16")
    p.add_argument("--impls", default="ours,fla",
                   help="comma-separated: ours, kept, fla, or variants NAME=VALUE[+NAME=VALUE]")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    import torch
    lines = []
    path = os.path.join(args.out, "profile_backward.txt")
    os.makedirs(args.out, exist_ok=True)
    for case in CASES:
        if case[0] not in args.cases.split(","):
            continue
        name, mech, B, T, H, HV, _ = case
        x = Inputs(torch, mech, B, T, H, HV)
        for impl in args.impls.split(","):
            try:
                with environment_of(impl):
                    step = step_of(impl, torch, x)
                    for _ in range(2):  # compile, autotune and allocate outside the profile
                        step()
                    torch.cuda.synchronize()
                    times = kernel_times(torch, step, args.steps)
            except Exception as e:  # noqa: BLE001 (fail soft: the other implementations run)
                lines.append(f"# {name} {impl}: {type(e).__name__}: {e}")
                continue
            lines.append(f"# {name} {impl}: {sum(t for t, _ in times.values()):.3f} ms of "
                         f"kernels per step ({len(times)} kernels)")
            for kname, (ms, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:args.top]:
                lines.append(f"  {ms:8.3f} ms  x{n:<4g} {kname[:110]}")
            x.clear_grads()
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
        del x
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
