# Watching the step from outside: a failed launcher (the guard), ranks without progress (the hang
# watchdog), nodes gone silent; and ending the step.

# ctrain_guard (in the background, beside the step): end the step soon after one node's launcher
# failed. The other nodes' launchers normally follow within seconds (their collectives fail, and
# srun's --kill-on-bad-exit ends the rest), but a node that is gone cannot report: srun then waits
# for its task until slurmctld declares the node dead (SlurmdTimeout, 300 s by default), with no
# rank left anywhere. So after CTRAIN_STEP_GRACE seconds the nodes whose launcher has not ended
# are asked (a short step each) whether they answer; those that do not are lost (written to
# CTRAIN_RUN_DIR/lost, for ctrain_run), and the step is ended: SIGKILL to what is left of it, then
# to srun. A step whose launchers have all ended is left alone (Apptainer may still be cleaning up).
ctrain_guard() {
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR failed= since
    local missing=() lost=()
    while [[ -z $failed ]]; do
        sleep 1
        failed=$(ctrain_failed_node "$dir")
    done
    since=$SECONDS
    while :; do
        mapfile -t missing < <(ctrain_unreported "$dir")
        ((${#missing[@]} > 0)) || return 0
        ((SECONDS - since < CTRAIN_STEP_GRACE)) || break
        sleep 1
    done
    ctrain_probe lost "${missing[@]}"
    echo "ctrain: ${failed#* }'s launcher exited with ${failed%% *}; ${CTRAIN_STEP_GRACE}s later" \
        "${missing[*]} had not ended${lost[*]:+, and ${lost[*]} does not answer}: ending the step"
    ((${#lost[@]} == 0)) || echo "${lost[*]}" >"$dir/lost"
    ctrain_transition ending
    ctrain_end_step
}

# ctrain_stop PID: end a background srun (TERM, then KILL after 2 s: with a node gone, srun may wait).
ctrain_stop() {
    kill "$1" 2>/dev/null || return 0
    local waited=0
    while kill -0 "$1" 2>/dev/null && ((waited++ < 20)); do sleep 0.1; done
    kill -KILL "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}

# End the training step now: SIGKILL to every process of it on the nodes that still answer, then to
# srun, which would otherwise wait for the tasks of a node that does not.
# scancel is not waited for: with a node gone it can take slurmctld's MessageTimeout to return.
ctrain_end_step() {
    ctrain_kill_step
    sleep 2
    kill -KILL "$CTRAIN_STEP_PID" 2>/dev/null
}

# ctrain_kill_step: SIGKILL, in the background, every process of the training step (its id is in
# CTRAIN_RUN_DIR/step) on the nodes that still answer.
ctrain_kill_step() {
    local step
    if step=$(cat "$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR/step" 2>/dev/null); then
        timeout --signal=KILL 30 scancel --signal=KILL "$SLURM_JOB_ID.$step" 2>/dev/null &
    fi
}

# ctrain_watchdog (in the background, beside the step): watch the ranks' progress from outside.
# Every rank rewrites CTRAIN_HEARTBEATS/rank-R ("STEP HOST PID") when it finishes a step, an eval
# batch or a save. A stopped rank, or one stuck in a collective, cannot report itself, and the
# collective timeout of torch.distributed is 30 minutes. The watchdog arms at the first heartbeat
# (start-up, model loading and the first compile are not counted) and, once any rank has gone
# CTRAIN_HANG_TIMEOUT seconds without one, names the ranks, shows their processes' states and
# ends the step as a lost rank ends it: the workers are killed, the launchers and srun follow.
# A rank whose run is over writes "done" there and is no longer expected to step (rank 0 may
# still be evaluating the final model, beating per batch).
# A node that goes silent without closing its connections (frozen, cut off the network) fails no
# launcher: every rank just waits in its collective. So in a job of several nodes, once a rank has
# gone CTRAIN_NODE_CHECK seconds without a heartbeat, and again every CTRAIN_NODE_CHECK seconds while
# that lasts, every node is asked whether its slurmd answers (ctrain_silent).
ctrain_watchdog() {
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS budget=$CTRAIN_HANG_TIMEOUT check=$CTRAIN_NODE_CHECK
    local world=$((CTRAIN_NNODES * CTRAIN_NPROC_PER_NODE)) poll=$((CTRAIN_HANG_TIMEOUT / 10))
    ((CTRAIN_NNODES > 1)) || check=0
    ((budget > 0)) || poll=30
    ((check == 0 || poll <= check / 10)) || poll=$((check / 10))
    ((poll >= 1)) || poll=1
    ((poll <= 30)) || poll=30
    local -A seen since
    local -A finished
    local armed= file rank stamp now idle quiet asked=0 stale=() first
    while ((${#stale[@]} == 0)); do
        sleep "$poll"
        now=$SECONDS
        for file in "$dir"/rank-*; do
            rank=${file##*/rank-}
            stamp=$(stat -c %.9Y "$file" 2>/dev/null) || continue
            [[ ${seen[$rank]-} == "$stamp" ]] || { seen[$rank]=$stamp; since[$rank]=$now; }
            : "${armed:=$now}"
            read -r first _ <"$file" 2>/dev/null && [[ $first == "done" ]] && finished[$rank]=1
        done
        [[ -n $armed ]] || continue
        quiet=0
        for ((rank = 0; rank < world; rank++)); do
            [[ -z ${finished[$rank]-} ]] || continue # its run is over (rank 0 may still evaluate)
            idle=$((now - ${since[$rank]:-$armed}))
            ((idle <= quiet)) || quiet=$idle
            ((budget == 0 || idle <= budget)) || stale+=("$rank:$idle")
        done
        if ((${#stale[@]} == 0 && check > 0 && quiet >= check && now - asked >= check)); then
            asked=$now
            ctrain_silent "$quiet" && return 0
        fi
    done
    ctrain_hung "$dir" "${stale[@]}"
}

# ctrain_silent SECONDS: ask every node of the job whether its slurmd answers (ctrain_probe), after
# SECONDS without a finished step on some rank; when one does not, it is lost (CTRAIN_RUN_DIR/lost) and
# the step is ended. Fails (nothing done) when every node answers: a long step, evaluation or save.
# A probe needs the controller too, so a controller that is restarting or too slow makes healthy
# nodes look silent: the silent ones are asked a second time, and the controller before and after;
# a healthy run is not ended for the controller's sake.
ctrain_silent() {
    local nodes=() silent=() again=()
    ctrain_job_is RUNNING || return 1
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ctrain_probe silent "${nodes[@]}"
    ((${#silent[@]} > 0)) || return 1
    ctrain_probe again "${silent[@]}"
    ((${#again[@]} > 0)) && ctrain_job_is RUNNING || return 1
    echo "ctrain: no finished step for ${1}s, and ${again[*]} does not answer, asked twice (frozen, or" \
        "cut off the network): ending the step"
    echo "${again[*]}" >"$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR/lost"
    ctrain_transition ending
    ctrain_end_step
}

# ctrain_hung DIR RANK:IDLE...: report the ranks without progress, with the state of each worker
# process (T: stopped, D: uninterruptible, in the kernel or a driver; S or R: alive, e.g. waiting
# in a collective for a rank that is not), then end the step.
ctrain_hung() {
    local dir=$1 entry rank idle step host pid stat
    shift
    echo "ctrain: hang: no finished step for more than CTRAIN_HANG_TIMEOUT=${CTRAIN_HANG_TIMEOUT}s on $# rank(s); ending the step"
    local -A state
    while read -r host pid stat; do
        state[$host $pid]=$stat
    done < <(ctrain_on_nodes 'ps -o pid=,stat= --ppid "$(cat "$1/$(uname -n).pid")" | sed "s/^ */$(uname -n) /"' \
        "$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR")
    local culprits=()
    for entry in "$@"; do
        rank=${entry%%:*} idle=${entry#*:} step=- host='?' pid='?'
        [[ ! -r $dir/rank-$rank ]] || read -r step host pid <"$dir/rank-$rank"
        echo "ctrain: hang: rank $rank on $host (pid $pid): last step $step, no progress for ${idle}s," \
            "process state ${state[$host $pid]:-gone}"
        [[ ${state[$host $pid]:-gone} != [TDZ]* && -n ${state[$host $pid]-} ]] || culprits+=("rank $rank on $host")
    done
    if ((${#culprits[@]} > 0)); then
        echo "ctrain: hang: not running (stopped, stuck in the kernel, or gone): $(IFS=,; echo "${culprits[*]}")"
    else
        echo "ctrain: hang: every rank is alive but none finishes a step: a collective that some rank never joined?"
    fi
    echo "$*" >"$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR/hung"
    ctrain_transition ending
    ctrain_on_nodes 'pkill -KILL -P "$(cat "$1/$(uname -n).pid")"' "$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR"
}
