ctrain_run() {
    CTRAIN_SRUN=(
        srun
        --label                     # "N: " before each line: N is the node (one task per node)
        --kill-on-bad-exit=1        # one node failing ends the step everywhere
        --nodes="$CTRAIN_NNODES"
        --ntasks="$CTRAIN_NNODES"
        --ntasks-per-node=1         # one launcher per node starts the node's workers
    )
    export CTRAIN_PIDS=.ctrain/$SLURM_JOB_ID    # relative to the project directory, on every node
    export CTRAIN_HEARTBEATS=$CTRAIN_PIDS/heartbeat # each rank's progress, written by the trainer
    export CTRAIN_EXITS=$CTRAIN_PIDS/exit           # why each rank ended, written by the trainer
    export CTRAIN_TIMELINE=.ctrain/$SLURM_JOB_ID.timeline # the job's events, kept across requeues
    # Only the variables the job needs (ctrain_task_env, so after every export the tasks read); the
    # first node's task (CTRAIN_TASK) also gets the rendezvous store's address, to host it.
    CTRAIN_SRUN+=(--export="$(ctrain_task_env)${CTRAIN_STORE:+,CTRAIN_STORE=$CTRAIN_STORE}")
    CTRAIN_SRUN+=(
        "${CTRAIN_SRUN_CONTAINER[@]}"
        "${CTRAIN_CONTAINER[@]}"
        sh -c "$CTRAIN_TASK" ctrain-task
        "${CTRAIN_LAUNCH[@]}"
    )
    ctrain_show "${CTRAIN_SRUN[@]}"
    [[ $CTRAIN_DRY_RUN != 1 ]] || return 0

    CTRAIN_SIGNAL=
    rm -rf "${CTRAIN_PROJECT_DIR:?}/$CTRAIN_PIDS" # what a killed run of this job left
    mkdir -p "$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS"
    ctrain_mark start "$(ctrain_submitted)" "$CTRAIN_NNODES" "${SLURM_GPUS_ON_NODE:-0}"
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS rc
    if ! ctrain_preflight; then
        ctrain_decide "$dir" 1 unfit
        ctrain_run_end
        return 1
    fi
    [[ -z $CTRAIN_IMAGE_ENTRY ]] || ctrain_image_cache
    ctrain_mark launched
    "${CTRAIN_SRUN[@]}" &
    CTRAIN_STEP_PID=$!
    ctrain_transition launched
    local watchdog= guard alive= sentinel=
    if ((CTRAIN_NNODES > 1)); then
        ctrain_alive &
        alive=$!
        ctrain_sentinel_step &
        sentinel=$!
    fi
    if ((CTRAIN_HANG_TIMEOUT > 0 || (CTRAIN_NNODES > 1 && CTRAIN_NODE_CHECK > 0))); then
        ctrain_watchdog &
        watchdog=$!
    fi
    ctrain_guard &
    guard=$!
    # #SBATCH --signal=B:USR1@SECONDS warns this shell (only) before the time limit: pass it on.
    trap 'ctrain_forward USR1' USR1
    # Preemption and scancel send TERM to every process of the job themselves: keep waiting
    # for the workers' checkpoint instead of dying first.
    trap 'CTRAIN_SIGNAL=TERM; ctrain_transition terminated' TERM
    while :; do
        wait "$CTRAIN_STEP_PID"
        rc=$?
        kill -0 "$CTRAIN_STEP_PID" 2>/dev/null || break # wait returned early for a trapped signal
    done
    trap - USR1 TERM
    [[ -z $watchdog ]] || kill "$watchdog" 2>/dev/null
    kill "$guard" 2>/dev/null
    echo "ctrain: step exited with $rc${CTRAIN_SIGNAL:+ after SIG$CTRAIN_SIGNAL}"
    ctrain_mark exited "$rc"
    ctrain_decide "$dir" "$rc" exited
    # The sentinel watches until the decision is made: a batch host lost while deciding is still seen.
    if [[ -n $sentinel ]]; then
        kill "$alive" 2>/dev/null
        wait "$alive" 2>/dev/null
        ctrain_stop "$sentinel"
    fi
    ctrain_run_end
    return "$rc"
}

# ctrain_run_end: what a run leaves once it is decided.
ctrain_run_end() {
    rm -rf "${CTRAIN_PROJECT_DIR:?}/$CTRAIN_PIDS"
    # The one retry after a failed rank counts for the whole job, across requeues.
    [[ -n $CTRAIN_REQUEUED ]] || rm -f "$CTRAIN_PROJECT_DIR/.ctrain/$SLURM_JOB_ID.retried"
    rmdir "$CTRAIN_PROJECT_DIR/.ctrain" 2>/dev/null
}
