#!/usr/bin/env bash
# A sharded (FSDP2) learner's steps against a real synchronizer, on this machine: own_loop's model,
# `ddiloco sync --init` on 127.0.0.1, and examples/fsdp_loop.py as a torchrun job of NPROC ranks
# (default 1: with a GPU that is NCCL with world 1, the CUDA path of every rank's slice). Exit code:
# the learner's. Logs in OUTDIR. Used by scripts/gpu_check.sh.
#
#   scripts/fsdp_step.sh OUTDIR [NPROC]
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/fsdp_step.sh OUTDIR [NPROC]" >&2; exit 2; }
OUTDIR=$1
NPROC=${2:-1}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUTDIR" || exit 2
$PY "$ROOT/examples/own_loop.py" init "$OUTDIR/init.safetensors" --d-model 64 --layers 2 >"$OUTDIR/init.log" 2>&1 || exit 2
rm -f "$OUTDIR/port"
$PY -m ddiloco.cli sync --preset tiny --init "$OUTDIR/init.safetensors" --learners 1 --tokens 100000000 \
  --listen 127.0.0.1:0 --port-file "$OUTDIR/port" --state-dir "$OUTDIR/state" >"$OUTDIR/sync.log" 2>&1 &
SYNC=$!
trap 'kill $SYNC 2>/dev/null; wait $SYNC 2>/dev/null' EXIT
for _ in $(seq 300); do [ -s "$OUTDIR/port" ] && break; kill -0 $SYNC 2>/dev/null || exit 1; sleep 0.1; done
[ -s "$OUTDIR/port" ] || { echo "fsdp_step: the synchronizer did not start (see $OUTDIR/sync.log)" >&2; exit 1; }
$PY -m torch.distributed.run --nproc-per-node "$NPROC" --master-port 29531 "$ROOT/examples/fsdp_loop.py" learner \
  --connect "127.0.0.1:$(cat "$OUTDIR/port")" --id fsdp-0 --d-model 64 --layers 2 --seq-len 64 --batch-size 8 \
  --max-steps 30 --log-every 10 >"$OUTDIR/learner.log" 2>&1
rc=$?
tail -3 "$OUTDIR/learner.log"
exit $rc
