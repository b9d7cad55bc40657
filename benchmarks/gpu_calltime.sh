#!/usr/bin/env bash
# Single-GPU optimizer-call time on GPT-2 XL shapes (Dobb, Dion, Muon, AdamW), statistics-
# hook overhead, eigh backends, and a cost-model calibration of the GPU. Needs torch with
# CUDA and nothing else (no network, no installs): our package is pure Python.
#
#   OUT=/some/dir bash benchmarks/gpu_calltime.sh          # from anywhere; ~5-7 minutes
#
# Phases, each under its own timeout, each writing its results as it goes (a phase that
# fails or times out leaves partial JSON and the script carries on):
#   env          nvidia-smi, torch and CUDA versions                     -> env.txt
#   calibrate    matmul/bmm/eigh/QR rates, bandwidth, per-op costs       -> calibration.json
#   eigh         torch CUDA vs torch CPU vs CuPy eigh, one XL block      -> eigh.json
#   calltime-2   2 XL blocks, 5 repeats                                  -> calltime_xl2.json
#   calltime-N   as many XL blocks (up to 48) as fit BUDGET_FULL seconds -> calltime_xl.json
#   table        Markdown of both call-time runs                         -> gpu_calltime.md
# plus log.txt: 7 files (the lent machine returns at most 8). Copy the JSON files to
# benchmarks/gpu/ and run `python -m dobb.bench.results` to put them in RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to an output directory}
PY=${PYTHON:-python3}
TOKENS=${TOKENS:-4096}            # token batch of the statistics forward passes
DEVICE=${DEVICE:-cuda}            # DEVICE=cpu CONFIG=tiny TOKENS=64: a smoke test without GPU
CONFIG=${CONFIG:-gpt2-xl}
BUDGET_FULL=${BUDGET_FULL:-200}   # seconds for the largest run (its timeout)
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# phase NAME SECONDS COMMAND...: run under a timeout, log everything, never stop the script
phase() {
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  log "phase $name: start (timeout ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" || rc=$?
  log "phase $name: exit $rc after $((SECONDS - start)) s"
}

log "repository $(pwd), output $OUT"
{
  nvidia-smi || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
} >"$OUT/env.txt" 2>&1 || true
cat "$OUT/env.txt" | tee -a "$LOG"
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  log "no CUDA device visible to torch: stopping"
  exit 1
fi

phase calibrate 80 "$PY" -m dobb.bench.calibrate calibrate --device "$DEVICE" --config "$CONFIG" \
  --layers 1 --out "$OUT/calibration.json"
phase eigh 45 "$PY" -m dobb.bench.calibrate eigh --device "$DEVICE" --out "$OUT/eigh.json"
phase calltime-2 100 "$PY" -m dobb.bench.calltime --device "$DEVICE" --autocast bf16 \
  --config "$CONFIG" --layers 2 --tokens "$TOKENS" --repeats 5 --out "$OUT/calltime_xl2.json"

# Scale the 2-block run's wall time to the budget (time grows about linearly with blocks).
LAYERS=$("$PY" - "$OUT/calltime_xl2.json" "$BUDGET_FULL" "$CONFIG" <<'EOF' || echo 0
import json, sys
from dobb.train.model import gpt_config
try:
    meta = json.load(open(sys.argv[1]))["meta"]
except (OSError, ValueError, KeyError):
    print(0)
    sys.exit()
per_block = meta["wall_s"] / meta["layers"] if meta.get("complete") else float("inf")
print(max(0, min(gpt_config(sys.argv[3]).n_layer, int(0.7 * float(sys.argv[2]) / per_block))))
EOF
)
if [ "$LAYERS" -gt 2 ]; then
  phase "calltime-$LAYERS" "$BUDGET_FULL" "$PY" -m dobb.bench.calltime --device "$DEVICE" \
    --autocast bf16 --config "$CONFIG" --layers "$LAYERS" --tokens "$TOKENS" --repeats 5 \
    --out "$OUT/calltime_xl.json"
else
  log "no larger run (blocks=$LAYERS): the 2-block run was incomplete or too slow for BUDGET_FULL, or the model has no more blocks"
fi

phase table 30 sh -c "'$PY' -m dobb.bench.results gpu-table '$OUT'/*.json \
  >'$OUT/gpu_calltime.md'"
cat "$OUT/gpu_calltime.md" 2>/dev/null || true
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
