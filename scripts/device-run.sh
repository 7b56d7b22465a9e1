#!/usr/bin/env bash
# FlashDelta's GPU harness, run on the device machine from the repository root with $OUT set:
# builds the C++ project with CUDA, runs the GPU tests (ctest -L cuda, compute-sanitizer),
# the CUDA Python tests and the decode benchmark, and leaves in $OUT:
#   device-run.log      everything, stage by stage, with a summary at the end
#   sanitizer.log       compute-sanitizer memcheck + racecheck (when that stage runs)
#   bench_decode.json / .txt / .png   the decode benchmark (bench/device/bench_decode.py)
#   bench_chunk.json / .txt / .png    the chunkwise forward benchmark (bench/device/bench_chunk.py)
#   bench_backward.json / .txt  the training-step benchmark, forward + backward (stage
#                bench-backward: bench/device/bench_backward.py; opt-in)
#   train_kda.txt  a short KDA training run, FlashDelta vs fla (stage train-example:
#                examples/train_kda.py; opt-in)
#   profile_backward.txt  the training step's kernel times (stage profile-backward; opt-in)
#   outputs.tgz  all of the above but device-run.log, when there are more than eight files
#                (the device tool brings back at most eight)
# A stage that fails is reported and the later ones still run where they can. Every stage
# has a timeout drawn from one time budget (BUDGET_S) that keeps a minimum for the stages
# after it, so the whole run ends in time; the benchmark skips the cases it has no time for.
#
# Nothing is fetched on the device: it reads what travels in .whl/ (git-ignored; name it in
# the device tool's `carry`): Python wheels (.whl/*.whl, installed into /tmp/site) and
# Debian packages of the C++ build dependencies (.whl/debs/*.deb: Highway, nlohmann-json,
# CLI11, GoogleTest; unpacked into /tmp/devdeps, never into /). See bench/device/README.md.
#
# Environment (all optional):
#   OUT          output folder (default: ./device-out)
#   FLASHDELTA_COMMIT  the commit the benchmarks' JSON records (versions.git); name it when
#                the tree is not a checkout of its own HEAD (the device tool copies the
#                working tree onto another commit's checkout), e.g. FLASHDELTA_COMMIT=9309d64
#   BUDGET_S     time budget of the whole run in seconds (default 450); below the sum of the
#                stages' minimums (MIN below) the run stops before any stage, with exit 2
#   STAGES       stages to run, in order (default: "info deps configure build ctest sanitize
#                pytest bench bench-chunk kernel-bench overhead pytest-all"); e.g.
#                STAGES="deps configure build bench". Opt-in stages, never in the default:
#                  bench-backward  FLA_FLASH_KDA=0 bench/device/bench_backward.py (forward +
#                                  backward vs fla; fla autotunes every new shape, so a full
#                                  run may need BUDGET_S=570 or --cases split over calls)
#                  train-example   examples/train_kda.py --steps 100 (-> train_kda.txt)
#                  profile-backward  bench/device/profile_backward.py (kernel times per
#                                  step, ours and fla; PROFILE_BACKWARD_ARGS)
#                  ncu-decode      the N=1 decode kernels' own durations under ncu, ours
#                                  and fla's (-> ncu_decode.txt)
#                  ncu-backward    ncu source counters of the backward's per-chunk kernels
#                                  (NCU_BACKWARD_KERNELS, one launch each) in a training
#                                  step, summed per source line (-> ncu_backward.txt, the
#                                  sections' details, ncu_backward_details.txt, and
#                                  the export itself, ncu_backward.csv.gz);
#                                  configure with CMAKE_ARGS=-DCMAKE_CUDA_FLAGS=-lineinfo
#                  ncu-chunk       the same for the chunk forward's kernels (NCU_CHUNK_KERNELS,
#                                  default prepare and state, one launch each) in one case of
#                                  the C++ bench (NCU_CHUNK_CASE, default kda_T8192_H64;
#                                  -> ncu_chunk.txt, ncu_chunk_details.txt, NCU_TOP lines
#                                  per kernel, default 40); builds need
#                                  flashdelta_cuda_chunk_bench and -lineinfo as above
#                  ncu-decode-lines  the same for the decode kernel: one launch in one case of
#                                  the C++ decode bench (NCU_DECODE_CASE, default
#                                  "N=256 HV=32 v_first"; -> ncu_decode_lines.txt,
#                                  ncu_decode_details.txt); builds need
#                                  flashdelta_cuda_decode_bench and -lineinfo
#                  baseline        another tree built and timed beside this one, in
#                                  the same call: BASELINE_TAR names a tar of it, carried
#                                  (e.g. `git archive <commit> -o .whl/base.tar`); it runs
#                                  that tree's own device-run.sh with BASELINE_STAGES
#                                  (default "configure build bench-chunk"),
#                                  BASELINE_BUILD_TARGETS (default _C; the decode tool for
#                                  its kernel-bench: flashdelta_cuda_decode_bench),
#                                  BASELINE_BENCH_CHUNK_ARGS, BASELINE_BENCH_ARGS,
#                                  BASELINE_KERNEL_BENCH_ARGS,
#                                  BASELINE_PROFILE_BACKWARD_ARGS and
#                                  BASELINE_BENCH_BACKWARD_ARGS (defaults: this run's;
#                                  name variants of this tree's in neither),
#                                  BASELINE_KERNEL_BENCH_VARIANTS (default none: a variable
#                                  of this tree may mean nothing there),
#                                  BASELINE_PREBUILT_KERNELS (default none: compiled) and
#                                  FLASHDELTA_COMMIT=BASELINE_COMMIT; needs deps earlier in
#                                  the run; -> baseline.tgz (its outputs) and its tables in
#                                  the log. bench-chunk-baseline: the same stage's old name
#                e.g. STAGES="deps configure build bench-backward" BUILD_TARGETS=_C
#   SANITIZE     1 (default): compute-sanitizer memcheck and racecheck on the CUDA test
#                binaries (SANITIZE_BINARIES); 0: skip
#   SANITIZE_BINARIES  which (default "test_cuda_recurrent test_cuda_chunk"; the backward's,
#                test_cuda_backward, takes long under the sanitizers: give it a filter)
#   SANITIZE_FILTER   --gtest_filter for the sanitizer runs (default: every test)
#   SANITIZE_ARGS     more compute-sanitizer options, e.g. "--kernel-name kns=states_mma_kernel"
#                (only kernels whose name contains it are checked; the others run at speed)
#   SANITIZE_MAX_S    the sanitize stage's longest time (default 150 s, shared equally by
#                memcheck and racecheck of each binary; racecheck of the backward's larger
#                tests needs several minutes)
#   SANITIZE_ENV environment assignments for the sanitizer runs only (e.g.
#                "FLASHDELTA_RECURRENT_TILE=wide": on V-first states `auto` picks the warp
#                kernel, so the block kernel's V-first path needs forcing)
#   PYTEST_ARGS  what the pytest stage runs (default: tests/python/test_cuda.py
#                tests/python/test_cuda_backward.py), e.g. "tests/python/test_cuda.py -k decode"
#   BENCH_ARGS   extra arguments for bench_decode.py (e.g. "--cases kda_n1,kda_n256")
#   BENCH_CHUNK_ARGS  extra arguments for bench_chunk.py (e.g. "--no-sweep")
#   BENCH_BACKWARD_ARGS  extra arguments for bench_backward.py (e.g.
#                "--cases kda_B8_T4096_H16 --no-accuracy")
#   CTEST_REGEX  ctest -R filter of the GPU tests (default: all of them)
#   KERNEL_BENCH_VARIANTS  environment assignments the kernel-bench stage reruns the C++
#                decode benchmark under, one run each (e.g. "FLASHDELTA_RECURRENT_TILE=wide
#                FLASHDELTA_RECURRENT_TILE=narrow"; several in one run joined by commas,
#                "A=1,B=off"); JSON in $OUT/kernel_bench-<the assignments>.json
#   KERNEL_BENCH_ARGS  extra arguments for its first run (e.g. "--sweep 1": N = 40 ... 256)
#   BUILD_TARGETS  CMake targets to build (default: all), e.g. "_C" for the Python module alone
#   JOBS         build parallelism (default: all cores)
#   CUDA_ARCH    CMAKE_CUDA_ARCHITECTURES (default 90a)
#   BUILD_TYPE   CMAKE_BUILD_TYPE (default Release)
#   BUILD_DIR    the CMake build folder (default build-device; kept between calls while the
#                machine stays warm, so a second run builds incrementally)
#   PREBUILT_KERNELS  the CUDA kernels' objects compiled elsewhere, an archive from
#                scripts/pack-kernels.sh (default: .whl/kernels.tgz where it exists; "" compiles
#                them): unpacked into the build folder and linked where their stamp is this
#                tree's, else compiled (cmake/prebuilt_kernels.cmake; the configure stage says so)
#   CMAKE_ARGS   extra configure arguments (CMAKE_CUDA_FLAGS is reset to none at each
#                configure unless they set it, e.g. -DCMAKE_CUDA_FLAGS=-lineinfo for the ncu
#                stages); FD_CUDA=OFF configures without CUDA (to check this script on a
#                machine without a GPU)
#   TRITON_CACHE_DIR  Triton's cache (default: .triton-cache in the tree). fla's kernels take
#                minutes of autotuning per new shape; Triton keeps the winners there
#                (*.autotune.json, keyed by Triton, GPU, kernel source and shape). The run
#                leaves them in $OUT/triton-autotune.tgz: unpack it into .triton-cache and
#                carry that folder in the next call, which then skips the tuning; or commit
#                it as bench/device/triton-autotune.tgz, which every run unpacks first (the
#                results then outlive the session: only the repository does).
set -uo pipefail
cd "$(dirname "$0")/.."
export ROOT=$PWD
export OUT=${OUT:-$ROOT/device-out}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/.triton-cache}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
# Autotuning results committed by an earlier session (never overwriting newer ones carried).
if [ -f bench/device/triton-autotune.tgz ]; then
  tar xzf bench/device/triton-autotune.tgz -C "$TRITON_CACHE_DIR" --skip-old-files
fi
export LOG=$OUT/device-run.log
export SANLOG=$OUT/sanitizer.log
: >"$LOG"
BUDGET_S=${BUDGET_S:-450}
STAGES=${STAGES:-"info deps configure build ctest sanitize pytest bench bench-chunk kernel-bench overhead pytest-all"}
export SANITIZE_BINARIES=${SANITIZE_BINARIES:-"test_cuda_recurrent test_cuda_chunk"}
export SANITIZE=${SANITIZE:-1} SANITIZE_FILTER=${SANITIZE_FILTER:-} SANITIZE_ENV=${SANITIZE_ENV:-} BENCH_ARGS=${BENCH_ARGS:-} BENCH_CHUNK_ARGS=${BENCH_CHUNK_ARGS:-} CTEST_REGEX=${CTEST_REGEX:-} KERNEL_BENCH_VARIANTS=${KERNEL_BENCH_VARIANTS:-} KERNEL_BENCH_ARGS=${KERNEL_BENCH_ARGS:-}
export BENCH_BACKWARD_ARGS=${BENCH_BACKWARD_ARGS:-} PROFILE_BACKWARD_ARGS=${PROFILE_BACKWARD_ARGS:-}
export NCU_BACKWARD_KERNELS=${NCU_BACKWARD_KERNELS:-"grads_kernel|records_kernel|keys_kernel"}
export NCU_CHUNK_KERNELS=${NCU_CHUNK_KERNELS:-"chunk_prepare_kernel|chunk_state_kernel"}
export NCU_CHUNK_CASE=${NCU_CHUNK_CASE:-kda_T8192_H64}
export NCU_DECODE_CASE=${NCU_DECODE_CASE:-"N=256 HV=32 v_first"}
export JOBS=${JOBS:-$(nproc)}
export CUDA_ARCH=${CUDA_ARCH:-90a}
export BUILD_TYPE=${BUILD_TYPE:-Release}
export BUILD=${BUILD_DIR:-$ROOT/build-device}
export FD_CUDA=${FD_CUDA:-ON} CMAKE_ARGS=${CMAKE_ARGS:-}
if [ -f .whl/kernels.tgz ]; then export PREBUILT_KERNELS=${PREBUILT_KERNELS-$ROOT/.whl/kernels.tgz}; fi
# python/flashdelta plus the module built in $BUILD (another for the baseline stage's tree)
export PKG=${PKG_DIR:-/tmp/fd-python}
export DEPS=/tmp/devdeps
export PYTHONUNBUFFERED=1
# Python: the package built here first, then the carried wheels.
export PYTHONPATH=$PKG:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# CMake 4 refuses packages that declare compatibility with CMake < 3.5; harmless on CMake 3.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
START=$SECONDS

# The longest each stage may take, and the least it is kept for it while earlier stages run.
# ctest: every GPU test takes ~215 s since the backward's run twice (f32_states., 2026-12-04).
declare -A MAX=([info]=30 [deps]=60 [configure]=120 [build]=360 [ctest]=330 [sanitize]=${SANITIZE_MAX_S:-150}
                [pytest]=150 [bench]=400 [bench-chunk]=480 [bench-backward]=540 [train-example]=240
                [profile-backward]=300 [kernel-bench]=150 [ncu-decode]=400 [ncu-backward]=300 [ncu-chunk]=240 [ncu-decode-lines]=240 [overhead]=40 [pytest-all]=150
                [baseline]=400 [bench-chunk-baseline]=400)
declare -A MIN=([info]=5 [deps]=10 [configure]=30 [build]=60 [ctest]=30 [sanitize]=40
                [pytest]=40 [bench]=90 [bench-chunk]=60 [bench-backward]=90 [train-example]=60
                [profile-backward]=60 [kernel-bench]=10 [ncu-decode]=60 [ncu-backward]=60 [ncu-chunk]=60 [ncu-decode-lines]=60 [overhead]=15 [pytest-all]=0
                [baseline]=160 [bench-chunk-baseline]=160)

log() { echo "$*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }

declare -a SUMMARY=()
FAILED=0

stage_info() {
  set -x
  date -u
  uname -a
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  nvcc --version | tail -2
  cmake --version | head -1
  ninja --version
  c++ --version | head -1
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer
  python3 -c 'import sys, sysconfig, os; inc = sysconfig.get_paths()["include"]; print(sys.version, sys.executable); print("Python.h:", inc, os.path.exists(os.path.join(inc, "Python.h")))'
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "| triton", triton.__version__); print("DLPack C exchange API:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))'
  python3 -m nanobind --version
  nproc
  ls -la .whl .whl/debs
  true
}

stage_deps() {
  set -e
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    ls /tmp/site
  else
    echo "no wheels in .whl/: the fla comparisons will be skipped (carry .whl)"
  fi
  if ls .whl/debs/*.deb >/dev/null 2>&1; then
    mkdir -p "$DEPS"
    for f in .whl/debs/*.deb; do dpkg -x "$f" "$DEPS"; done
    echo "unpacked $(ls .whl/debs/*.deb | wc -l) packages into $DEPS"
  else
    echo "no .whl/debs/: relying on the system's Highway, nlohmann-json, CLI11, GoogleTest"
  fi
  python3 -W ignore -c 'import fla; print("fla", fla.__version__, "from", fla.__file__)' || true
}

stage_configure() {
  # The prebuilt kernels are unpacked into the build folder (each tree's its own), and
  # CMAKE_CUDA_FLAGS is reset each time (CMAKE_ARGS may set it again): a warm folder keeps
  # neither another archive's objects nor an earlier call's -lineinfo.
  # Without CUDA the project has no such variable; with it, "" clears an earlier call's.
  local prebuilt=()
  [ "$FD_CUDA" = OFF ] || prebuilt=(-DFLASHDELTA_PREBUILT_KERNELS=)
  if [ -n "${PREBUILT_KERNELS:-}" ] && [ "$FD_CUDA" != OFF ]; then
    local dir=$BUILD/prebuilt-kernels-unpacked
    if rm -rf "$dir" && mkdir -p "$dir" && tar xzf "$PREBUILT_KERNELS" -C "$dir"; then
      prebuilt=(-DFLASHDELTA_PREBUILT_KERNELS="$dir")
    else
      echo "!! cannot unpack PREBUILT_KERNELS=$PREBUILT_KERNELS: compiling the kernels"
    fi
  fi
  # shellcheck disable=SC2206
  local common=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE"
                -DFLASHDELTA_CUDA="$FD_CUDA" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH"
                -DCMAKE_PREFIX_PATH="$DEPS/usr" -DPython_EXECUTABLE="$(command -v python3)"
                -DCMAKE_CUDA_FLAGS= "${prebuilt[@]}" $CMAKE_ARGS)
  local rc=0
  if ! cmake "${common[@]}" -DFLASHDELTA_PYTHON=ON; then
    echo "!! configuring with the Python module failed; configuring without it"
    rm -f "$BUILD/CMakeCache.txt"
    cmake "${common[@]}" -DFLASHDELTA_PYTHON=OFF
    rc=1
  fi
  if [ -n "${PREBUILT_KERNELS:-}" ] && ! grep -q "^FLASHDELTA_PREBUILT_KERNELS_USED:INTERNAL=ON" \
       "$BUILD/CMakeCache.txt" 2>/dev/null; then
    echo "!! the prebuilt kernels were not used (see the warning above): the build compiles them"
  fi
  return $rc
}

stage_build() {
  # -k 0: keep going, so that one failing target leaves the others (tests, module) built.
  # shellcheck disable=SC2086
  cmake --build "$BUILD" -j "$JOBS" ${BUILD_TARGETS:+--target $BUILD_TARGETS} -- -k 0
  local rc=$?
  rm -rf "$PKG" && mkdir -p "$PKG"
  cp -r python/flashdelta "$PKG/"
  local so
  so=$(find "$BUILD" -name '_C*.so' -path '*python*' | head -1)
  if [ -n "$so" ]; then
    cp "$so" "$PKG/flashdelta/"
    (cd /tmp && python3 -c 'import flashdelta; print("flashdelta", flashdelta.__version__, "from", flashdelta.__file__)') || rc=1
  elif [ -z "$BUILD_TARGETS" ] || [[ " $BUILD_TARGETS " == *" _C "* ]]; then
    echo "!! no flashdelta._C module was built"
    rc=1
  fi
  return $rc
}

stage_ctest() {
  ctest --test-dir "$BUILD" -L cuda ${CTEST_REGEX:+-R "$CTEST_REGEX"} --output-on-failure \
    --no-tests=error --timeout 300
  local rc=$?
  # GPU cases of the command-line tests (named *OnTheGpu*; skipped without a GPU in CI).
  ctest --test-dir "$BUILD" -R OnTheGpu --output-on-failure --timeout 300 || rc=1
  if [ -x "$BUILD/flashdelta" ]; then
    echo "-- smoke: flashdelta run --device cuda (recurrent and chunk schedules)"
    "$BUILD/flashdelta" run --device cuda || rc=1
  fi
  return $rc
}

stage_sanitize() {
  if [ "$SANITIZE" = 0 ]; then echo "SANITIZE=0: skipped"; return 77; fi
  local san bin bins filter=() rc=0 tool r each
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  local names=()
  for bin in $SANITIZE_BINARIES; do names+=(${names[@]:+-o} -name "$bin"); done
  bins=$(find "$BUILD" \( "${names[@]}" \) -type f -perm -u+x)
  if [ -z "$bins" ]; then echo "!! no GPU test binaries under $BUILD"; return 1; fi
  [ -n "$SANITIZE_FILTER" ] && filter=("--gtest_filter=$SANITIZE_FILTER")
  : >"$SANLOG"
  # An equal share of the stage's time for each tool and binary; the report goes to its own
  # log (at most 8 MB per run).
  each=$((STAGE_TIMEOUT / (2 * $(echo "$bins" | wc -l)) - 5))
  for bin in $bins; do
    for tool in memcheck racecheck; do
      echo "-- ${SANITIZE_ENV:+$SANITIZE_ENV }compute-sanitizer --tool $tool ${SANITIZE_ARGS:+$SANITIZE_ARGS }$bin ${filter[*]} (timeout ${each}s)" | tee -a "$SANLOG"
      # shellcheck disable=SC2086
      timeout --kill-after=5 "$each" env $SANITIZE_ENV "$san" --tool "$tool" --error-exitcode 99 --print-limit 50 \
        $SANITIZE_ARGS "$bin" "${filter[@]}" --gtest_brief=1 2>&1 | head -c 8000000 >>"$SANLOG"
      r=${PIPESTATUS[0]}
      echo "-- $tool: exit $r$( ((r == 124)) && echo ' (timeout: set SANITIZE_FILTER)')" | tee -a "$SANLOG"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests? ran|FAILED" "$SANLOG" | tail -4
      ((r != 0)) && rc=1
    done
  done
  return $rc
}

stage_pytest() {
  # shellcheck disable=SC2086
  python3 -m pytest -p no:cacheprovider -q -rs ${PYTEST_ARGS:-tests/python/test_cuda.py \
    tests/python/test_cuda_backward.py}
}

stage_bench() {
  # shellcheck disable=SC2086
  python3 bench/device/bench_decode.py --out "$OUT" --time-budget $((STAGE_TIMEOUT - 20)) \
    $BENCH_ARGS
}

stage_bench-chunk() {
  # shellcheck disable=SC2086
  FLA_FLASH_KDA=0 python3 bench/device/bench_chunk.py --out "$OUT" $BENCH_CHUNK_ARGS
}

stage_baseline() {
  # Opt-in: see the header. The tree's own script, so its build matches its sources; its
  # module goes to a folder of its own, so later stages here still import this tree's.
  if [ ! -f "${BASELINE_TAR:-}" ]; then
    echo "BASELINE_TAR is not a file: '${BASELINE_TAR:-}'"
    return 1
  fi
  local dir=/tmp/fd-baseline rc
  rm -rf "$dir" && mkdir -p "$dir" && tar xf "$BASELINE_TAR" -C "$dir" || return 1
  ln -sfn "$ROOT/.whl" "$dir/.whl"
  (cd "$dir" && OUT=$OUT/baseline PKG_DIR=/tmp/fd-python-baseline BUILD_DIR=$dir/build-device \
    PREBUILT_KERNELS=${BASELINE_PREBUILT_KERNELS:-} \
    FLASHDELTA_COMMIT=${BASELINE_COMMIT:-baseline} BUILD_TARGETS=${BASELINE_BUILD_TARGETS:-_C} \
    STAGES=${BASELINE_STAGES:-"configure build bench-chunk"} \
    BENCH_CHUNK_ARGS=${BASELINE_BENCH_CHUNK_ARGS:-$BENCH_CHUNK_ARGS} \
    BENCH_ARGS=${BASELINE_BENCH_ARGS:-$BENCH_ARGS} \
    KERNEL_BENCH_ARGS=${BASELINE_KERNEL_BENCH_ARGS:-$KERNEL_BENCH_ARGS} \
    KERNEL_BENCH_VARIANTS=${BASELINE_KERNEL_BENCH_VARIANTS:-} \
    PROFILE_BACKWARD_ARGS=${BASELINE_PROFILE_BACKWARD_ARGS:-$PROFILE_BACKWARD_ARGS} \
    BENCH_BACKWARD_ARGS=${BASELINE_BENCH_BACKWARD_ARGS:-$BENCH_BACKWARD_ARGS} \
    BUDGET_S=$((STAGE_TIMEOUT - 10)) scripts/device-run.sh >/dev/null 2>&1)
  rc=$?
  grep -E '^(== |-- |  [a-z])' "$OUT/baseline/device-run.log"
  cat "$OUT/baseline/bench_chunk.txt" "$OUT/baseline/bench_decode.txt" \
    "$OUT/baseline/profile_backward.txt" 2>/dev/null
  sed -n '/^== kernel-bench/,/^-- kernel-bench/p' "$OUT/baseline/device-run.log"
  tar czf "$OUT/baseline.tgz" -C "$OUT" baseline && rm -rf "$OUT/baseline"
  return $rc
}

stage_bench-chunk-baseline() { stage_baseline; }

stage_bench-backward() {
  # Opt-in (not in the default STAGES). The script rewrites its outputs after every case, so
  # a stage cut short by its timeout still leaves the cases it finished.
  # shellcheck disable=SC2086
  FLA_FLASH_KDA=0 python3 bench/device/bench_backward.py --out "$OUT" $BENCH_BACKWARD_ARGS
}

stage_profile-backward() {
  # Opt-in: torch.profiler's kernel times of a training step, ours and fla.
  # shellcheck disable=SC2086
  FLA_FLASH_KDA=0 python3 bench/device/profile_backward.py --out "$OUT" $PROFILE_BACKWARD_ARGS
}

stage_train-example() {
  # Opt-in. pipefail: the stage fails when the script does, not when tee succeeds (stages run
  # in a fresh bash, which does not inherit the option).
  set -o pipefail
  python3 examples/train_kda.py --steps 100 | tee "$OUT/train_kda.txt"
}

stage_kernel-bench() {
  # The CUDA kernels timed from C++ (no Python), when the build has that tool.
  local bin
  bin=$(find "$BUILD" -name flashdelta_cuda_decode_bench -type f -perm -u+x | head -1)
  if [ -z "$bin" ]; then echo "no flashdelta_cuda_decode_bench in $BUILD"; return 77; fi
  "$bin" --json "$OUT/kernel_bench.json" $KERNEL_BENCH_ARGS || return 1
  # The machine's host time per bare kernel launch: the floor under a decode call's host time.
  local launch
  launch=$(find "$BUILD" -name flashdelta_cuda_launch_cost -type f -perm -u+x | head -1)
  if [ -n "$launch" ]; then "$launch" | tee "$OUT/launch_cost.txt" || return 1; fi
  # The memory's own rate in the decode step's access patterns, in place and out of place.
  local floor
  floor=$(find "$BUILD" -name flashdelta_cuda_stream_floor -type f -perm -u+x | head -1)
  if [ -n "$floor" ]; then "$floor" | tee "$OUT/stream_floor.txt" || return 1; fi
  local v
  for v in $KERNEL_BENCH_VARIANTS; do
    # A variant may join several assignments with commas; its JSON is named by all of them.
    local name
    name=$(sed 's/FLASHDELTA_//g; s/[^A-Za-z0-9]/_/g' <<<"$v")
    echo "-- with ${v//,/ }"
    env ${v//,/ } "$bin" --json "$OUT/kernel_bench-$name.json" || return 1
  done
}

stage_ncu-decode() {
  # The decode kernels' own durations at N=1 x HV=32 (ncu gpu__time_duration; clocks and
  # caches left as they run normally: no locking, no flush), ours from the C++ tool in both
  # layouts, then ours and fla's from the harness; -> $OUT/ncu_decode.txt
  local ncu bin layout rc=0
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  bin=$(find "$BUILD" -name flashdelta_cuda_decode_bench -type f -perm -u+x | head -1)
  local opts=(--clock-control none --cache-control none --metrics gpu__time_duration.sum
              --launch-skip 40 --launch-count 30 --csv)
  : >"$OUT/ncu_decode.txt"
  for layout in k_first v_first; do
    timeout 90 "$ncu" "${opts[@]}" -k 'regex:recurrent_(warp_)?kernel' "$bin" --only "N=1 HV=32 $layout" \
      >/tmp/ncu.csv 2>/dev/null || rc=1
    python3 bench/device/ncu_durations.py "ours C++ $layout" /tmp/ncu.csv | tee -a "$OUT/ncu_decode.txt"
    for k in 'recurrent_(warp_)?kernel' fused_recurrent; do
      timeout 120 "$ncu" "${opts[@]}" -k "regex:$k" python3 bench/device/bench_decode.py \
        --out /tmp/ncu-bench --cases kda_n1 --layouts "$layout" >/tmp/ncu.csv 2>/dev/null || rc=1
      python3 bench/device/ncu_durations.py "harness $k $layout" /tmp/ncu.csv |
        tee -a "$OUT/ncu_decode.txt"
    done
  done
  return $rc
}

stage_ncu-backward() {
  # Where each per-chunk backward kernel's warps wait, by source line (needs a -lineinfo
  # build): one launch of each kernel of NCU_BACKWARD_KERNELS in the first case's step.
  local ncu n
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  n=$(echo "$NCU_BACKWARD_KERNELS" | tr '|' '\n' | wc -l)
  "$ncu" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section Occupancy --section MemoryWorkloadAnalysis --import-source yes \
    -k "regex:$NCU_BACKWARD_KERNELS" -c "$n" -f -o /tmp/ncu-backward \
    python3 bench/device/profile_backward.py --cases kda_B8_T4096_H16 --impls ours --steps 1 \
    --out /tmp/ncu-backward-profile >/dev/null || return 1
  "$ncu" -i /tmp/ncu-backward.ncu-rep --page details >"$OUT/ncu_backward_details.txt" || return 1
  "$ncu" -i /tmp/ncu-backward.ncu-rep --page source --csv --print-source cuda,sass \
    >/tmp/ncu-backward.csv || return 1
  python3 bench/device/ncu_hotspots.py /tmp/ncu-backward.csv --top 40 | tee "$OUT/ncu_backward.txt"
  # The export itself (SASS instruction by instruction), for reading elsewhere.
  gzip -c /tmp/ncu-backward.csv >"$OUT/ncu_backward.csv.gz"
}

stage_ncu-chunk() {
  # Where the chunk forward's kernels wait, by source line (needs a -lineinfo build): one
  # launch of each kernel of NCU_CHUNK_KERNELS in NCU_CHUNK_CASE of the C++ chunk bench.
  local ncu n bin
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  n=$(echo "$NCU_CHUNK_KERNELS" | tr '|' '\n' | wc -l)
  bin=$(find "$BUILD" -name flashdelta_cuda_chunk_bench -type f | head -1)
  [ -n "$bin" ] || { echo "flashdelta_cuda_chunk_bench is not built (BUILD_TARGETS)"; return 1; }
  "$ncu" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section Occupancy --import-source yes -k "regex:$NCU_CHUNK_KERNELS" -c "$n" -f \
    -o /tmp/ncu-chunk "$bin" --only "$NCU_CHUNK_CASE" --reps 1 >/dev/null || return 1
  "$ncu" -i /tmp/ncu-chunk.ncu-rep --page details >"$OUT/ncu_chunk_details.txt" || return 1
  "$ncu" -i /tmp/ncu-chunk.ncu-rep --page source --csv --print-source cuda,sass \
    >/tmp/ncu-chunk.csv || return 1
  python3 bench/device/ncu_hotspots.py /tmp/ncu-chunk.csv --top "${NCU_TOP:-40}" | tee "$OUT/ncu_chunk.txt"
}

stage_ncu-decode-lines() {
  # Where the decode kernel's warps wait, by source line (needs a -lineinfo build): one
  # launch (after five) in NCU_DECODE_CASE of the C++ decode bench.
  local ncu bin
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  bin=$(find "$BUILD" -name flashdelta_cuda_decode_bench -type f -perm -u+x | head -1)
  [ -n "$bin" ] || { echo "flashdelta_cuda_decode_bench is not built (BUILD_TARGETS)"; return 1; }
  "$ncu" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section Occupancy --section MemoryWorkloadAnalysis --import-source yes \
    -k 'regex:recurrent_(warp_)?kernel' --launch-skip 5 -c 1 -f -o /tmp/ncu-decode \
    "$bin" --only "$NCU_DECODE_CASE" >/dev/null || return 1
  "$ncu" -i /tmp/ncu-decode.ncu-rep --page details >"$OUT/ncu_decode_details.txt" || return 1
  "$ncu" -i /tmp/ncu-decode.ncu-rep --page source --csv --print-source cuda,sass \
    >/tmp/ncu-decode.csv || return 1
  python3 bench/device/ncu_hotspots.py /tmp/ncu-decode.csv --top 40 | tee "$OUT/ncu_decode_lines.txt"
}

stage_overhead() {
  echo "-- host time per call, N=1 HV=32 K=V=128 (bench/device/overhead.py)"
  python3 bench/device/overhead.py --device cuda --n 1 --hv 32 --k 128 --v 128 --calls 1000
}

stage_pytest-all() {
  # The rest of the Python suite (CPU tests) under this machine's torch, triton and fla.
  python3 -m pytest -p no:cacheprovider -q -rs tests/python --ignore=tests/python/test_cuda.py \
    --ignore=tests/python/test_cuda_backward.py
}

# run_stage NAME: runs stage_NAME with a timeout of min(MAX, time left - the MIN of every
# later stage), its output teed into the log; skipped when less than 10 s would remain.
run_stage() {
  local name=$1 reserve=0 later=0 s
  for s in $STAGES; do
    ((later)) && reserve=$((reserve + ${MIN[$s]:-0}))
    [ "$s" = "$name" ] && later=1
  done
  local t=$(($(left) - reserve))
  ((t > ${MAX[$name]})) && t=${MAX[$name]}
  if ((t < 10)); then
    log "== $name: skipped ($(left) s of the budget left, $reserve s kept for later stages)"
    SUMMARY+=("$(printf '%-11s %-24s' "$name" "skipped (no time)")")
    FAILED=$((FAILED + 1))
    return
  fi
  log ""
  log "== $name (timeout ${t}s; $(left) s of the budget left) =="
  local t0=$SECONDS rc what=ok
  STAGE_TIMEOUT=$t timeout --kill-after=15 "$t" \
    bash -c "$(declare -f "stage_$name"); stage_$name" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then what="TIMEOUT after ${t}s"; FAILED=$((FAILED + 1))
  elif ((rc == 77)); then what="skipped"
  elif ((rc != 0)); then what="FAILED (exit $rc)"; FAILED=$((FAILED + 1)); fi
  SUMMARY+=("$(printf '%-11s %-24s %4d s' "$name" "$what" $((SECONDS - t0)))")
  log "-- $name: $what ($((SECONDS - t0)) s)"
}

log "FlashDelta device run: $(date -u '+%F %T UTC') on $(hostname); budget ${BUDGET_S} s"
log "stages: $STAGES"
# A budget below the stages' minimums would skip the first ones (the build among them) and
# run the later ones for nothing: refuse it before anything runs.
NEEDED=0 MINIMA=""
for stage in $STAGES; do
  NEEDED=$((NEEDED + ${MIN[$stage]:-0}))
  MINIMA+="${MINIMA:+, }$stage ${MIN[$stage]:-0}"
done
if ((NEEDED > BUDGET_S)); then
  log "BUDGET_S=$BUDGET_S is less than the $NEEDED s these stages need at the least ($MINIMA):" \
    "raise it or drop stages"
  exit 2
fi
for stage in $STAGES; do
  if [ -z "${MAX[$stage]:-}" ]; then log "unknown stage: $stage"; continue; fi
  run_stage "$stage"
done

# The autotuning results, for the next call to carry (see TRITON_CACHE_DIR above).
if [ -d "$TRITON_CACHE_DIR" ]; then
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/triton-autotune.tgz" -T -) &&
    log "-- $(tar tzf "$OUT/triton-autotune.tgz" | wc -l) autotune results -> $OUT/triton-autotune.tgz"
fi

log ""
log "== summary ($((SECONDS - START)) s; outputs in $OUT) =="
for line in "${SUMMARY[@]}"; do log "  $line"; done
ls -la "$OUT" | tee -a "$LOG"

# The device tool brings back at most eight files: past that, everything but the log goes
# into one archive (unpack it with tar xzf).
if (($(find "$OUT" -maxdepth 1 -type f | wc -l) > 8)); then
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name device-run.log ! -name outputs.tgz -printf '%P\n' |
    tar czf outputs.tgz -T - --remove-files) &&
    echo "-- more than 8 outputs: all but device-run.log are in $OUT/outputs.tgz" | tee -a "$LOG"
fi
((FAILED == 0))
