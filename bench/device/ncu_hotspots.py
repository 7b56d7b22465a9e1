#!/usr/bin/env python3
"""Per-source-line hot spots of CUDA kernels from an Nsight Compute source export.

ncu attributes warp-stall samples and executed instructions to SASS instructions and, with
-lineinfo, to the CUDA source lines they came from. This sums them per kernel and source
line and prints the lines with the most samples, with each line's two largest stall
reasons, then, for each "...Excessive" column of the export (e.g. shared-memory wavefronts
beyond the minimum: bank conflicts), the lines with the most. It is how the chunk kernels'
per-element loads, column factors and record fetch were found (bench/NOTES.md, 2026-11-30
(d)).

On the device (a -lineinfo build of the program, e.g. CMAKE_CUDA_FLAGS=-lineinfo):
    ncu --section SourceCounters --section WarpStateStats --import-source yes \\
        -k regex:"chunk_(prepare|state)" -c 2 -o prof ./flashdelta_cuda_chunk_bench --only kda_T8192_H64 --reps 1
    ncu -i prof.ncu-rep --page source --csv --print-source cuda,sass > source.csv
Then, anywhere:
    python3 bench/device/ncu_hotspots.py source.csv --top 25
"""
import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
INSTRUCTIONS = "Instructions Executed"


def short_kernel(name):
    """The kernel's name without namespaces, with its template arguments' values:
    'void ns::<unnamed>::k<(ns::GateForm)2, (int)128>(ns::P)' -> 'k<2,128>'."""
    name = re.sub(r"^void |<unnamed>::|\(anonymous namespace\)::", "", name)
    base = re.split(r"[<(]", name, maxsplit=1)[0].split("::")[-1]
    rest = name[len(name.split(base, 1)[0]) + len(base):]
    if not rest.startswith("<"):
        return base
    values = re.findall(r"\)\s*(-?\w+)", rest[:rest.find(">") + 1])
    return f"{base}<{','.join(values)}>"


def count(text):
    """An ncu number ('1,234' or '1234'), or None for an empty or other cell."""
    text = text.replace(",", "").strip()
    return int(text) if text.isdigit() else None


def read(path):
    """{kernel: {(file, line): [samples, instructions, Counter(stall reason), source,
    Counter(excess metric)]}}."""
    kernels = collections.defaultdict(dict)
    file = kernel = None
    header = None
    with open(path, newline="") as fh:
        for row in csv.reader(fh):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Function Name":
                kernel = short_kernel(row[1])
            elif row[0] == "Line No":
                header = row
            elif row[0].isdigit() and header and kernel:
                col = {h: i for i, h in reversed(list(enumerate(header)))}
                try:
                    samples, instr = int(row[col[SAMPLES]]), int(row[col[INSTRUCTIONS]])
                except (KeyError, ValueError):
                    continue
                entry = kernels[kernel].setdefault(
                    (file, int(row[0])),
                    [0, 0, collections.Counter(), row[1].strip(), collections.Counter()])
                entry[0] += samples
                entry[1] += instr
                for i, h in enumerate(header):
                    n = count(row[i]) if i < len(row) else None
                    if n is None:
                        continue
                    if h.startswith("stall_") and "Not Issued" not in h:
                        entry[2][h[len("stall_"):]] += n
                    elif "Excessive" in h:
                        entry[4][h] += n
    return kernels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --page source --csv --print-source cuda,sass output")
    p.add_argument("--top", type=int, default=25, help="lines per kernel")
    p.add_argument("--top-excess", type=int, default=10,
                   help='lines per kernel and "...Excessive" column')
    args = p.parse_args(argv)
    kernels = read(args.csv)
    if not kernels:
        sys.exit(f"{args.csv}: no source lines with '{SAMPLES}' (was it built with -lineinfo?)")
    for kernel, lines in kernels.items():
        total_s = sum(e[0] for e in lines.values()) or 1
        total_i = sum(e[1] for e in lines.values()) or 1
        stalls = sum((e[2] for e in lines.values()), collections.Counter())
        print(f"{kernel}: {total_s} samples, {total_i} warp instructions; stalls "
              + ", ".join(f"{r} {100 * n // total_s}%" for r, n in stalls.most_common(7)))
        print(f"{'samples':>8} {'instr':>6}  line  [top stalls, % of the line]  source")
        ranked = sorted(lines.items(), key=lambda kv: -kv[1][0])[:args.top]
        for (file, line), (s, i, reasons, source, _) in ranked:
            top = ", ".join(f"{r} {100 * n // max(s, 1)}" for r, n in reasons.most_common(2))
            print(f"{100 * s / total_s:7.1f}% {100 * i / total_i:5.1f}%  {file}:{line} [{top}]  "
                  f"{source[:70]}")
        excess = sum((e[4] for e in lines.values()), collections.Counter())
        for metric, total in sorted(excess.items()):
            if total == 0:
                continue
            print(f"  {metric}: {total} in all; the lines with the most")
            ranked = sorted(lines.items(), key=lambda kv: -kv[1][4][metric])[:args.top_excess]
            for (file, line), entry in ranked:
                if entry[4][metric]:
                    print(f"{100 * entry[4][metric] / total:7.1f}%  {file}:{line}  {entry[3][:70]}")
        print()


if __name__ == "__main__":
    main()
