# A run's fate, decided once, in three steps: its facts (facts.sh: the run's directory; probe.sh:
# whether the nodes answer), ctrain_classify (no I/O: facts in, "ACTION CAUSE [NODE...]" out), and
# ctrain_act (requeue, end, log). The batch script decides after its step ends; a sentinel decides
# in its place when the batch host is gone (sentinel.sh). tests/unit/test_decide.py holds the
# classifier's table.

# ctrain_classify OUT FACT...: sets the caller's variable OUT to the decision for a run's end, from the
# FACTs alone (KEY=VALUE, each optional):
#   rc            the training step's exit code (0)
#   signal        what the batch script got: TERM (Slurm's: scancel, requeue, preemption), USR1 (the
#                 time-limit warning), or nothing
#   requeue_exit  the trainer's "checkpointed, requeue me" exit code (75)
#   nodes         the job's node count
#   unfit, lost   nodes the preflight found unfit; nodes that do not answer (space-separated)
#   rank          the first rank's own record that a retry cannot help: RANK CODE CAUSE HOST MESSAGE
#   hung          1: the watchdog found a rank without progress
#   failed        CODE HOST of the first launcher that failed
#   probed        1: every node was asked whether it answers (its answer is in lost)
# The decision, most specific cause first:
#   exclude preflight|node-lost NODE...  requeue without the nodes (unfit, or lost: lost wins over
#                                        what the ranks it took down recorded)
#   end preflight                        every node of a multi-node job is unfit: the job's fault
#   end rank-CAUSE                       a rank's record says a retry fails the same way
#   retry hang|rank-failed|step-failed   requeue once per job
#   probe                                the step failed and nothing says why: ask every node, then
#                                        classify again with probed=1
#   leave TERM                           Slurm's TERM: Slurm decides whether the job runs again
#   requeue USR1|none                    the run asked to come back: the warning, or the requeue exit code
#   finish none                          the step ended well
ctrain_classify() {
    local -n _decision=$1
    shift
    local rc=0 signal= requeue_exit=75 nodes=1 unfit= lost= rank= hung= failed= probed= fact cause
    for fact; do
        case ${fact%%=*} in
            rc | signal | requeue_exit | nodes | unfit | lost | rank | hung | failed | probed) local "$fact" ;;
            *)
                echo "ctrain: error: ctrain_classify: '$fact' is not one of its facts" >&2
                return 2
                ;;
        esac
    done
    local failing= unfit_nodes=()
    [[ $rc == 0 || $rc == "$requeue_exit" ]] || failing=1
    read -ra unfit_nodes <<<"$unfit"
    if [[ -z $probed && -z $unfit && -z $lost && -z $rank && -n $failing && $signal != TERM ]]; then
        _decision=probe
    elif [[ -n $unfit && -z $signal ]]; then
        if ((nodes > 1 && ${#unfit_nodes[@]} >= nodes)); then
            _decision="end preflight"
        else
            _decision="exclude preflight $unfit"
        fi
    elif [[ -n $lost ]]; then
        _decision="exclude node-lost $lost"
    elif [[ -n $rank && -z $signal ]]; then
        read -r _ _ cause _ <<<"$rank"
        _decision="end rank-$cause"
    elif [[ -n $hung ]]; then
        _decision="retry hang"
    elif [[ -n $failed && -z $signal ]]; then
        _decision="retry rank-failed"
    elif [[ -n $failing && -z $signal ]]; then
        _decision="retry step-failed"
    elif [[ $signal == TERM ]]; then
        _decision="leave TERM"
    elif [[ $signal == USR1 || $rc == "$requeue_exit" ]]; then
        _decision="requeue ${signal:-none}"
    else
        _decision="finish none"
    fi
}

# ctrain_outcome REQUEUED SIGNAL RC LOST: the run's decided state (CTRAIN_LIFE) once the decision was
# acted on: requeued, left (Slurm's TERM), finished, or ended.
ctrain_outcome() {
    if [[ -n $1 ]]; then
        echo requeued
    elif [[ $2 == TERM ]]; then
        echo left
    elif [[ $3 == 0 && -z $4 ]]; then
        echo finished
    else
        echo ended
    fi
}

# ctrain_decide DIR RC EVENT [WHY]: the run's fate, decided once, by the batch script after the step
# (EVENT exited: srun exited RC) or by the sentinel in its place (batch-gone; WHY says how the batch
# host was found lost), from what the step left in DIR (the run's directory) and the signal the batch
# script got. One `ctrain: failure:` line names the cause. The run's state (ctrain_transition) makes
# it once: a second decider finds the run decided, or deciding on a live host, and does nothing.
ctrain_decide() {
    local dir=$1 rc=$2 event=$3 why=${4:-} facts=() decision lost=() hosts=() action cause nodes requeued= outcome
    ctrain_transition "$event" || return 0
    facts=("rc=$rc" "signal=${CTRAIN_SIGNAL:-}" "requeue_exit=$CTRAIN_REQUEUE_EXIT")
    ctrain_facts facts "$dir"
    ctrain_classify decision "${facts[@]}"
    if [[ $decision == probe ]]; then
        # A node dying slowly takes its processes in any order (a launcher, this step's srun, the
        # guard) while its slurmd may still answer: after CTRAIN_SETTLE seconds every node is asked.
        sleep "$CTRAIN_SETTLE"
        mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        ctrain_probe lost "${hosts[@]}"
        ctrain_classify decision "${facts[@]}" probed=1 "lost=${lost[*]}"
    fi
    read -r action cause nodes <<<"$decision"
    # shellcheck disable=SC2086 # one word per node
    ctrain_act "$action" "$cause" "$dir" "$rc" "$why" $nodes && requeued=1
    local fact words=()
    for fact in "${facts[@]}"; do
        [[ $fact == lost=* ]] || continue
        read -ra words <<<"${fact#lost=}"
        lost+=("${words[@]}")
    done
    outcome=$(ctrain_outcome "$requeued" "${CTRAIN_SIGNAL:-}" "$rc" "${lost[*]}")
    ctrain_transition "$outcome" && ctrain_mark decided "$outcome" "$cause"
    return 0
}

# ctrain_act ACTION CAUSE DIR RC WHY [NODE...]: carry out ctrain_classify's decision and say why;
# returns 0 when the job was requeued.
ctrain_act() {
    local action=$1 cause=$2 dir=$3 rc=$4 why=$5
    shift 5
    case $action in
        exclude) ctrain_act_exclude "$cause" "$dir" "$why" "$@" ;;
        end) ctrain_act_end "$cause" "$dir" ;;
        retry)
            case $cause in
                hang) echo "ctrain: failure: a rank stopped making progress (the 'hang:' lines above); the step was ended" ;;
                rank-failed)
                    local failed
                    failed=$(ctrain_failed_node "$dir")
                    echo "ctrain: failure: a rank failed on a live node: ${failed#* }'s launcher exited with" \
                        "${failed%% *} first (a rank killed, e.g. out of memory, or an error in the training code)"
                    ;;
                *) echo "ctrain: failure: the training step ended with $rc and no node or rank said why (its srun or" \
                    "launchers were killed, e.g. out of memory); every node answers" ;;
            esac
            ctrain_retry_once
            ;;
        *) ctrain_requeue_if_asked "$rc" ;;
    esac
}

# ctrain_unfit_lines DIR: the preflight's findings, one `ctrain: failure:` line each (at most 20).
ctrain_unfit_lines() {
    local host check message
    while read -r host check message; do
        echo "ctrain: failure: preflight: $host is unfit ($check): $message"
    done < <(head -n 20 "$1/unfit")
}

# ctrain_act_exclude CAUSE DIR WHY NODE...: requeue without the unfit or lost nodes. A lost batch host
# cannot tell Slurm that its job ended (nor can a sentinel's decision): without the scancel the job
# would stay RUNNING until Slurm declares the node dead.
ctrain_act_exclude() {
    local cause=$1 dir=$2 why=$3
    shift 3
    local how=()
    if [[ $cause == preflight ]]; then
        ctrain_unfit_lines "$dir"
    else
        echo "ctrain: failure: node lost: $* (${why:-its launcher never ended and its slurmd does not answer})"
        how=(--continue) # Slurm holds a requeued job on a node that does not answer for minutes
    fi
    ctrain_requeue_without "${how[@]}" "$@" && return 0
    if [[ $cause == node-lost && " $* " == *" $CTRAIN_BATCH_HOST "* ]] && ctrain_job_is RUNNING PENDING; then
        echo "ctrain: ending job $SLURM_JOB_ID (scancel): its batch script was lost with $CTRAIN_BATCH_HOST"
        scancel "$SLURM_JOB_ID"
    fi
    return 1
}

# ctrain_act_end CAUSE DIR: end the run, saying why a retry cannot help.
ctrain_act_end() {
    if [[ $1 == preflight ]]; then
        ctrain_unfit_lines "$2"
        echo "ctrain: not requeueing: every node of the job failed the preflight, so the fault is the job's" \
            "(its image, its settings, the shared file system), not a node's: fix it and submit again"
        return 1
    fi
    local rank code cause host message
    read -r rank code cause host message < <(ctrain_rank_exit "$2/exit")
    echo "ctrain: failure: rank $rank on $host ended with $code ($cause): $message"
    echo "ctrain: not requeueing: a $cause failure repeats on a retry; fix it and submit again"
    return 1
}
