#!/usr/bin/env bash
# One script for a lent GPU machine (no network, nothing installable): CUDA tests and GPU benchmarks.
# Runs the package from this checkout with the machine's python3 (PYTHONPATH=src); results under $OUT.
#
#   OUT=/some/dir bash bench/gpu.sh            # on the GPU machine
#   OUT=/tmp/gpu-dry bash bench/gpu.sh --dry-run   # on a CPU: tiny model, shrunk, to check the script
#
# Sections (each with hard per-item limits through `timeout`; total device budget ~9 minutes):
#   1. environment
#   2. tune: CUDA tests (pytest -m cuda, or a plain script without pytest)          <= 40 s
#   3. tune: gpt2, gpt2-medium, gpt2-large, bf16-mixed, seq 1024: ours vs Lightning
#      Tuner.scale_batch_size and Accelerate find_executable_batch_size               <= ~270 s
#   4. planner calibration (appended by the planner engineer)
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; fi
OUT=${OUT:-$(mktemp -d /tmp/microbatch-gpu.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export MICROBATCH_CACHE_DIR="$OUT/cache"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
DRYFLAG=""
SCALE=1   # time limits are for the GPU; a dry run on a (shared) CPU gets three times as long
if [[ $DRY == 1 ]]; then DRYFLAG="--dry-run"; SCALE=3; fi
START=$SECONDS
log() { echo "[gpu.sh +$((SECONDS - START))s] $*" | tee -a "$OUT/gpu.log"; }
# run LIMIT_S NAME CMD...: one item under a hard time limit; its output in $OUT/logs/NAME.log
run() {
  local limit=$1 name=$2; shift 2
  mkdir -p "$OUT/logs"
  limit=$((limit * SCALE))
  timeout -k 5 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  if [[ $rc == 124 || $rc == 137 ]]; then log "$name: TIMED OUT after ${limit}s"; else log "$name: exit $rc"; fi
  tail -n 3 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$OUT/gpu.log"
  return 0
}

# == 1. environment ==========================================================================
log "section 1: environment"
"$PY" - >"$OUT/env.json" 2>"$OUT/env.err" <<'PYEOF'
import json, sys, importlib.util
d = {"python": sys.version.split()[0]}
for m in ("torch", "transformers", "lightning", "accelerate", "pytest", "pytest_timeout", "hypothesis", "numpy", "click", "rich"):
    spec = importlib.util.find_spec(m)
    if spec is None:
        d[m] = None
        continue
    try:
        d[m] = getattr(__import__(m), "__version__", "present")
    except Exception as e:  # noqa: BLE001
        d[m] = f"import failed: {e}"
try:
    import torch
    d["cuda"] = torch.cuda.is_available()
    if d["cuda"]:
        d["device"] = torch.cuda.get_device_name(0)
        d["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
except Exception as e:  # noqa: BLE001
    d["cuda"] = f"error: {e}"
print(json.dumps(d, indent=1))
PYEOF
cat "$OUT/env.json" | tee -a "$OUT/gpu.log"

# == 2. tune: CUDA tests =====================================================================
log "section 2: tune CUDA tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  TO=""
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then TO="--timeout=30"; fi
  # hypothesis missing: deselect the modules that import it rather than fail collection
  IGN=""
  if ! "$PY" -c "import hypothesis" 2>/dev/null; then
    for f in $(grep -rl "^from hypothesis\|^import hypothesis" tests --include="*.py"); do IGN="$IGN --ignore=$f"; done
  fi
  run 40 tune_cuda_tests "$PY" -m pytest -m cuda -q -p no:cacheprovider $TO $IGN tests/measure/test_measure.py tests/choose/test_tune.py
else
  run 40 tune_cuda_checks "$PY" bench/gpu_tune.py checks --out "$OUT/tune"
fi

# == 3. tune on GPT-2 models vs Lightning and Accelerate =====================================
log "section 3: tune vs Lightning / Accelerate"
MODELS="gpt2 gpt2-medium gpt2-large"
if [[ $DRY == 1 ]]; then MODELS="gpt2"; fi
for M in $MODELS; do
  if (( SECONDS - START > 240 * SCALE )); then log "tune part near its share (a model takes up to 135 s; the whole script must end inside 10 minutes): skipping $M"; continue; fi
  run 45 "lightning_$M" "$PY" bench/gpu_tune.py lightning "$M" --out "$OUT/tune" $DRYFLAG
  run 35 "accelerate_$M" "$PY" bench/gpu_tune.py accelerate "$M" --out "$OUT/tune" $DRYFLAG
  run 35 "ours_$M" "$PY" bench/gpu_tune.py ours "$M" --out "$OUT/tune" $DRYFLAG
  AT=$("$PY" - "$OUT/tune" "$M" <<'PYEOF'
import json, sys, pathlib
out, m = pathlib.Path(sys.argv[1]), sys.argv[2]
bs = []
for tool in ("lightning", "accelerate"):
    f = out / f"{tool}_{m}.json"
    if f.exists():
        b = json.loads(f.read_text()).get("batch_size")
        if b:
            bs.append(b)
ours = out / f"ours_{m}.json"
have = {p["micro_batch"] for p in json.loads(ours.read_text())["points"]} if ours.exists() else set()
print(",".join(str(b) for b in bs if b not in have))
PYEOF
)
  if [[ -n "$AT" ]]; then run 20 "measure_$M" "$PY" bench/gpu_tune.py measure "$M" --at "$AT" --out "$OUT/tune" $DRYFLAG; fi
done
run 20 tune_summary "$PY" bench/gpu_tune.py summary --out "$OUT/tune"
cat "$OUT/tune/summary.txt" 2>/dev/null | tee -a "$OUT/gpu.log"
log "tune part done in $((SECONDS - START)) s"

# == 4. planner calibration ==================================================================
# gpt2-xl (s 1024) and llama-3.2-1b (s 2048), bf16 autocast, AdamW in steady state: predicted
# (uncalibrated, calibrated from the smallest probes) against measured allocated/reserved memory
# and step time. Its own wall budget (--budget-s) plus start-up stays inside the hard limit.
log "section 4: planner calibration"
CAL_BUDGET=150
if [[ $DRY == 1 ]]; then
  run 120 calibrate "$PY" bench/gpu_calibrate.py --smoke --out "$OUT/calibrate.json"
else
  run $((CAL_BUDGET + 45)) calibrate "$PY" bench/gpu_calibrate.py --budget-s $CAL_BUDGET --out "$OUT/calibrate.json"
fi
cat "$OUT/logs/calibrate.log" 2>/dev/null | tail -n 40 | tee -a "$OUT/gpu.log"
# == 4b. accumulate: recovery from a real CUDA out-of-memory (GPT-2, per-process memory cap) ====
log "section 4b: accumulate out-of-memory recovery"
if "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  run 90 accumulate_oom_cuda "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/run/test_accumulate_oom_train.py
else
  log "accumulate_oom_cuda: skipped (needs pytest and hypothesis on this machine)"
fi
log "all done in $((SECONDS - START)) s"

# == 5. what comes back ======================================================================
# The device tool returns at most 8 files, two folders deep: keep the log and the two JSON
# summaries at the top, and pack everything else into one archive.
cp "$OUT/tune/summary.json" "$OUT/tune-summary.json" 2>/dev/null
tar -czf "$OUT/all-results.tar.gz" -C "$OUT" --exclude=all-results.tar.gz --exclude=cache . 2>/dev/null
find "$OUT" -mindepth 1 -maxdepth 1 ! -name gpu.log ! -name env.json ! -name calibrate.json ! -name tune-summary.json \
  ! -name all-results.tar.gz -exec rm -rf {} +
ls -la "$OUT"
