#
# One run (one start of the job) moves through these states; ctrain_transition EVENT is the only
# writer of CTRAIN_RUN_DIR/state ("RESTART STATE"), and an event the table has no entry for, from the
# current state, changes nothing and fails with a line saying so. Who sends each event:
#   launched     ctrain_run, once the training step's srun started
#   warned       ctrain_forward: Slurm's USR1 before the time limit, passed to the workers
#   terminated   ctrain_run's TERM trap: Slurm's TERM (scancel, scontrol requeue, preemption)
#   ending       ctrain_guard (a launcher failed, a node does not answer), ctrain_silent (no progress, a
#                node does not answer), ctrain_hung (a hang)
#   exited       ctrain_decide in the batch script, after the step's srun exited
#   batch-gone   ctrain_decide in the sentinel: the batch script is gone (its host lost, or the job
#                left RUNNING) before it decided
#   requeued, left (Slurm's TERM: Slurm decides), finished, ended   ctrain_decide's outcome
# The decided states (requeued, left, finished, ended) have no way out: a second decider (the
# sentinel after the batch script, or the reverse) is refused, so the job's fate is decided once.
# docs/architecture.md draws the table; a unit test walks every entry.
declare -A CTRAIN_LIFE=(
    [starting:launched]=running
    [starting:unfit]=deciding
    [running:warned]=running
    [running:terminated]=terminating
    [running:ending]=ending
    [running:exited]=deciding
    [running:batch-gone]=deciding
    [ending:warned]=ending
    [ending:terminated]=terminating
    [ending:ending]=ending
    [ending:exited]=deciding
    [ending:batch-gone]=deciding
    [terminating:warned]=terminating
    [terminating:terminated]=terminating
    [terminating:ending]=terminating
    [terminating:exited]=deciding
    [deciding:batch-gone]=deciding
    [deciding:requeued]=requeued
    [deciding:left]=left
    [deciding:finished]=finished
    [deciding:ended]=ended
)

# A node dying slowly (out of memory, a failing disk) loses its processes over seconds, in any order,
# while its slurmd may answer until the last: a failure that nothing explains is attributed to a node
# only after this many seconds (ctrain_decide, ctrain_sentinel).
CTRAIN_SETTLE=3

# ctrain_state: this run's state (starting before any transition, or when the file is another run's).
ctrain_state() {
    local run state
    read -r run state 2>/dev/null <"$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR/state" &&
        [[ $run == "${SLURM_RESTART_COUNT:-0}" && -n $state ]] || state=starting
    echo "$state"
}

# ctrain_transition EVENT: move this run along CTRAIN_LIFE, or fail (nothing changed) where the
# table has no entry for EVENT from the current state.
ctrain_transition() {
    local file=$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR/state state next
    state=$(ctrain_state)
    next=${CTRAIN_LIFE[$state:$1]-}
    if [[ -z $next ]]; then
        echo "ctrain: the run is $state: '$1' is not one of its transitions (CTRAIN_LIFE); nothing done"
        return 1
    fi
    { echo "${SLURM_RESTART_COUNT:-0} $next" >"$file.$BASHPID" && mv -f "$file.$BASHPID" "$file"; } 2>/dev/null && return
    # The shared file system is full: a new file needs room, rewriting the state file's own few bytes
    # does not (its block is freed and taken again). Without this no decision is recorded, so none is
    # made, and a preempted run that asked to be requeued would just end.
    rm -f "$file.$BASHPID"
    echo "${SLURM_RESTART_COUNT:-0} $next" 2>/dev/null >"$file" && return
    echo "ctrain: cannot record the run's state ($next) in $file: is its file system full (df $CTRAIN_PROJECT_DIR)?"
    return 1
}

# ctrain_mark EVENT [ARG...]: one line of the run's timeline (CTRAIN_TIMELINE, kept across
# requeues and continuations; RESTART counts both): `EPOCH RESTART EVENT ARG...`. The batch script (and a sentinel deciding in its place)
# marks each run's start, launch, step end and decision; rank 0 marks what the trainer does
# (ctrain.train.goodput, which also names every event). `ctrain report JOB` reads it.
ctrain_mark() {
    [[ ${CTRAIN_DRY_RUN:-0} != 1 && -n ${CTRAIN_TIMELINE:-} ]] || return 0
    echo "$(date +%s.%N) $(ctrain_restarts) $*" >>"$CTRAIN_PROJECT_DIR/$CTRAIN_TIMELINE" 2>/dev/null || true
}

# ctrain_submitted: when Slurm last queued the job (its SubmitTime, which a requeue renews), as
# seconds since the epoch; "-" when the controller does not say.
ctrain_submitted() {
    local when
    when=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* SubmitTime=\([0-9T:-]*\) .*/\1/p')
    date -d "${when:-none}" +%s 2>/dev/null || echo -
}
