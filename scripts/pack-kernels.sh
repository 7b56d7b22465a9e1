#!/usr/bin/env bash
# Packs the CUDA kernels' objects, compiled here for sm_90a, for the device harness: the
# device then links them instead of compiling them (about two of a short session's minutes;
# cmake/prebuilt_kernels.cmake checks that they are this tree's). Carry the archive with the
# device tool (it lies in .whl/); scripts/device-run.sh finds it there. Gzipped, because the
# device tool takes 64 MiB in all, the tree included (27 MB of objects -> 12; 61 -> 21 with
# -lineinfo).
#   scripts/pack-kernels.sh [DEST]    DEST defaults to .whl/kernels.tgz
# BUILD_DIR (default build) is reconfigured for what the device builds (Release, sm_90a,
# CUDA_FLAGS: none by default; -lineinfo for the harness's ncu stages, whose CMAKE_ARGS then
# name the same flags) and its kernels built; JOBS defaults to the core count.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
dest=${1:-.whl/kernels.tgz}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DFLASHDELTA_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" \
  -DFLASHDELTA_PREBUILT_KERNELS= >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target flashdelta_cuda_kernels
find "$build/CMakeFiles/flashdelta_cuda_kernels.dir" -name '*.cu.o' -exec cp {} "$stage/" \;
cp "$build/flashdelta_kernels.stamp" "$stage/"
mkdir -p "$(dirname "$dest")"
tar czf "$dest" -C "$stage" .
echo "packed $(ls "$stage"/*.o | wc -l) objects ($(du -sh "$dest" | cut -f1)) into $dest," \
  "stamp $(cat "$stage/flashdelta_kernels.stamp")"
