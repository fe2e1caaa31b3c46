#!/usr/bin/env bash
# One command for the rare GPU session (15 minutes of device time, all of it counted): the CUDA
# tests, a sharded (FSDP2) learner's steps with NCCL at world 1 (scripts/fsdp_step.sh), the
# learner's throughput attached/alone (the `gpu` model and a ~100M-parameter one, bf16, int4 both
# ways; per-pair medians of fresh processes), the training thread's profile, and the quality
# ladder's next point. Ends within 10 minutes (each step has its own timeout, and a step
# that fails or runs out does not stop the next). Writes its logs and stamped JSON into OUTDIR
# (a few files, each well under 16 MB).
#
#   scripts/gpu_check.sh OUTDIR             # on the GPU machine, from the repository root
#   scripts/gpu_check.sh --dry-run OUTDIR   # anywhere: seed the ladder's table, print the steps
#
# On the device machine: carry .whl (grpcio and protobuf wheels for its Python, see
# docs/results.md section 7); they are installed into /tmp/site when present.
set -uo pipefail

usage() { echo "usage: scripts/gpu_check.sh [--dry-run] OUTDIR" >&2; exit 2; }
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
[ $# -eq 1 ] || usage
case "$1" in -*) echo "gpu_check: unknown option $1" >&2; usage;; esac
OUTDIR=$1
mkdir -p "$OUTDIR" || { echo "gpu_check: cannot create OUTDIR $OUTDIR" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

# The ladder's next point goes on from the fourth GPU session's table and the one it continued.
SEED_TABLE=docs/results/scale_gpu_b882afc.json
SCALE_DIR=$OUTDIR/scale
$PY scripts/seed_scale_table.py "$SEED_TABLE" "$SCALE_DIR/table.json" >"$OUTDIR/seed.log" 2>&1 \
  || { echo "gpu_check: cannot seed the ladder's table from $SEED_TABLE (see $OUTDIR/seed.log)" >&2; exit 2; }

step() {  # step NAME TIMEOUT_S COMMAND...: run it with its log in OUTDIR, never stop the script
  local name=$1 limit=$2; shift 2
  if [ $DRY -eq 1 ]; then echo "[$name] timeout $limit $*"; return 0; fi
  echo "[$name] $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a "$OUTDIR/steps.log"
  timeout "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
  echo "[$name] exit $? at $(date -u +%H:%M:%S)" | tee -a "$OUTDIR/steps.log"
}

if [ $DRY -eq 0 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUTDIR/setup.log" 2>&1
  fi
  export PYTHONPATH="$ROOT/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p /tmp/corpus
  (cd "$($PY -c 'import site; print(site.getsitepackages()[0])')" \
    && find . -name '*.py' -size -512k -print0 | tar --null -T - -cf -) | tar -C /tmp/corpus -xf -
fi

BENCH="$PY benchmarks/bench_runtime.py --device cuda --precision bf16"
step cuda_tests 75 $PY -m pytest -q -x tests/runtime/learner/test_staging.py tests/core/test_codecs.py \
  tests/workload/test_device.py tests/workload/test_trainer.py tests/runtime/learner/test_link_helper.py
step fsdp_nccl 45 bash scripts/fsdp_step.sh "$OUTDIR/fsdp"
step throughput_gpu 110 $BENCH --only throughput --model gpu --steps 60 --repeats 5 \
  --json "$OUTDIR/throughput_gpu.json"
step throughput_100m 140 $BENCH --only throughput --model gpu100m --steps 40 --repeats 5 \
  --json "$OUTDIR/throughput_100m.json"
step profile 40 $BENCH --only profile --model gpu --steps 100
step scale 150 $PY benchmarks/bench_scale.py --preset gpu --device cuda --precision bf16 --corpus /tmp/corpus \
  --corpus-max-bytes 400000000 --out "$SCALE_DIR" --modes decoupled --sizes 8m
exit 0
