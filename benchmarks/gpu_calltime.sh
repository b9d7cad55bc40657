#!/usr/bin/env bash
# The one H200 command (issue #32): every optimizer on CUDA against its CPU result, the two
# captured CUDA graphs of a capturable Dobb (steady and refresh step) replayed against eager,
# a compiled tracked GPT (graph breaks, recompiles, the hooks' share of a compiled
# forward+backward), then single-GPU optimizer-call time on GPT-2 XL shapes (every optimizer
# of the call-time table) with the batched steps and Dobb's BASIS_METHOD, the statistics-hook
# share of eager forward+backward, the refresh solvers (torch eigh, CuPy if importable,
# cholqr, Jacobi) and a cost-model calibration of the GPU. Needs torch with CUDA and nothing
# else (no network, no installs): our package is pure Python.
#
#   OUT=/some/dir bash benchmarks/gpu_calltime.sh          # from anywhere; at most 8 minutes
#   DEVICE=cpu CONFIG=tiny TOKENS=64 LAYERS=1 COMPILE_BACKEND=eager OUT=/tmp/gpu_smoke \
#     bash benchmarks/gpu_calltime.sh
#
# With the device tool (10 minutes a call, so one call per script): this script is issue
# #32's one command; gpu_scale.sh (<= 5 minutes more) only if the session's time allows:
#   run(command="OUT=$OUT bash benchmarks/gpu_calltime.sh", timeout_s=540)  # nothing carried
#   run(command="OUT=$OUT bash benchmarks/gpu_scale.sh", carry=["benchmarks/gpu/data"],
#       timeout_s=330)                          # the data: see gpu_scale.sh's header
#
# Phases, each under its own timeout (together at most 478 s with 9 optimizers; the old
# single-process call-time phases took 88 s on the H200), each writing its results as it
# goes (a phase that fails or times out leaves partial JSON and the script carries on):
#   env          nvidia-smi, torch and CUDA versions                     -> env.txt
#   correctness  each registry optimizer, small GPT: CUDA vs CPU params  \
#   captured     capturable Dobb, steady + refresh CUDA graphs vs eager   > gpu_check.json
#   compiled     torch.compile of a tracked GPT: breaks, hooks' share    /  (bench.gpu.check)
#   calibrate    matmul/bmm/eigh/QR rates, bandwidth, per-op costs       -> calibration.json
#   solvers      Dobb's refresh solvers on SIZES blocks, warm and cold   -> solvers.json
#                (python -m bench.results.eigensolve: time, ops, host reads, accuracy)
#   calltime-NAME  LAYERS XL blocks, one process per optimizer, PER_OPT  -> calltime_xl.json
#                seconds each: one failure costs one row (merged by
#                python -m bench.results.calltime_merge; the parts are deleted)
#   table        Markdown of the call-time run, calibration              -> gpu_calltime.md
# plus log.txt: 7 files (the lent machine returns at most 8, 16 MB each). Then, here:
#   cp <files_at>/*.json <files_at>/env.txt <files_at>/log.txt benchmarks/gpu/
#   python -m bench.results gpu-table benchmarks/gpu/*.json > benchmarks/gpu/gpu_calltime.md
#   python -m bench.results --render   # RESULTS.md quotes benchmarks/gpu/
# (or copy gpu_calltime.md as it came back).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to an output directory}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
TOKENS=${TOKENS:-4096}            # token batch of the statistics forward passes
DEVICE=${DEVICE:-cuda}            # DEVICE=cpu CONFIG=tiny TOKENS=64 LAYERS=1: a smoke test
CONFIG=${CONFIG:-gpt2-xl}
LAYERS=${LAYERS:-9}               # XL blocks in every call-time run (9: 54 matrices)
PER_OPT=${PER_OPT:-22}            # seconds for each optimizer's own call-time process
COMPILE_BACKEND=${COMPILE_BACKEND:-inductor}  # compiled check; eager: a quick CPU smoke test
OPTIMIZERS=${OPTIMIZERS:-$("$PY" -c 'from bench.results.calltime import OPTIMIZERS
print(" ".join(OPTIMIZERS))' 2>/dev/null || echo dobb dion muon adamw)}
BASIS_METHOD=${BASIS_METHOD:-auto}  # Dobb's refresh solver; eigh where Dobb does not accept it
SIZES=${SIZES:-100:144,400:16}    # solver table: block size:count (XL: 100 and 400)
METHODS=${METHODS:-eigh,cupy,cholqr,jacobi,power_qr,jacobi_cold}  # slowest last
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

checks=()
for check in correctness captured compiled; do
  limit=35
  [ "$check" = compiled ] && limit=75
  phase "$check" "$limit" "$PY" -m bench.gpu.check "$check" --device "$DEVICE" \
    --backend "$COMPILE_BACKEND" --out "$OUT/$check.json"
  checks+=("$OUT/$check.json")
done
phase merge-checks 20 "$PY" -m bench.gpu.check merge "$OUT/gpu_check.json" "${checks[@]}"

phase calibrate 35 "$PY" -m bench.results.calibrate calibrate --device "$DEVICE" --config "$CONFIG" \
  --layers 1 --out "$OUT/calibration.json"
phase solvers 45 "$PY" -m bench.results.eigensolve --device "$DEVICE" --sizes "$SIZES" \
  --methods "$METHODS" --repeats 3 --out "$OUT/solvers.json"

parts=()
for name in $OPTIMIZERS; do
  phase "calltime-$name" "$PER_OPT" "$PY" -m bench.results.calltime --device "$DEVICE" \
    --autocast bf16 --config "$CONFIG" --layers "$LAYERS" --tokens "$TOKENS" --repeats 5 \
    --optimizers "$name" --basis-method "$BASIS_METHOD" --out "$OUT/part_$name.json"
  parts+=("$OUT/part_$name.json")
done
phase merge 20 "$PY" -m bench.results.calltime_merge --out "$OUT/calltime_xl.json" "${parts[@]}"
rm -f "${parts[@]}"

phase table 15 sh -c "'$PY' -m bench.results gpu-table '$OUT'/*.json \
  >'$OUT/gpu_calltime.md'"
cat "$OUT/gpu_calltime.md" 2>/dev/null || true
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
