# The run: the training step's srun, the processes that watch it, the wait, the decision.

# ctrain_run_files: the run's files, relative to the project directory, which is the working directory
# on every node (docs/architecture.md lists them). CTRAIN_RUN_DIR is the run's directory; the tasks
# and ranks get it as CTRAIN_PIDS, its name since version 1, which the trainer and older images read.
ctrain_run_files() {
    CTRAIN_RUN_DIR=.ctrain/$SLURM_JOB_ID
    export CTRAIN_PIDS=$CTRAIN_RUN_DIR
    export CTRAIN_HEARTBEATS=$CTRAIN_RUN_DIR/heartbeat # each rank's progress, written by the trainer
    export CTRAIN_EXITS=$CTRAIN_RUN_DIR/exit           # why each rank ended, written by the trainer
    export CTRAIN_TIMELINE=.ctrain/$CTRAIN_RUN.timeline # the run's events, kept across requeues and continuations
}

# ctrain_srun_command: CTRAIN_SRUN, the training step: one task per node, in the container, running
# the per-node task (programs/task.sh) around the launcher.
ctrain_srun_command() {
    CTRAIN_SRUN=(
        srun
        --label                     # "N: " before each line: N is the node (one task per node)
        --kill-on-bad-exit=1        # one node failing ends the step everywhere
        --nodes="$CTRAIN_NNODES"
        --ntasks="$CTRAIN_NNODES"
        --ntasks-per-node=1         # one launcher per node starts the node's workers
    )
    # Only the variables the job needs (ctrain_task_env, so after every export the tasks read); the
    # first node's task (CTRAIN_TASK) also gets the rendezvous store's address, to host it.
    CTRAIN_SRUN+=(--export="$(ctrain_task_env)${CTRAIN_STORE:+,CTRAIN_STORE=$CTRAIN_STORE}")
    CTRAIN_SRUN+=(
        "${CTRAIN_SRUN_CONTAINER[@]}"
        "${CTRAIN_CONTAINER[@]}"
        sh -c "$CTRAIN_TASK" ctrain-task
        "${CTRAIN_LAUNCH[@]}"
    )
}

# ctrain_run: print the training step; unless a dry run, check the nodes, make the image ready, run
# the step (ctrain_step) and decide. Returns the step's exit code.
ctrain_run() {
    ctrain_run_files
    ctrain_srun_command
    ctrain_show "${CTRAIN_SRUN[@]}"
    [[ $CTRAIN_DRY_RUN != 1 ]] || return 0

    CTRAIN_SIGNAL=
    ctrain_hold || return 0
    rm -rf "${CTRAIN_PROJECT_DIR:?}/$CTRAIN_RUN_DIR" # what a killed run of this job left
    mkdir -p "$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS"
    ctrain_mark start "$(ctrain_submitted)" "$CTRAIN_NNODES" "${SLURM_GPUS_ON_NODE:-0}"
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR rc=0
    if ! ctrain_preflight; then
        ctrain_decide "$dir" 1 unfit
        ctrain_run_end
        return 1
    fi
    [[ -z $CTRAIN_IMAGE_ENTRY ]] || ctrain_image_cache
    ctrain_step "$dir" || rc=$?
    ctrain_run_end
    return "$rc"
}

# ctrain_step DIR: run the training step with its watchers beside it (the guard, the hang and silence
# watchdog, and on several nodes the batch host's heartbeat and the sentinels), pass Slurm's signals
# on, and decide once it has exited. Returns the step's exit code.
ctrain_step() {
    local dir=$1 rc watchdog= guard alive= sentinel=
    ctrain_mark launched
    "${CTRAIN_SRUN[@]}" &
    CTRAIN_STEP_PID=$!
    ctrain_transition launched
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
    return "$rc"
}

# ctrain_run_end: what a run leaves once it is decided. The one retry after a failed rank counts for
# the whole run, across requeues and continuations: its marker stays while the run goes on.
ctrain_run_end() {
    [[ $(ctrain_state) == requeued ]] || rm -f "$CTRAIN_PROJECT_DIR/.ctrain/$CTRAIN_RUN.retried"
    rm -rf "${CTRAIN_PROJECT_DIR:?}/$CTRAIN_RUN_DIR"
    rmdir "$CTRAIN_PROJECT_DIR/.ctrain" 2>/dev/null
}

# ctrain_forward SIGNAL: hand a signal to the training workers (the launcher's children) on every node, through a
# short step beside the training step. Not through the step itself: Slurm would signal every
# process in it, the launcher (which forwards only TERM, INT, HUP, QUIT) and Apptainer's
# squashfuse, whose end takes the image's files away from the workers mid-checkpoint.
# A command of your own that has not opted in (no heartbeat from any rank: docs/sbatch.md) cannot
# checkpoint at the warning and would run into the time limit, after which Slurm requeues nothing:
# the job is requeued now, and the next run starts from the script's own last checkpoint. Returns 0
# when the job was requeued.
ctrain_forward() {
    CTRAIN_SIGNAL=$1
    ctrain_transition warned
    echo "ctrain: SIG$1 (time limit near): passing it to the training processes on every node"
    ctrain_on_nodes 'pkill -"$2" -P "$(cat "$1/$(uname -n).pid")"' "$CTRAIN_PROJECT_DIR/$CTRAIN_PIDS" "$1"
    if ((${#CTRAIN_COMMAND[@]} > 0)) && ! compgen -G "$CTRAIN_PROJECT_DIR/$CTRAIN_HEARTBEATS/rank-*" >/dev/null; then
        echo "ctrain: your command has not opted in to checkpoint at the signal (no heartbeat from it); the job" \
            "is requeued now and its next run starts from the script's own last checkpoint"
        ctrain_requeue_if_asked "$CTRAIN_REQUEUE_EXIT"
        return
    fi
    return 1
}

ctrain_summary() {
    echo "ctrain: job ${SLURM_JOB_ID} '${SLURM_JOB_NAME:-}' restart $(ctrain_restarts)${CTRAIN_CONTINUES:+ (run $CTRAIN_RUN, continuing job $CTRAIN_CONTINUES)}" \
        "on $CTRAIN_NNODES node(s) [${SLURM_JOB_NODELIST}] x $CTRAIN_NPROC_PER_NODE process(es)"
    if ((${#CTRAIN_COMMAND[@]} > 0)); then
        echo "ctrain: $CTRAIN_RUNTIME image $CTRAIN_IMAGE, $CTRAIN_LAUNCHER, your command: ${CTRAIN_COMMAND[*]}" \
            "(rendezvous $CTRAIN_MASTER_ADDR:$CTRAIN_MASTER_PORT)"
        echo "ctrain: it runs in $CTRAIN_WORKDIR, which is the project directory $CTRAIN_PROJECT_DIR on every node;" \
            "write outputs under /outputs ($CTRAIN_OUTPUTS)${CTRAIN_DATA:+; data: /data ($CTRAIN_DATA)}"
        return
    fi
    echo "ctrain: $CTRAIN_RUNTIME image $CTRAIN_IMAGE, $CTRAIN_LAUNCHER, recipe $CTRAIN_RECIPE" \
        "${CTRAIN_OVERRIDES[*]:+${CTRAIN_OVERRIDES[*]} }(rendezvous $CTRAIN_MASTER_ADDR:$CTRAIN_MASTER_PORT)"
}

# ctrain_main RUNTIME [RECIPE] [KEY=VALUE ...] | RUNTIME -- COMMAND [ARG ...]: the whole job.
ctrain_main() {
    ctrain_settings "$@"
    ctrain_allocation
    ctrain_environment
    ctrain_container
    ctrain_launcher
    ctrain_summary
    ctrain_run
}
