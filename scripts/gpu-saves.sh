#!/usr/bin/env bash
# Training blocked per checkpoint save, background (training.save_async: true, the default) against
# the blocking save (false), through `ctrain train` on one GPU, offline, in one call; and how long a
# start takes to its first step with torch's compile cache cold (the first run) and warm (the second).
#
#   lora   recipes/llama-3.1-8b-lora.yaml on the lora-ctrain bench case's problem (a random bf16
#          base of the Llama-3.1-8B shape, its chats and tokenizer): STEPS steps, a save every SAVE;
#          LORA_RUNS (default "background blocking") picks the runs
#   full   recipes/llama-3.1-8b-sft.yaml (the full fine-tune, one GPU: no FSDP) on the sft8b-ctrain
#          case's problem cut to LAYERS decoder layers, what this machine's GPU, host memory and disk
#          hold along with two of its checkpoints: FULL_STEPS steps of FULL_BATCH rows, a save every
#          FULL_SAVE (longer apart than a background write takes)
#   host   pinned host memory: the time to allocate it and to copy a GPU's tensors into it
#   stall  how long a training loop stalls while another thread reserves STALL_GIB of host memory,
#          three ways (scripts/pin-stall.py)
#
#   scripts/gpu-saves.sh OUT PHASE[,PHASE...]        e.g. scripts/gpu-saves.sh /tmp/s host,lora,full
#
# OUT gets each run's log and results.txt. Inputs and checkpoints live in WORK (default
# /tmp/ctrain-saves, outside OUT: only results come back). WHEELS as scripts/gpu-site.sh reads them.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1")
phases=$2
work=$(realpath -m "${WORK:-/tmp/ctrain-saves}")
steps=${STEPS:-13}
save=${SAVE:-4}
layers=${LAYERS:-4}
full_steps=${FULL_STEPS:-50}
full_save=${FULL_SAVE:-25}
full_batch=${FULL_BATCH:-16}
lora_runs=${LORA_RUNS:-background blocking}
mkdir -p "$out" "$work"
exec > >(tee -a "$out/saves.log") 2>&1
. "$repo/scripts/gpu-site.sh"
gpu_site "$work/site"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
start=$SECONDS
say() { printf '[%4ds] %s\n' "$((SECONDS - start))" "$*"; }
result() { printf '%-16s | %s\n' "$1" "$2" | tee -a "$out/results.txt"; }
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1); $(nproc) CPUs; $(free -g | awk '/Mem/ {print $2 " GiB host memory"}')"
df -h "$work" /dev/shm | tee -a "$out/results.txt"

# export NAME CASE [BENCH OPTIONS]: the case's problem under WORK/NAME-inputs; its overrides in WORK/NAME.overrides.
export_case() {
    local name=$1 case=$2
    shift 2
    if [[ ! -e $work/$name.overrides ]]; then
        rm -rf "$work/$name-inputs"
        "$py" -m ctrain bench --cases "$case" "$@" --export "$work/$name-inputs" | tail -n 1 | tr ' ' '\n' \
            >"$work/$name.overrides" || return 1
    fi
    du -sh "$work/$name-inputs"/* | tee -a "$out/results.txt"
}

# train NAME RECIPE OVERRIDES...: one `ctrain train` in WORK/NAME, its log in OUT/NAME.log; then
# what it said about its saves and its first step.
train() {
    local name=$1 recipe=$2 rc=0 t0
    shift 2
    rm -rf "${work:?}/$name"
    say "$name: ctrain train $(basename "$recipe") $*"
    t0=$SECONDS
    "$py" -m ctrain train "$recipe" "$@" training.output_dir="$work/$name" logging.report_to=[] \
        training.logging_steps=1 >"$out/$name.log" 2>&1 || rc=$?
    say "$name: exit $rc after $((SECONDS - t0)) s"
    ((rc == 0)) || { tail -n 30 "$out/$name.log"; return $rc; }
    grep -E 'training stopped|came .* after training started|checkpoints are written' "$out/$name.log" \
        | sed 's/^\[rank 0 host [^]]*\] //' | while read -r line; do result "$name" "$line"; done
    du -sh "$work/$name"/checkpoint-* 2>/dev/null | tail -n 1 | tee -a "$out/results.txt"
    "$py" - "$work/$name/metrics.jsonl" <<'PY' | while read -r line; do result "$name" "$line"; done
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
r = [x["throughput/tokens_per_second"] for x in rows if x["step"] > 3 and "throughput/tokens_per_second" in x]
peak = max((x.get("memory/gpu_peak_allocated_gib", 0) for x in rows), default=0)
reserved = max((x.get("memory/gpu_peak_reserved_gib", 0) for x in rows), default=0)
host = max((x.get("memory/host_rss_peak_gib", 0) for x in rows), default=0)
print(f"{sum(r) / max(len(r), 1):,.0f} tokens/s over steps 4-{rows[-1]['step']} (saves included); GPU peak allocated "
      f"{peak:.1f} GiB, reserved {reserved:.1f} GiB; host RSS peak {host:.1f} GiB")
PY
}

host() {
    "$py" - <<'PY' | while read -r line; do result host "$line"; done
import time, torch
for gib in (1, 8, 24):
    n = gib << 30
    t = time.perf_counter(); pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True); alloc = time.perf_counter() - t
    src = torch.empty(n, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
    t = time.perf_counter(); pinned.copy_(src, non_blocking=True); torch.cuda.synchronize(); pin_copy = time.perf_counter() - t
    t = time.perf_counter(); pinned.copy_(src, non_blocking=True); torch.cuda.synchronize(); again = time.perf_counter() - t
    del pinned
    t = time.perf_counter(); pageable = torch.empty(n, dtype=torch.uint8); pageable.copy_(src); page_copy = time.perf_counter() - t
    t = time.perf_counter(); pageable.copy_(src); page_again = time.perf_counter() - t
    del pageable, src
    print(f"{gib} GiB: pinned alloc {alloc:.2f} s, copy into it {pin_copy:.2f} s then {again:.2f} s "
          f"({gib / again:.1f} GiB/s); pageable alloc+copy {page_copy:.2f} s then {page_again:.2f} s")
PY
}

stall() {
    "$py" "$repo/scripts/pin-stall.py" "${STALL_GIB:-8}" | while read -r line; do result stall "$line"; done
}

lora() {
    export TORCHINDUCTOR_CACHE_DIR=$work/inductor-lora
    rm -rf "$TORCHINDUCTOR_CACHE_DIR" # the first run compiles cold, the second finds the cache warm
    export_case lora lora-ctrain || return 1
    mapfile -t overrides <"$work/lora.overrides"
    local recipe=$repo/recipes/llama-3.1-8b-lora.yaml
    common=("${overrides[@]}" "data.prepared_dir=$work/lora-prepared" "training.max_steps=$steps"
            "training.save_steps=$save" training.save_total_limit=2)
    "$py" -m ctrain prepare "$recipe" "${common[@]}" training.output_dir="$work/lora-background" \
        >"$out/lora-prepare.log" 2>&1 || { tail -n 20 "$out/lora-prepare.log"; return 1; }
    [[ $lora_runs == *background* ]] && { train lora-background "$recipe" "${common[@]}" || return 1; }
    [[ $lora_runs == *blocking* ]] && { train lora-blocking "$recipe" "${common[@]}" training.save_async=false || return 1; }
    rm -rf "$work/lora-background" "$work/lora-blocking" "$work/lora-inputs" "$work/lora.overrides"
}

full() {
    export TORCHINDUCTOR_CACHE_DIR=$work/inductor-full
    export_case full sft8b-ctrain --layers "$layers" || return 1
    mapfile -t overrides <"$work/full.overrides"
    local recipe=$repo/recipes/llama-3.1-8b-sft.yaml
    common=("${overrides[@]}" "data.prepared_dir=$work/full-prepared" "training.max_steps=$full_steps"
            "training.save_steps=$full_save" training.save_total_limit=1 training.fsdp=false
            training.global_batch_size="$full_batch")
    "$py" -m ctrain prepare "$recipe" "${common[@]}" training.output_dir="$work/full-background" \
        >"$out/full-prepare.log" 2>&1 || { tail -n 20 "$out/full-prepare.log"; return 1; }
    train full-background "$recipe" "${common[@]}" || return 1
    rm -rf "$work/full-background"
    train full-blocking "$recipe" "${common[@]}" training.save_async=false || return 1
    rm -rf "$work/full-blocking"
}

rc=0
for phase in ${phases//,/ }; do
    case $phase in
        host | stall | lora | full) "$phase" || { rc=$?; say "$phase: exit $rc"; } ;;
        *) echo "unknown phase $phase; phases: host, stall, lora, full"; exit 2 ;;
    esac
done
say "done"
exit $rc
