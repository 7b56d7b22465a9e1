"""bench/device/ncu_hotspots.py on a small export in the layout of ncu's source page (a
kernel's name, its file, a header row, then one row per source line; no GPU needed)."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "device", "ncu_hotspots.py")
_spec = importlib.util.spec_from_file_location("ncu_hotspots", _PATH)
hotspots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hotspots)

HEADER = ["Line No", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_short_sb", "stall_wait", "L1 Wavefronts Shared Excessive"]
ROWS = [
    ["10", "  store(a);", "30", "100", "20", "10", "1,200"],
    ["11", "  x = exp2(y);", "60", "50", "55", "5", "0"],
    ["12", "  load(b);", "10", "25", "", "10", "300"],
]


def write_export(path, name="void ns::<unnamed>::kernel<(ns::G)2, (int)128>(ns::P)"):
    lines = [f'"Function Name","{name}"', '"File Path","/src/cuda/chunk.cuh"',
             ",".join(f'"{h}"' for h in HEADER)]
    lines += [",".join(f'"{c}"' for c in row) for row in ROWS]
    path.write_text("\n".join(lines) + "\n")


def test_sums_samples_stalls_and_excess_per_line(tmp_path):
    csv = tmp_path / "source.csv"
    write_export(csv)
    kernels = hotspots.read(str(csv))
    assert list(kernels) == ["kernel<2,128>"]
    lines = kernels["kernel<2,128>"]
    samples, instr, stalls, source, excess = lines[("chunk.cuh", 10)]
    assert (samples, instr, source) == (30, 100, "store(a);")
    assert stalls == {"short_sb": 20, "wait": 10}
    assert excess == {"L1 Wavefronts Shared Excessive": 1200}  # "1,200" read as a number
    assert lines[("chunk.cuh", 12)][2] == {"wait": 10}  # an empty cell counts nothing


def test_prints_the_lines_with_the_most_excess(tmp_path, capsys):
    csv = tmp_path / "source.csv"
    write_export(csv)
    hotspots.main([str(csv), "--top", "2"])
    out = capsys.readouterr().out
    assert "kernel<2,128>: 100 samples, 175 warp instructions" in out
    # the two hottest lines by samples, the hottest first
    assert out.index("chunk.cuh:11") < out.index("chunk.cuh:10")
    assert "chunk.cuh:12 [" not in out
    excess = out[out.index("L1 Wavefronts Shared Excessive: 1500 in all"):]
    assert "80.0%  chunk.cuh:10" in excess and "20.0%  chunk.cuh:12" in excess
    assert "chunk.cuh:11" not in excess  # no excess: not listed
