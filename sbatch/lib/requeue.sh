# Requeueing the job, each way a decision asks for it. Every function returns 0 when the job was
# requeued, 1 when it was not (and says why).

# ctrain_requeue_if_asked RC: the run asked to come back: it was warned of the time limit, or the
# trainer exited with its requeue code after saving a checkpoint. The requeued job resumes from that
# checkpoint.
ctrain_requeue_if_asked() {
    local rc=$1 restarts
    restarts=$(ctrain_restarts)
    if [[ $CTRAIN_SIGNAL == TERM ]]; then
        # Slurm itself requeues a job it preempted or was told to requeue; scancel means stop.
        echo "ctrain: SIGTERM came from Slurm (scancel, scontrol requeue or preemption): Slurm decides whether the job runs again"
        return 1
    fi
    [[ $CTRAIN_SIGNAL == USR1 || $rc -eq $CTRAIN_REQUEUE_EXIT ]] || return 1
    if ((restarts >= CTRAIN_MAX_REQUEUES)); then
        echo "ctrain: not requeueing: already restarted $restarts times (CTRAIN_MAX_REQUEUES=$CTRAIN_MAX_REQUEUES)"
        return 1
    fi
    echo "ctrain: requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); $(ctrain_resumes)"
    ctrain_requeue
}

# ctrain_requeue [EXCLUDED]: requeue the job (once Slurm has requeued it, as after a node failure, only
# its excluded nodes change), with EXCLUDED as its ExcNodeList. A requeue TERMs
# this shell, which from here on ignores TERM, so that the decision is recorded (the run's state and
# the timeline) whenever Slurm's TERM arrives; Slurm's SIGKILL comes KillWait seconds later. (The
# TERM used to be caught again right after the requeue, and a TERM that came late killed the shell
# before it recorded the decision: seen in a chaos soak.) Only a pending job's ExcNodeList can
# change, so it is set after the requeue.
ctrain_requeue() {
    trap '' TERM
    ctrain_job_is PENDING || scontrol requeue "$SLURM_JOB_ID" || return 1
    [[ -z ${1-} ]] || scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$1"
}

# ctrain_retry_once: a rank failed or hung on a node that is still up (killed by the kernel for
# memory, a transient device or network fault, or a bug in the training code, which fails the same
# way again): requeue once per job, within CTRAIN_MAX_REQUEUES; the next run resumes from the last checkpoint.
ctrain_retry_once() {
    local restarts marker=$CTRAIN_PROJECT_DIR/.ctrain/$CTRAIN_RUN.retried
    restarts=$(ctrain_restarts)
    if [[ -e $marker ]]; then
        echo "ctrain: not requeueing: the job was already retried once after a failed or hung rank; the failure" \
            "above repeats, so it is likely in the training code or the data"
        return 1
    elif ((restarts >= CTRAIN_MAX_REQUEUES)); then
        echo "ctrain: not requeueing: already restarted $restarts times (CTRAIN_MAX_REQUEUES=$CTRAIN_MAX_REQUEUES)"
        return 1
    fi
    : >"$marker"
    echo "ctrain: requeueing job $SLURM_JOB_ID once (restart $((restarts + 1))); $(ctrain_resumes)"
    ctrain_requeue
}

# ctrain_requeue_without [--continue] NODE...: requeue the job with the nodes excluded, where the
# partition still has enough nodes in service without them (and without those excluded before);
# otherwise end, naming the nodes. Requeued as it was, the job would wait for them: PENDING, with no
# end, on nodes that are DOWN. --continue (lost nodes, which Slurm holds the job on for minutes): a
# continuation instead (ctrain_continue), and the requeue only where that cannot be.
ctrain_requeue_without() {
    local restarts excluded before usable=0 node state continue=
    [[ ${1-} != --continue ]] || { continue=1 && shift; }
    restarts=$(ctrain_restarts)
    before=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*')
    before=${before#ExcNodeList=}
    [[ $before != "(null)" ]] || before=
    excluded=$({ [[ -z $before ]] || scontrol show hostnames "$before"; printf '%s\n' "$@"; } | sort -u | paste -sd,)
    excluded=$(scontrol show hostlist "$excluded")
    while read -r node state; do
        [[ $state =~ ^(idle|mix|mixed|alloc|allocated|comp|completing)$ ]] || continue
        scontrol show hostnames "$excluded" | grep -qx "$node" || usable=$((usable + 1))
    done < <(sinfo -h -N -p "${SLURM_JOB_PARTITION:-}" -o '%N %t' | sort -u)
    if ((restarts >= CTRAIN_MAX_REQUEUES)); then
        echo "ctrain: not requeueing: already restarted $restarts times (CTRAIN_MAX_REQUEUES=$CTRAIN_MAX_REQUEUES)"
        return 1
    elif ((usable < CTRAIN_NNODES)); then
        echo "ctrain: not requeueing: partition ${SLURM_JOB_PARTITION:-} has $usable node(s) in service besides" \
            "$excluded, the job needs $CTRAIN_NNODES; submit it again once $* is back (sinfo -n $*)," \
            "or on fewer nodes; $(ctrain_resumes)"
        return 1
    fi
    if [[ -n $continue ]]; then
        ctrain_continue "$excluded" "$@"
        case $? in
            0) return 0 ;;
            2) return 1 ;;
        esac
    fi
    echo "ctrain: requeueing job $SLURM_JOB_ID (restart $((restarts + 1))) without $excluded" \
        "(ExcNodeList); $(ctrain_resumes)${continue:+ once Slurm has let go of the lost node}"
    ctrain_requeue "$excluded" && return 0
    echo "ctrain: requeueing without $excluded failed (above)"
    return 1
}

# ctrain_resumes: what the next run starts from, as the messages above say it: a recipe's run from its
# last complete checkpoint; a command of your own from whatever it saves itself, if anything.
ctrain_resumes() {
    if ((${#CTRAIN_COMMAND[@]} > 0)); then
        echo "it starts your command again, which resumes only from a checkpoint it saves and loads itself"
    else
        echo "it resumes from the last checkpoint"
    fi
}
