#!/usr/bin/env bash
# Check preemption on a GPU node: train the demo under torchrun, send SIGUSR1 to one worker once
# checkpoint-200 is complete, expect every rank to stop at the same step with exit 75 and
# ctrain-preempted.json, then resume to the end and evaluate.
#   scripts/gpu-preempt-check.sh [GPUS] [OUTPUT_DIR]      (defaults: 2, /tmp/ctrain-preempt-check)
set -euo pipefail
gpus=${1:-2}
out=${2:-/tmp/ctrain-preempt-check}
repo=$(cd "$(dirname "$0")/.." && pwd)
overrides=(training.output_dir="$out" logging.report_to=[] data.packing=true)
train=(python3 -m torch.distributed.run --standalone --nproc_per_node="$gpus" -m ctrain train
       "$repo/recipes/demo-addition.yaml" "${overrides[@]}")
rm -rf "$out"
log=$(mktemp)
"${train[@]}" >"$log" 2>&1 &
launcher=$!
until [ -e "$out/checkpoint-200/ctrain-complete.json" ]; do
  kill -0 "$launcher" 2>/dev/null || { cat "$log"; echo "FAIL: training ended before checkpoint-200"; exit 1; }
  sleep 0.1
done
worker=$(pgrep -P "$launcher" | tail -n 1)
echo "SIGUSR1 to worker $worker: $(grep -E 'SigBlk|SigCgt' "/proc/$worker/status" | tr '\n' ' ')"
kill -USR1 "$worker"
status=0; wait "$launcher" || status=$?
grep -E "preemption|replaced|blocked|stopped at" "$log" || true
if [ ! -e "$out/ctrain-preempted.json" ]; then
  tail -n 20 "$log"; echo "FAIL: no $out/ctrain-preempted.json (launcher exit $status)"; exit 1
fi
echo "preempted: $(cat "$out/ctrain-preempted.json")"
# The second run of the job, as Slurm numbers a requeued one (the timeline, with CTRAIN_TIMELINE set, keeps runs apart by it).
SLURM_RESTART_COUNT=1 "${train[@]}" >"$log" 2>&1 || { tail -n 20 "$log"; echo "FAIL: the resumed run failed"; exit 1; }
grep -E "resuming from" "$log"
python3 -m ctrain eval "$repo/recipes/demo-addition.yaml" "${overrides[@]}" --min-accuracy 0.9
echo "OK: preempted, resumed and finished"
