#!/usr/bin/env bash
# The 8B full-SFT benchmark on one GPU host, offline: `ctrain bench` of the sft8b cases over all of
# the host's GPUs (one torchrun per case), with the training stack's wheels the machine lacks
# installed beside it first. Each case's JSON lands in OUT/NgpuS-ddp/ as it finishes, so a call cut
# short keeps the cases before; the table is at the end of OUT/bench.log.
#   scripts/gpu-sft8b.sh OUT CASES [BENCH OPTIONS]      e.g. scripts/gpu-sft8b.sh /tmp/b sft8b-trl-best,sft8b-ctrain
# WHEELS (default .gpu/bundle/wheels and .gpu/bundle/bench-wheels): scripts/gpu-bundle.sh gathers them.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1")
cases=$2
shift 2
site=${SITE:-/tmp/ctrain-sft8b-site} # outside OUT: only results come back
mkdir -p "$out"
exec > >(tee "$out/bench.log") 2>&1
. "$repo/scripts/gpu-site.sh"
gpu_site "$site"
gpus=$(nvidia-smi -L | grep -c '^GPU')
echo "== $gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
"$py" -c 'import importlib.metadata as m
for n in ("torch", "transformers", "trl", "accelerate", "peft", "liger-kernel", "deepspeed", "flash-attn", "triton"):
    try: print(n, m.version(n))
    except m.PackageNotFoundError: print(n, "-")'
cd "$out" && "$py" -m ctrain bench --cases "$cases" --gpus "$gpus" --out "$out" "$@"
