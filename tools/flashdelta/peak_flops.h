// The machine's float32 multiply-add peak, measured: the denominator of every "% of peak"
// the benchmark reports.
#pragma once

namespace flashdelta::cli {

// GFLOP/s of independent vector FMA chains on `threads` threads (at most one per core) for
// about `seconds` of CPU time, at the widest SIMD target Highway dispatches to on this CPU.
// Counted in per-thread CPU time, so other processes on a shared machine do not lower it.
double measure_peak_gflops(int threads, double seconds);

}  // namespace flashdelta::cli
