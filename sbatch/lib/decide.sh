# ctrain_failed_node DIR: "EXIT-CODE HOST" of the node whose launcher failed first (an exit code
# other than 0 and CTRAIN_REQUEUE_EXIT in its node-N.done), nothing when none did.
ctrain_failed_node() {
    local file rc host
    while read -r file; do
        read -r rc host <"$file" || continue
        [[ $rc == 0 || $rc == "$CTRAIN_REQUEUE_EXIT" ]] || { echo "$rc $host"; return; }
    done < <(ls -1tr "$1"/node-*.done 2>/dev/null)
}

# ctrain_decide DIR RC EVENT: the run's fate, decided once, by the batch script after the step
# (EVENT exited: srun exited RC) or by the sentinel in its place (batch-gone), from what the step left
# in DIR (CTRAIN_PIDS) and the signal the batch script got; most specific cause first:
#   a lost node (ctrain_guard's or the sentinel's `lost`, or, after a step that failed with no
#   rank's record to explain it, a node that does not answer CTRAIN_SETTLE seconds later): requeue
#   without it;
#   a rank's own record that a retry cannot help (ctrain_rank_exit): end;
#   a hang (the watchdog's `hung`), a launcher that failed on a live node, or a failed step that
#   nothing explains: retry once;
#   else requeue when the run or Slurm's warning asked for it.
# One `ctrain: failure:` line names the cause. The run's state (ctrain_transition) makes it once: a
# second decider finds the run decided, or deciding on a live host, and does nothing.
ctrain_decide() {
    local dir=$1 rc=$2 event=$3 hung= lost= failed final nodes=() outcome cause=${CTRAIN_SIGNAL:-none} unfit
    ctrain_transition "$event" || return 0
    [[ ! -e $dir/hung ]] || hung=1
    [[ ! -e $dir/lost ]] || lost=$(sort -u "$dir/lost" | paste -sd' ')
    failed=$(ctrain_failed_node "$dir")
    final=$(ctrain_rank_exit "$dir/exit")
    unfit=$(ctrain_unfit_nodes "$dir/unfit")
    CTRAIN_REQUEUED=
    if [[ -z $unfit && -z $lost && -z $final && $rc != 0 && $rc != "$CTRAIN_REQUEUE_EXIT" && $CTRAIN_SIGNAL != TERM ]]; then
        # A node dying slowly takes its processes in any order (a launcher, this step's srun, the
        # guard) while its slurmd may still answer: after CTRAIN_SETTLE seconds every node is asked.
        sleep "$CTRAIN_SETTLE"
        mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        ctrain_probe "${nodes[@]}"
        lost=${CTRAIN_UNANSWERED[*]}
    fi
    if [[ -n $unfit && -z $CTRAIN_SIGNAL ]]; then
        local host check message
        while read -r host check message; do
            echo "ctrain: failure: preflight: $host is unfit ($check): $message"
        done < <(head -n 20 "$dir/unfit")
        cause=preflight
        mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        if ((${#nodes[@]} > 1)) && [[ $(wc -w <<<"$unfit") -ge ${#nodes[@]} ]]; then
            echo "ctrain: not requeueing: every node of the job failed the preflight, so the fault is the job's" \
                "(its image, its settings, the shared file system), not a node's: fix it and submit again"
        else
            # shellcheck disable=SC2086 # one word per node
            ctrain_requeue_without $unfit
        fi
    elif [[ -n $lost ]]; then
        echo "ctrain: failure: node lost: $lost (${CTRAIN_LOST_WHY:-its launcher never ended and its slurmd does not answer})"
        cause=node-lost
        # shellcheck disable=SC2086 # one word per node
        ctrain_requeue_without $lost
        # The job's end cannot reach Slurm from a lost batch host (or from a sentinel's decision):
        # without the scancel it would stay RUNNING until Slurm declares the node dead.
        if [[ -z $CTRAIN_REQUEUED && " $lost " == *" $CTRAIN_BATCH_HOST "* ]] && ctrain_job_is RUNNING PENDING; then
            echo "ctrain: ending job $SLURM_JOB_ID (scancel): its batch script was lost with $CTRAIN_BATCH_HOST"
            scancel "$SLURM_JOB_ID"
        fi
    elif [[ -n $final && -z $CTRAIN_SIGNAL ]]; then
        local rank code host message
        read -r rank code cause host message <<<"$final"
        echo "ctrain: failure: rank $rank on $host ended with $code ($cause): $message"
        echo "ctrain: not requeueing: a $cause failure repeats on a retry; fix it and submit again"
        cause=rank-$cause
    elif [[ -n $hung ]]; then
        echo "ctrain: failure: a rank stopped making progress (the 'hang:' lines above); the step was ended"
        cause=hang
        ctrain_retry_once
    elif [[ -n $failed && -z $CTRAIN_SIGNAL ]]; then
        echo "ctrain: failure: a rank failed on a live node: ${failed#* }'s launcher exited with ${failed%% *}" \
            "first (a rank killed, e.g. out of memory, or an error in the training code)"
        cause=rank-failed
        ctrain_retry_once
    elif [[ $rc != 0 && $rc != "$CTRAIN_REQUEUE_EXIT" && -z $CTRAIN_SIGNAL ]]; then
        echo "ctrain: failure: the training step ended with $rc and no node or rank said why (its srun or" \
            "launchers were killed, e.g. out of memory); every node answers"
        cause=step-failed
        ctrain_retry_once
    else
        ctrain_requeue_if_asked "$rc"
    fi
    if [[ -n $CTRAIN_REQUEUED ]]; then
        outcome=requeued
    elif [[ $CTRAIN_SIGNAL == TERM ]]; then
        outcome=left
    elif [[ $rc == 0 && -z $lost ]]; then
        outcome=finished
    else
        outcome=ended
    fi
    ctrain_transition "$outcome" && ctrain_mark decided "$outcome" "$cause"
}

# ctrain_unfit_nodes FILE: the job's nodes named in the preflight's unfit FILE (CTRAIN_PIDS/unfit),
# one line; a name that is not one of the job's nodes is ignored (the file is data, written by ranks).
ctrain_unfit_nodes() {
    [[ -s $1 ]] || return 0
    local nodes=() node names
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    names=$(cut -d' ' -f1 "$1" | head -n 1000 | sort -u)
    for node in "${nodes[@]}"; do
        grep -qxF -- "$node" <<<"$names" && echo "$node"
    done | paste -sd' '
}

# ctrain_unreported DIR: the hosts of the job whose launcher has not reported its end (no node-N.done).
ctrain_unreported() {
    local hosts=() node
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    for node in "${!hosts[@]}"; do
        [[ -e $1/node-$node.done ]] || echo "${hosts[node]}"
    done
}

# ctrain_probe NODE...: CTRAIN_UNANSWERED, the nodes whose slurmd does not answer, asked all at once.
# While the job runs: a short step on each (10 s). Once Slurm has ended or requeued it (the sentinel,
# after the batch script died before deciding): a connection to the node's slurmd port (5 s). The
# answer is an array, not output: on a dying node a command substitution's subshell can be killed
# and return nothing, which would read as "every node answers". A probe SIGKILLed before its time
# is up was killed on this node, which is dying: this node is counted, not the one it asked; and
# when this node does not answer its own probe, the others' silence is not believed either.
ctrain_probe() {
    local nodes=("$@") probes=() node port= addr started=$SECONDS here=${SLURMD_NODENAME:-$CTRAIN_BATCH_HOST}
    CTRAIN_UNANSWERED=()
    if ! ctrain_job_is RUNNING; then
        port=$(scontrol show config | sed -n 's/^SlurmdPort *= *\([0-9]*\)$/\1/p')
    fi
    for node in "${nodes[@]}"; do
        if [[ -z $port ]]; then
            timeout --signal=KILL 10 srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" true >/dev/null 2>&1 &
        else
            addr=$(scontrol show node -o "$node" | grep -o 'NodeAddr=[^ ]*')
            timeout --signal=KILL 5 bash -c ': <>"/dev/tcp/$0/$1"' "${addr#NodeAddr=}" "$port" >/dev/null 2>&1 &
        fi
        probes+=($!)
    done
    for node in "${!nodes[@]}"; do
        wait "${probes[node]}" && continue
        if (($? == 137 && SECONDS - started < 3)); then
            [[ " ${CTRAIN_UNANSWERED[*]} " == *" $here "* ]] || CTRAIN_UNANSWERED+=("$here")
        elif [[ " ${CTRAIN_UNANSWERED[*]} " != *" ${nodes[node]} "* ]]; then
            CTRAIN_UNANSWERED+=("${nodes[node]}")
        fi
    done
    # This node's own slurmd does not answer: it is dying, and its probes of the others fail with it
    # (seen in CI: a healthy node2 named lost with the dying batch host). Only this node is named.
    if [[ " ${CTRAIN_UNANSWERED[*]} " == *" $here "* ]]; then
        CTRAIN_UNANSWERED=("$here")
    fi
}

# ctrain_job_is STATE...: whether Slurm has the job in one of the STATEs (RUNNING, PENDING, ...).
ctrain_job_is() {
    local record state
    record=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || return 1
    for state; do
        [[ $record != *" JobState=$state "* ]] || return 0
    done
    return 1
}

# ctrain_rank_exit DIR: "RANK CODE CAUSE HOST MESSAGE" of the first rank (by time) whose own record
# in DIR (CTRAIN_EXITS, written by `ctrain train` as it ends: src/ctrain/train/exits.py) says a
# retry cannot change the outcome (a NaN loss, a recipe error, an exception in the training code);
# nothing when no rank's does. The record is data: it is only ever printed.
ctrain_rank_exit() {
    local file code cause retry host message
    while read -r file; do
        read -r code cause retry host message <"$file" || continue
        [[ $code != 0 && $retry == end ]] || continue
        echo "${file##*/rank-} $code $cause $host $message"
        return
    done < <(ls -1tr "$1"/rank-* 2>/dev/null)
}
