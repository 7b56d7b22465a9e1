"""Summarises `ncu --csv --metrics gpu__time_duration.sum` output: per kernel, the count and
the median / min / max duration in microseconds, one line each, prefixed by a label.

usage: python3 ncu_durations.py LABEL FILE.csv
"""
import csv
import statistics
import sys


def durations(path):
    """{kernel name: [microseconds]} from an ncu CSV (rows after its preamble)."""
    with open(path, newline="") as f:
        lines = f.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return {}
    out = {}
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        units = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
        unit = row.get("Metric Unit", "")
        if unit not in units:
            raise ValueError(f"{path}: unknown unit {unit!r} of gpu__time_duration.sum")
        scale = units[unit]
        out.setdefault(row["Kernel Name"].split("(")[0][:60], []).append(value * scale)
    return out


def main():
    label, path = sys.argv[1], sys.argv[2]
    found = durations(path)
    if not found:
        print(f"{label}: no kernels profiled")
    for name, us in found.items():
        print(f"{label}: {name}  n={len(us)}  median {statistics.median(us):.2f} us  "
              f"min {min(us):.2f}  max {max(us):.2f}")


if __name__ == "__main__":
    main()
