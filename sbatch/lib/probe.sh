# Asking Slurm and the job's nodes: whether a node answers, the job's state, a command on every node.

# ctrain_probe OUT NODE...: sets the caller's array OUT to the nodes whose slurmd does not answer, asked
# all at once.
# While the job runs: a short step on each (10 s). Once Slurm has ended or requeued it (the sentinel,
# after the batch script died before deciding): a connection to the node's slurmd port (5 s). The
# answer is an array, not output: on a dying node a command substitution's subshell can be killed
# and return nothing, which would read as "every node answers". A probe SIGKILLed before its time
# is up was killed on this node, which is dying: this node is counted, not the one it asked; and
# when this node does not answer its own probe, the others' silence is not believed either.
ctrain_probe() {
    local -n _unanswered=$1
    shift
    local nodes=("$@") probes=() node port= addr started=$SECONDS here=${SLURMD_NODENAME:-$CTRAIN_BATCH_HOST}
    _unanswered=()
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
            [[ " ${_unanswered[*]} " == *" $here "* ]] || _unanswered+=("$here")
        elif [[ " ${_unanswered[*]} " != *" ${nodes[node]} "* ]]; then
            _unanswered+=("${nodes[node]}")
        fi
    done
    # This node's own slurmd does not answer: it is dying, and its probes of the others fail with it
    # (seen in CI: a healthy node2 named lost with the dying batch host). Only this node is named.
    if [[ " ${_unanswered[*]} " == *" $here "* ]]; then
        _unanswered=("$here")
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

# ctrain_on_nodes SCRIPT ARG...: run `sh -c SCRIPT` once on every node of the step, on the host,
# beside the training step (the launcher's PID is in ARG1/NODE.pid). Given up after two minutes:
# a node that does not answer must not hold the batch shell.
ctrain_on_nodes() {
    local script=$1
    shift
    timeout 120 srun --overlap --nodes="$CTRAIN_NNODES" --ntasks="$CTRAIN_NNODES" --ntasks-per-node=1 \
        sh -c "$script" ctrain-on-node "$@"
}
