#!/usr/bin/env bash
# The Python package end to end, as a user gets it: a virtual environment under build-py/,
# the test dependencies from PyPI (torch, numpy, pytest, and flash-linear-attention's ops
# for the comparison with its naive references), `pip install .`, then pytest.
#   PYTHON           interpreter for the environment (default python3; needs venv and headers)
#   TORCH_INDEX_URL  an alternative package index for torch (default: PyPI)
#   JOBS             build parallelism (default: the core count)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=build-py/venv
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)}

if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -m venv "$venv"; then
    echo "error: '$python -m venv' failed: install python3-venv and python3-dev" >&2
    exit 1
  fi
fi
# No pip cache: torch and its CUDA libraries are several GB of wheels, which would otherwise
# sit on disk twice (CI once ran out of disk here).
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q
     --no-cache-dir)

# torch resolves to ~3 GB of wheels that install to ~5.3 GB (torch 2.15, its CUDA libraries and
# Triton). One pip call holds every downloaded wheel until the last one is installed, so it
# needs both at once (CI once failed so with 8 GB free); resolving first and installing one
# wheel per call needs the installed size and one wheel.
install_one_at_a_time() {
  local report=build-py/resolved.json
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --dry-run --report "$report" "$@"
  "$venv/bin/python" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])' "$report" |
  while read -r requirement; do
    "${pip[@]}" --no-deps "$requirement" "${@:2}"
  done
  "$venv/bin/python" -m pip check
}
echo "-- test dependencies"
"${pip[@]}" --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  install_one_at_a_time torch --index-url "$TORCH_INDEX_URL"
else
  install_one_at_a_time torch
fi
"${pip[@]}" numpy pytest
# fla-core is flash-linear-attention's ops package (pure Python + Triton); its naive
# references run on the CPU. Pinned: the tests record its 0.6.0 signatures. Optional.
if "${pip[@]}" "fla-core==0.6.0" einops &&
   "$venv/bin/python" -W ignore -c "import fla.ops.kda.naive" 2>/dev/null; then
  echo "-- flash-linear-attention importable: comparing with its naive references"
else
  echo "-- flash-linear-attention not importable here: its comparison tests are skipped"
fi

echo "-- pip install . ($(df -h --output=avail . | tail -n 1 | tr -d ' ') free)"
"${pip[@]}" .
# From outside the source tree: `import flashdelta` must find the installed package.
(cd build-py && venv/bin/python -c "import flashdelta; print('flashdelta', \
flashdelta.__version__, 'from', flashdelta.__file__, '| SIMD', flashdelta.cpu_simd_target())")

echo "-- pytest"
status=0
"$venv/bin/python" -m pytest -p no:cacheprovider -q tests/python || status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests from tests/python" >&2
  exit 1
fi
exit "$status"
