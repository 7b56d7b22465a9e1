#!/usr/bin/env bash
# Packs the CUDA kernels' objects, compiled here for sm_90a, for the device harness: the
# device then links them instead of compiling them (about two of a short session's minutes;
# cmake/prebuilt_kernels.cmake checks that they are this tree's). Carry the archive with the
# device tool (it lies in .whl/); scripts/device-run.sh finds it there. Gzipped, because the
# device tool takes 64 MiB in all, the tree included (27 MB of objects -> 12; 61 -> 21 with
# -lineinfo).
#   scripts/pack-kernels.sh [DEST]    DEST defaults to .whl/kernels.tgz in the repository
# BUILD_DIR (default build-kernels in the repository, a folder of its own: it is configured
# afresh each time) is configured as the device builds (Ninja, Release, sm_90a, CUDA_FLAGS:
# none by default; -lineinfo for the harness's ncu stages, whose CMAKE_ARGS then name the
# same flags) and its kernels built; JOBS defaults to the core count.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$(realpath -m "${1:-$root/.whl/kernels.tgz}")
build=$(realpath -m "${BUILD_DIR:-$root/build-kernels}")
stage=$(mktemp -d)
trap 'rm -rf "$stage" "$dest.tmp"' EXIT
cmake --fresh -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHDELTA_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" \
  -DFLASHDELTA_PREBUILT_KERNELS= -DFLASHDELTA_BUILD_TESTS=OFF -DFLASHDELTA_BUILD_TOOLS=OFF \
  >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target flashdelta_cuda_kernels
mapfile -t objects < "$build/flashdelta_kernel_objects-Release.txt"
cp "${objects[@]}" "$stage/"  # absolute paths, one per kernel source
cp "$build/flashdelta_kernels.stamp" "$stage/"
mkdir -p "$(dirname "$dest")"
tar czf "$dest.tmp" -C "$stage" . && mv "$dest.tmp" "$dest"
echo "packed $(ls "$stage"/*.o | wc -l) objects ($(du -sh "$dest" | cut -f1)) into $dest," \
  "stamp $(cat "$stage/flashdelta_kernels.stamp")"
