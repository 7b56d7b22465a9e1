#!/usr/bin/env bash
# Runs every fuzz target for SECONDS on a copy of its seed corpus (the repository is never
# written) and fails if any target finds a crash, a sanitizer report, a timeout or an
# out-of-memory. Build the targets first (see fuzz/CMakeLists.txt).
#
#   fuzz/run_fuzzers.sh BUILD_DIR SECONDS
#
# A finding is left in a work directory, printed at the end, with the command that replays it.
set -euo pipefail

if [[ $# -ne 2 || ! "$2" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 BUILD_DIR SECONDS" >&2
  exit 2
fi
build_dir=$1
seconds=$2
fuzz_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
targets=(fuzz_safetensors fuzz_validation fuzz_backward)

work=$(mktemp -d "${TMPDIR:-/tmp}/flashdelta-fuzz.XXXXXX")
failed=()
for target in "${targets[@]}"; do
  binary=$build_dir/fuzz/$target
  if [[ ! -x $binary ]]; then
    echo "error: $binary not found; build it first (see fuzz/CMakeLists.txt)" >&2
    exit 2
  fi
  corpus=$work/$target/corpus
  artifacts=$work/$target/artifacts
  mkdir -p "$corpus" "$artifacts"
  cp "$fuzz_dir/corpus/$target/"* "$corpus/"
  options=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
           -artifact_prefix="$artifacts/")
  dict=$fuzz_dir/corpus/${target#fuzz_}.dict
  [[ -f $dict ]] && options+=(-dict="$dict")

  echo "== $target: ${seconds}s"
  if "$binary" "${options[@]}" "$corpus" >"$work/$target/log" 2>&1; then
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)|^Done' "$work/$target/log" || true
    grep -E 'cov: [0-9]+' "$work/$target/log" | tail -1 || true
  else
    failed+=("$target")
    tail -n 40 "$work/$target/log"
    for artifact in "$artifacts"/*; do
      [[ -e $artifact ]] && echo "finding: $artifact (replay: $binary $artifact)"
    done
  fi
done

if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]} (logs and findings in $work)" >&2
  exit 1
fi
rm -rf "$work"
echo "all fuzz targets ran ${seconds}s without a finding"
