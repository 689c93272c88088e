#!/usr/bin/env bash
# recipes/llama-3.1-8b-sft.yaml through `ctrain train` on one GPU host, offline, on the 8B bench
# case's own problem (`ctrain bench --cases sft8b-ctrain --export`: its chats, its tokenizer, a
# random bf16 checkpoint of the Llama-3.1-8B shape), as torchrun runs it on a node:
#
#   inputs   the exported problem and `ctrain prepare` of it
#   load     the model's load alone (scripts/load-memory.py) with 1 process, then one per GPU (or
#            LOAD_RANKS, e.g. "1 2 4"): the host memory a node spends on it per rank, each GPU's peak;
#            then the baseline, read into host memory first, with LOAD_HOST_RANKS processes ("1"), and
#            with LOAD_WIDEN_RANKS processes (none) each tensor widened to float32 on the host
#   peak     `ctrain train` on all GPUs killed once step STOP1 is logged: each rank's GPU peak from
#            its start (the load, the sharding, compilation, the first steps), no checkpoint
#   a        run A: STEPS steps on all GPUs, uninterrupted (tokens/s, loss curve, host memory), its
#            final model checked against its last checkpoint (scripts/final-check.py)
#   b1       run B: the same until SIGUSR1 to one worker during step STOP1 (a sharded checkpoint)
#   b2       run B resumed on half the GPUs (the checkpoint all of them wrote), preempted at STOP2
#   b3       run B resumed on all the GPUs to the end
#   compare  B's losses (whichever of b1-b3 ran) against A's, step by step
#
#   scripts/gpu-sft8b-train.sh OUT PHASE[,PHASE...] [OVERRIDES...]     e.g. OUT inputs,a,b1,b2,b3,compare
#
# OUT gets each run's log, metrics.jsonl and host-memory peaks, and results.txt. The inputs and the
# checkpoints (about 100 GB at 8B) live in WORK (default .gpu/sft8b-train, ignored by git, kept by a
# GPU machine between calls), so b2 and b3 need the machine b1 ran on. Settings (environment):
# RECIPE (recipes/llama-3.1-8b-sft.yaml), GPUS (default: every GPU), STEPS (10), STOP1 (4), STOP2 (7), TINY=1 (the bench's tiny problem,
# for a rehearsal on CPU: give the CPU's overrides, e.g. training.fsdp=false), WHEELS (gpu-site.sh).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1")
phases=$2
shift 2
extra=("$@")
work=$(realpath -m "${WORK:-$repo/.gpu/sft8b-train}")
steps=${STEPS:-10}
stop1=${STOP1:-4}
stop2=${STOP2:-7}
recipe=$(realpath -m "${RECIPE:-$repo/recipes/llama-3.1-8b-sft.yaml}")
mkdir -p "$out" "$work"
exec > >(tee -a "$out/train.log") 2>&1
. "$repo/scripts/gpu-site.sh"
gpu_site "$work/site"
export TORCHINDUCTOR_CACHE_DIR=$work/inductor HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
((gpus > 0)) || { echo "no GPUs: set GPUS (and TINY=1 with CPU overrides) for a rehearsal"; exit 1; }
start=$SECONDS
say() { printf '[%4ds] %s\n' "$((SECONDS - start))" "$*"; }
result() { printf '%-10s | %s\n' "$1" "$2" | tee -a "$out/results.txt"; }

# The overrides every run shares: the exported problem, STEPS steps, every step logged, no
# periodic checkpoint (the end's and a preemption's only), one complete checkpoint kept.
common() {
    cat "$work/inputs.overrides"
    printf '%s\n' "training.max_steps=$steps" training.logging_steps=1 training.save_steps=100000 \
        training.save_total_limit=1 logging.report_to=[] "${extra[@]}"
}

# train NAME DIR NPROC [STOP_AT [KILL]]: one `ctrain train` under torchrun, its host memory sampled;
# with STOP_AT, SIGUSR1 to one worker once step STOP_AT-1 is logged (the run checkpoints and stops),
# or with KILL, SIGKILL to every process of the run (nothing is saved).
train() {
    local name=$1 dir=$2 nproc=$3 stop_at=${4:-} how=${5:-USR1} launcher sampler worker rc=0 visible seen
    visible=$(seq -s, 0 $((nproc - 1)))
    mapfile -t overrides < <(common)
    seen=$(wc -l 2>/dev/null <"$dir/metrics.jsonl" || echo 0) # a resumed run appends to its predecessors' metrics
    say "$name: $nproc process(es) over $dir${stop_at:+, SIG$how during step $stop_at}"
    CUDA_VISIBLE_DEVICES=$visible SLURM_RESTART_COUNT=${RESTARTS:-0} "$py" -m torch.distributed.run --standalone \
        --nproc_per_node="$nproc" -m ctrain train "$recipe" "${overrides[@]}" training.output_dir="$dir" \
        >"$out/$name.log" 2>&1 &
    launcher=$!
    "$py" "$repo/scripts/host-memory.py" "$launcher" "$out/$name.memory.json" 0.5 &
    sampler=$!
    if [[ -n $stop_at ]]; then
        until tail -n "+$((seen + 1))" "$dir/metrics.jsonl" 2>/dev/null | grep -q "\"step\": $((stop_at - 1)),"; do
            kill -0 "$launcher" 2>/dev/null || break
            sleep 0.2
        done
        if [[ $how == KILL ]]; then
            pkill -KILL -P "$launcher"
            kill -KILL "$launcher" && say "$name: SIGKILL to the run"
        else
            worker=$(pgrep -P "$launcher" | tail -n 1)
            [[ -n $worker ]] && kill -USR1 "$worker" && say "$name: SIGUSR1 to worker $worker"
        fi
    fi
    wait "$launcher" || rc=$?
    wait "$sampler"
    cp "$dir/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
    say "$name: exit $rc; $(grep -E 'resuming from|preemption|stopped at|final model' "$out/$name.log" | tail -n 3 | tr '\n' ' ')"
    [[ -e $dir/ctrain-preempted.json ]] && say "$name: preempted: $(tr -d '\n ' <"$dir/ctrain-preempted.json")"
    say "$name: host memory: $(peaks "$out/$name.memory.json" 2>/dev/null)"
    return $rc
}

# rate NAME FROM: tokens/s (all GPUs) over the steps after FROM of a run's metrics, and per GPU.
rate() {
    "$py" - "$out/$1.metrics.jsonl" "$2" "$3" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
after, gpus = int(sys.argv[2]), int(sys.argv[3])
r = [x["throughput/tokens_per_second"] for x in rows if x["step"] > after and "throughput/tokens_per_second" in x]
mfu = [x["throughput/mfu"] for x in rows if x["step"] > after and "throughput/mfu" in x]
if r:
    mean = sum(r) / len(r)
    print(f"{mean:,.0f} tokens/s, {mean / gpus:,.0f} per GPU over steps {after + 1}-{rows[-1]['step']}"
          + (f", logged MFU {100 * sum(mfu) / len(mfu):.1f}%" if mfu else ""))
else:
    print("no throughput logged")
PY
}

inputs() {
    if [[ ! -e $work/inputs.overrides ]]; then
        say "exporting the sft8b-ctrain case's problem to $work/inputs"
        rm -rf "$work/inputs"
        "$py" -m ctrain bench --cases sft8b-ctrain ${TINY:+--tiny} --export "$work/inputs" \
            | tail -n 1 | tr ' ' '\n' >"$work/inputs.overrides.new" || return 1
        mv "$work/inputs.overrides.new" "$work/inputs.overrides"
        du -sh "$work/inputs"/*
    fi
    mapfile -t overrides < <(common)
    say "ctrain prepare"
    "$py" -m ctrain prepare "$recipe" "${overrides[@]}" training.output_dir="$work/a" >"$out/prepare.log" 2>&1 ||
        { tail -n 20 "$out/prepare.log"; return 1; }
    tail -n 2 "$out/prepare.log"
    for run in b peak; do
        rm -rf "${work:?}/$run"
        mkdir -p "$work/$run"
        cp -r "$work/a/prepared" "$work/$run/prepared"
    done
}

# peaks FILE: host-memory.py's peaks, without its series.
peaks() {
    "$py" -c 'import json, sys; r = json.load(open(sys.argv[1])); print({k: v for k, v in r.items() if not k.startswith("series")})' "$1"
}

# load_with NAME NPROC [--via-host]: scripts/load-memory.py under torchrun, its host memory sampled.
load_with() {
    local name=$1 n=$2 launcher sampler
    shift 2
    mapfile -t overrides < <(common)
    say "$name: $n process(es) $*"
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(((n < gpus ? n : gpus) - 1))) "$py" -m torch.distributed.run --standalone \
        --nproc_per_node="$n" "$repo/scripts/load-memory.py" "$@" "$recipe" "${overrides[@]}" \
        training.output_dir="$work/a" >"$out/$name.log" 2>&1 &
    launcher=$!
    "$py" "$repo/scripts/host-memory.py" "$launcher" "$out/$name.memory.json" 0.2 &
    sampler=$!
    wait "$launcher" || { tail -n 20 "$out/$name.log"; return 1; }
    wait "$sampler"
    grep '^{' "$out/$name.log" | while read -r line; do result "$name" "$line"; done
    result "$name.node" "$(peaks "$out/$name.memory.json")"
}

load() {
    local n
    for n in ${LOAD_RANKS:-$( ((gpus > 1)) && echo 1 "$gpus" || echo 1)}; do
        load_with "load$n" "$n" || return 1
    done
    for n in ${LOAD_HOST_RANKS:-1}; do
        load_with "loadhost$n" "$n" --via-host || return 1
    done
    for n in ${LOAD_WIDEN_RANKS:-}; do
        load_with "loadwiden$n" "$n" --widen-on-host || return 1
    done
}

peak() {
    find "$work/peak" -mindepth 1 -maxdepth 1 ! -name prepared -exec rm -rf {} + # a new run each time
    rm -f "$out/peak.metrics.jsonl"
    train peak "$work/peak" "$gpus" $((stop1 + 1)) KILL
    grep -E 'step [0-9]+ memory' "$out/peak.log" | tail -n "$gpus" | while read -r line; do result peak "$line"; done
    result peak.rate "$(rate peak 1 "$gpus")"
    result peak.node "$(peaks "$out/peak.memory.json")"
}

a() {
    train a "$work/a" "$gpus" || return 1
    result a "uninterrupted, $gpus GPU(s): $(rate a 3 "$gpus")"
    result a.memory "$(peaks "$out/a.memory.json")"
    du -sh "$work/a"/checkpoint-* "$work/a/final" 2>/dev/null | tee -a "$out/results.txt"
    result a.final "$("$py" "$repo/scripts/final-check.py" "$work/a/final" "$work/inputs/model" "$work/a/checkpoint-$steps" 2>&1 | tail -n 1)"
    rm -rf "$work/a"/checkpoint-* "$work/a/final" # the disk holds about two 8B checkpoints at once
}

b1() {
    RESTARTS=0 train b1 "$work/b" "$gpus" "$stop1"
    [[ -e $work/b/ctrain-preempted.json ]] || { result b1 "FAILED: not preempted"; return 1; }
    result b1 "preempted: $(tr -d '\n ' <"$work/b/ctrain-preempted.json")"
    result b1.memory "$(peaks "$out/b1.memory.json")"
    du -sh "$work/b"/checkpoint-* | tee -a "$out/results.txt"
}

b2() {
    local half=$((gpus > 1 ? gpus / 2 : 1))
    [[ -e $work/b/ctrain-preempted.json ]] || { echo "no preempted run in $work/b: run b1 on this machine"; return 1; }
    RESTARTS=1 train b2 "$work/b" "$half" "$stop2"
    [[ -e $work/b/ctrain-preempted.json ]] || { result b2 "FAILED: not preempted"; return 1; }
    result b2 "resumed on $half GPU(s), preempted again: $(tr -d '\n ' <"$work/b/ctrain-preempted.json")"
    result b2.memory "$(peaks "$out/b2.memory.json")"
}

b3() {
    RESTARTS=2 train b3 "$work/b" "$gpus" || return 1
    result b3 "resumed on $gpus GPU(s) to the end"
    ls "$work/b/final" | tee -a "$out/results.txt"
}

# compare: B's losses (b1, b2, b3: whichever ran) against A's, step by step.
compare() {
    "$py" - "$out" <<'PY' | tee -a "$out/results.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def losses(name):
    return {r["step"]: r["loss"] for r in map(json.loads, open(out / f"{name}.metrics.jsonl")) if "loss" in r}
a = losses("a")
b = {}
for run in ("b1", "b2", "b3"):  # metrics.jsonl is one file across the resumed runs: the last value of a step wins
    if (out / f"{run}.metrics.jsonl").exists():
        b.update(losses(run))
worst = 0.0
for step in sorted(a):
    if step not in b:
        continue
    d = b[step] - a[step]
    worst = max(worst, abs(d))
    print(f"step {step:3d}  uninterrupted {a[step]:.4f}  preempted and resumed {b[step]:.4f}  diff {d:+.4f}")
print(f"largest loss difference: {worst:.4f}")
PY
}

rc=0
for phase in ${phases//,/ }; do
    case $phase in
        inputs | load | peak | a | b1 | b2 | b3 | compare) "$phase" || { rc=$?; say "$phase: exit $rc"; break; } ;;
        *) echo "unknown phase $phase; phases: inputs, load, peak, a, b1, b2, b3, compare"; exit 2 ;;
    esac
done
exit $rc
