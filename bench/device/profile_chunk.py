"""One chunkwise forward of each implementation for a profiler (ncu / nsys) to time kernel by
kernel: KDA, B=1, T=8192, H=64, K=V=128, bf16, fla's headline options.

    ncu --metrics gpu__time_duration.sum python3 bench/device/profile_chunk.py
"""
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_chunk import Inputs, call_of  # noqa: E402

impls = sys.argv[1:] or ["ours"]
x = Inputs(torch, "kda", 1, 8192, 64, True)
for impl in impls:
    fn = call_of(impl, torch, x)
    fn()
    torch.cuda.synchronize()
