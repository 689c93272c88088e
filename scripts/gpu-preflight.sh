#!/usr/bin/env bash
# The preflight on a GPU machine (one host, 2 or more GPUs), offline: the node checks as each node's
# host runs them, the rank checks under torchrun with NVLink/PCIe peer-to-peer and with NCCL forced
# onto sockets, a GPU shared with other work (named slow), and the report of a preempted and
# resumed run. Prints what each saw; results.txt in OUT.
#   scripts/gpu-preflight.sh [OUT] [WHEELS]     (defaults: /tmp/ctrain-preflight, .gpu/bundle/wheels)
# WHEELS: the training stack's wheels the machine lacks (scripts/gpu-bundle.sh gathers them).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-/tmp/ctrain-preflight}")
wheels=${2:-$repo/.gpu/bundle/wheels}
py=${PYTHON:-python3}
[[ -x /opt/torch/.venv/bin/python ]] && py=/opt/torch/.venv/bin/python
mkdir -p "$out/site" "$out/project/.ctrain"
exec > >(tee "$out/results.txt") 2>&1
if compgen -G "$wheels/*.whl" >/dev/null; then
    find "$wheels" -name '*.whl' ! -name 'ctrain-*' -print0 |
        xargs -0 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$out/site"
fi
export PYTHONPATH=$repo/src:$out/site
gpus=$(nvidia-smi -L | grep -c '^GPU')
echo "== machine: $gpus GPU(s); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
nvidia-smi topo -m | head -n $((gpus + 1))
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== node checks (ctrain_preflight's script, as a node's host runs it)"
script=$(bash -c 'source "$1" && printf %s "$CTRAIN_PREFLIGHT_NODE"' _ "$repo/sbatch/lib/ctrain.sh")
echo token-1 >"$out/project/.ctrain/1.preflight"
start=$(date +%s.%N)
SLURM_JOB_ID=1 SLURM_GPUS_ON_NODE=$gpus SLURMD_NODENAME=gpu-node sh -c "$script" ctrain-preflight \
    "$out/project" token-1 1024 "" 0
echo "node checks took $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }') s"
nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total,remapped_rows.pending --format=csv

ranks() { # NAME ENV... : the rank checks under torchrun on every GPU
    local name=$1
    shift
    mkdir -p "$out/$name"
    echo "== rank checks: $name ($*)"
    env "$@" CTRAIN_PIDS="$out/$name" "$py" -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
        -m ctrain.train.health 2>&1 | grep -E "preflight|error" | grep -v '^\s*$'
    grep -hE "via |Using network|NET/" "$out/$name"/nccl-preflight.* 2>/dev/null | sed 's/^[^ ]* //' | sort | uniq -c | head -n 8
    [[ ! -s $out/$name/unfit ]] || { echo "unfit:"; cat "$out/$name/unfit"; }
}
ranks quick CTRAIN_PREFLIGHT=quick
ranks full CTRAIN_PREFLIGHT=full
ranks sockets CTRAIN_PREFLIGHT=full NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1

echo "== a GPU shared with other work: two matmul loops on the last GPU during the rank checks"
hog='import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 60
while time.time() < end:
    a @ a
'
last=$((gpus - 1))
CUDA_VISIBLE_DEVICES=$last "$py" -c "$hog" & h1=$!
CUDA_VISIBLE_DEVICES=$last "$py" -c "$hog" & h2=$!
sleep 8
ranks shared CTRAIN_PREFLIGHT=quick
kill "$h1" "$h2" 2>/dev/null
wait "$h1" "$h2" 2>/dev/null # not a bare wait: it would wait for the tee of this script's output too

echo "== a preempted and resumed run, with its timeline and report"
export CTRAIN_TIMELINE=$out/preempt.timeline
rm -f "$CTRAIN_TIMELINE"
PATH=$(dirname "$py"):$PATH bash "$repo/scripts/gpu-preempt-check.sh" "$gpus" "$out/preempt" 2>&1 | tail -n 8
"$py" -m ctrain report 1 --timeline "$CTRAIN_TIMELINE" 2>&1 | tail -n 8
