#!/usr/bin/env bash
# pergrad's GPU claims in one run (issue 38): on a CUDA machine, in about 8 minutes,
#   1. a machine header (GPU, driver, CUDA, torch, JAX and peers' versions)   -> machine.md
#   2. each norm route's precision against the layer's forward pass, and the
#      cost model's constants on this device (benchmarks/device_costs.py)    -> device_costs.md
#   3. the DP step on GPT-2 small, T=128 and 512, against the non-private step
#      and Opacus, time and memory (benchmarks/dp_device.py)                -> dp_device.md
#   4. pergrad-bench on the device with its peers: the seed tutorial's CNN, the
#      MLP and the transformer, PyTorch and JAX, with plots                  -> bench/
#   5. the suite's device subset (pytest -m device) with PERGRAD_TEST_DEVICE -> tests.md
# all under benchmarks/results/<device name>/ (logs under logs/), copied to $OUT as
# gpu_results.tar.gz (with summary.md beside it) after every part when OUT is set.
#
#   bash scripts/gpu_check.sh                       # on a GPU machine
#   bash scripts/gpu_check.sh --parts "dp tests"    # again, only those parts
#   bash scripts/gpu_check.sh --device cpu --quick --results /tmp/dry   # the CPU dry run (CI)
#
# A GPU machine that cannot reach PyPI gets the missing wheels from .whl/ (made here by
# scripts/gpu_wheels.sh), installed into /tmp/pergrad-site. Each part runs under its own time
# limit, so one that hangs leaves the others their time; a part that fails is named in
# summary.md with its log, and the script goes on. On the first run (one H100, 2026-11-27) the
# parts took 8, 6, 49 and 98 s; the tests 290 s for 97% of a larger subset on 14 workers.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=cuda
QUICK=""
RESULTS=""
PARTS="costs dp bench tests"
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --quick) QUICK=--quick; shift ;;
    --results) RESULTS=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for part in $PARTS; do
  case "$part" in costs|dp|bench|tests) ;; *)
    echo "gpu_check.sh: --parts: expected some of 'costs dp bench tests', got $part" >&2; exit 2 ;;
  esac
done

export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX shares the GPU with torch and test workers
if [ "$DEVICE" != cpu ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pergrad-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/pergrad-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$ROOT/src:$ROOT:${PYTHONPATH:-}

SLUG=$("$PYTHON" -c "from pergrad.bench.report import device_slug; print(device_slug('$DEVICE'))") || {
  echo "gpu_check.sh: torch cannot use --device $DEVICE" >&2; exit 1; }
RESULTS=${RESULTS:-benchmarks/results/$SLUG}
mkdir -p "$RESULTS/logs"
SUMMARY=$RESULTS/summary.md
printf '# gpu_check.sh on %s\n\n| part | status | seconds | log |\n| --- | --- | --- | --- |\n' \
  "$SLUG" > "$SUMMARY"

ship() {  # copy what there is so far to $OUT (the device tool brings it back)
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/gpu_results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  cp "$SUMMARY" "$OUT/summary.md"
}

part() {  # part NAME SECONDS COMMAND...: run it under a time limit, log it, record the outcome
  local name=$1 limit=$2; shift 2
  local log=$RESULTS/logs/$name.log start=$SECONDS status
  echo "== $name (at most ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  status=$?
  case $status in 0) status=ok ;; 124|137) status="timed out" ;; *) status="failed ($status)" ;; esac
  echo "   $status in $((SECONDS - start)) s; last lines:"; tail -n 3 "$log" | sed 's/^/   | /'
  printf '| %s | %s | %s | logs/%s.log |\n' "$name" "$status" "$((SECONDS - start))" "$name" \
    >> "$SUMMARY"
  ship
}

if [ -n "$QUICK" ]; then LIMIT=(120 120 180 120); else LIMIT=(40 90 120 240); fi
part machine 60 "$PYTHON" -m benchmarks.gpu_machine --device "$DEVICE" --out "$RESULTS/machine.md"
for name in $PARTS; do
  case "$name" in
    costs) part costs "${LIMIT[0]}" "$PYTHON" -m benchmarks.device_costs --device "$DEVICE" \
             $QUICK --out "$RESULTS/device_costs.md" ;;
    dp) part dp "${LIMIT[1]}" "$PYTHON" -m benchmarks.dp_device --device "$DEVICE" $QUICK \
          --out "$RESULTS/dp_device.md" ;;
    bench) part bench "${LIMIT[2]}" "$PYTHON" -m pergrad.bench --device "$DEVICE" $QUICK \
             --no-memory --workloads cnn mlp transformer --out "$RESULTS/bench" ;;
    tests)
      if [ -n "$QUICK" ]; then  # the dry run checks that the subset collects, not that it passes
        part tests "${LIMIT[3]}" "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only \
          -m "device and not slow"
      else
        WORKERS=()
        "$PYTHON" -c "import xdist" 2>/dev/null && WORKERS=(-n "$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))")
        "$PYTHON" -c "import pytest_timeout" 2>/dev/null && WORKERS+=(--timeout 100)
        export PERGRAD_TEST_DEVICE=$DEVICE
        part tests "${LIMIT[3]}" "$PYTHON" -m pytest -v -rfE --durations=30 \
          -p no:cacheprovider "${WORKERS[@]}" -m "device and not slow"
      fi
      "$PYTHON" -m benchmarks.gpu_machine --tests-log "$RESULTS/logs/tests.log" \
        --out "$RESULTS/tests.md" >/dev/null 2>&1
      ship ;;
  esac
done
cat "$SUMMARY"
