#!/usr/bin/env bash
# Single-GPU optimizer-call time on GPT-2 XL shapes (Dobb, Dion, Muon, MuonBP and its block
# step = a BlockMuon call, AdamW) with the batched steps and Dobb's BASIS_METHOD, the
# statistics-hook share of forward+backward, the refresh solvers (or eigh backends), and a
# cost-model calibration of the GPU. Needs torch with CUDA and nothing else (no network, no
# installs): our package is pure Python.
#
#   OUT=/some/dir bash benchmarks/gpu_calltime.sh          # from anywhere; at most 8 minutes
#   DEVICE=cpu CONFIG=tiny TOKENS=64 OUT=/tmp/gpu_smoke bash benchmarks/gpu_calltime.sh
#
# With the device tool: run(command="OUT=$OUT bash benchmarks/gpu_calltime.sh",
# timeout_s=540); nothing needs carrying.
#
# Phases, each under its own timeout (together at most ~470 s), each writing its results as
# it goes (a phase that fails or times out leaves partial JSON and the script carries on):
#   env          nvidia-smi, torch and CUDA versions                     -> env.txt
#   calibrate    matmul/bmm/eigh/QR rates, bandwidth, per-op costs       -> calibration.json
#   solvers      Dobb's refresh solvers on SIZES blocks (python -m bench.results.eigensolve), or,
#                where that module has no command line, eigh backends    -> solvers.json
#                (torch CUDA vs CPU vs CuPy eigh, bench.model.calibrate)     or eigh.json
#   calltime-2   2 XL blocks, 5 repeats                                  -> calltime_xl2.json
#   calltime-N   as many XL blocks (up to 48) as fit BUDGET_FULL seconds -> calltime_xl.json
#   table        Markdown of the call-time runs, calibration, eigh       -> gpu_calltime.md
# plus log.txt: 7 files (the lent machine returns at most 8, 16 MB each). Then, here:
#   cp <files_at>/*.json <files_at>/env.txt <files_at>/log.txt benchmarks/gpu/
#   python -m bench.results gpu-table benchmarks/gpu/*.json > benchmarks/gpu/gpu_calltime.md
#   python -m bench.results --render   # RESULTS.md quotes benchmarks/gpu/
# (or copy gpu_calltime.md as it came back; solvers.json is printed in log.txt by its phase).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to an output directory}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
TOKENS=${TOKENS:-4096}            # token batch of the statistics forward passes
DEVICE=${DEVICE:-cuda}            # DEVICE=cpu CONFIG=tiny TOKENS=64: a smoke test without GPU
CONFIG=${CONFIG:-gpt2-xl}
BUDGET_FULL=${BUDGET_FULL:-190}   # seconds for the largest run (its timeout)
BASIS_METHOD=${BASIS_METHOD:-auto}  # Dobb's refresh solver; eigh where Dobb does not accept it
SIZES=${SIZES:-100:144,400:16}    # solver table: block size:count (XL: 100 and 400)
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"

source benchmarks/gpu_common.sh

log "repository $(pwd), output $OUT"
{
  nvidia-smi || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
} >"$OUT/env.txt" 2>&1 || true
cat "$OUT/env.txt" | tee -a "$LOG"
require_cuda
pick_basis_method

phase calibrate 70 "$PY" -m bench.model.calibrate calibrate --device "$DEVICE" --config "$CONFIG" \
  --layers 1 --out "$OUT/calibration.json"
solver_help=$("$PY" -m dobb.eigensolve --help 2>/dev/null || true)
if [[ $solver_help == *--sizes* ]]; then
  phase solvers 60 sh -c "'$PY' -m dobb.eigensolve --device '$DEVICE' --sizes '$SIZES' \
    --out '$OUT/solvers.json' && cat '$OUT/solvers.json'"
else
  log "python -m bench.results.eigensolve has no command line here: eigh backends instead"
  phase eigh 45 "$PY" -m bench.model.calibrate eigh --device "$DEVICE" --out "$OUT/eigh.json"
fi
phase calltime-2 90 "$PY" -m bench.results.calltime --device "$DEVICE" --autocast bf16 \
  --config "$CONFIG" --layers 2 --tokens "$TOKENS" --repeats 5 --basis-method "$BASIS_METHOD" \
  --out "$OUT/calltime_xl2.json"

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
  phase "calltime-$LAYERS" "$BUDGET_FULL" "$PY" -m bench.results.calltime --device "$DEVICE" \
    --autocast bf16 --config "$CONFIG" --layers "$LAYERS" --tokens "$TOKENS" --repeats 5 \
    --basis-method "$BASIS_METHOD" --out "$OUT/calltime_xl.json"
else
  log "no larger run (blocks=$LAYERS): the 2-block run was incomplete or too slow for BUDGET_FULL, or the model has no more blocks"
fi

phase table 30 sh -c "'$PY' -m bench.results gpu-table '$OUT'/*.json \
  >'$OUT/gpu_calltime.md'"
cat "$OUT/gpu_calltime.md" 2>/dev/null || true
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
