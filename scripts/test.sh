#!/usr/bin/env bash
# Every test: the ctest suite (Release, warnings as errors; with CUDA where nvcc is found,
# the GPU tests skipping on a machine without a GPU, and the library compiled for sm_80
# too), the same suite under AddressSanitizer + UndefinedBehaviorSanitizer, and the
# libFuzzer targets for a bounded time. FUZZ_SECONDS (default 60) bounds each fuzzer; JOBS
# defaults to the core count. PRUNE_BUILD_TREES=1 (set by .ci/run) removes the sm_80,
# sanitizer and fuzzer build trees once their stage has passed, and the main one before the
# Python stage, leaving the disk to its torch.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
fuzz_seconds=${FUZZ_SECONDS:-60}
prune=${PRUNE_BUILD_TREES:-0}
disk() { echo "-- disk: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free"; }
disk

scripts/install-deps.sh

echo "== build and test (Release, -Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFLASHDELTA_WERROR=ON
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"

# Where the build above found nvcc (check_language caches its path, else NOTFOUND):
if grep -Eq "^CMAKE_CUDA_COMPILER:[A-Z]+=/" build/CMakeCache.txt; then
  # The kernels are built for sm_90a above; the README promises they build for sm_80 and later
  # too, and sm_90-only instructions (wgmma, bulk copies) must stay behind their guards. This
  # compiles the kernels alone for sm_80 (their object library); it cannot run them here.
  echo "== build the library's CUDA kernels for sm_80 (compile only, -Werror)"
  cmake -S . -B build-sm80 -DCMAKE_BUILD_TYPE=Release -DFLASHDELTA_WERROR=ON \
    -DFLASHDELTA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=80 -DFLASHDELTA_BUILD_TESTS=OFF \
    -DFLASHDELTA_BUILD_TOOLS=OFF
  cmake --build build-sm80 -j "$jobs" --target flashdelta_cuda_kernels
  if [ "$prune" = 1 ]; then rm -rf build-sm80; fi
fi

echo "== build and test under AddressSanitizer + UndefinedBehaviorSanitizer"
# (host code only: the CUDA kernels are checked by compute-sanitizer on a GPU machine,
# scripts/device-run.sh)
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHDELTA_WERROR=ON \
  -DFLASHDELTA_SANITIZE=address,undefined -DFLASHDELTA_CUDA=OFF
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs"
if [ "$prune" = 1 ]; then rm -rf build-asan; fi
disk

echo "== fuzz the file reader and argument validation (${fuzz_seconds} s each)"
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DFLASHDELTA_FUZZ=ON -DFLASHDELTA_CUDA=OFF \
  -DFLASHDELTA_BUILD_TESTS=OFF -DFLASHDELTA_BUILD_TOOLS=OFF
cmake --build build-fuzz -j "$jobs"
fuzz/run_fuzzers.sh build-fuzz "$fuzz_seconds"
if [ "$prune" = 1 ]; then rm -rf build-fuzz build; fi
disk
echo "== Python package: pip install . and pytest"
scripts/test-python.sh
echo "== all tests passed"
