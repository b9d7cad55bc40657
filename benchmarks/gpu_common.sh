# Helpers the GPU scripts source (gpu_calltime.sh, gpu_scale.sh): the log, phases under a
# timeout, the CUDA check and Dobb's refresh solver. They read PY, LOG, DEVICE and
# BASIS_METHOD, which the sourcing script sets.

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# phase NAME SECONDS COMMAND...: run under a timeout, log everything, never stop the script
phase() {
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  log "phase $name: start (timeout ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" || rc=$?
  log "phase $name: exit $rc after $((SECONDS - start)) s"
}

# stop the script when DEVICE=cuda and torch sees no CUDA device
require_cuda() {
  if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    log "no CUDA device visible to torch: stopping"
    exit 1
  fi
}

# Dobb's basis_method: the requested one if Dobb accepts it, else eigh (say which)
pick_basis_method() {
  if ! "$PY" -c 'import sys, torch, dobb
dobb.Dobb([torch.nn.Parameter(torch.zeros(4, 4))], lr=1e-3, basis_method=sys.argv[1])' \
    "$BASIS_METHOD" 2>/dev/null; then
    log "Dobb does not accept basis_method=$BASIS_METHOD: using eigh"
    BASIS_METHOD=eigh
  fi
  log "Dobb basis_method=$BASIS_METHOD"
}
