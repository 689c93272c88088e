# The run across its jobs. A run starts as one job, whose id is the run's (CTRAIN_RUN), and goes on in
# the jobs that continue it: a requeue keeps the job's id; a continuation (ctrain_continue) is a new
# job of the same script, submitted when a lost node would hold the requeued job for minutes (Slurm
# lets a job go from a node that does not answer only once SlurmdTimeout marks the node down, 300 s by
# default). Exactly one job holds a run: .ctrain/RUN.holder names it (ctrain_hold), and a job hands
# the run over before it submits its continuation.

# ctrain_run_identity: CTRAIN_RUN (the run: a continuation is told, any other job starts one with its
# own id), CTRAIN_CONTINUES (the job a continuation continues) and CTRAIN_RUN_RESTARTS (the run's restarts
# before this job), checked: they reach file names and arithmetic.
ctrain_run_identity() {
    CTRAIN_RUN=${CTRAIN_RUN:-${SLURM_JOB_ID:-}} CTRAIN_CONTINUES=${CTRAIN_CONTINUES:-}
    CTRAIN_RUN_RESTARTS=${CTRAIN_RUN_RESTARTS:-0}
    [[ $CTRAIN_RUN =~ ^[0-9]{0,12}$ ]] ||
        ctrain_die "CTRAIN_RUN is '$CTRAIN_RUN'; it is the run's first job id, which ctrain sets: unset it"
    [[ $CTRAIN_CONTINUES =~ ^[0-9]{0,12}$ ]] ||
        ctrain_die "CTRAIN_CONTINUES is '$CTRAIN_CONTINUES'; it is the job this one continues, which ctrain sets: unset it"
    [[ $CTRAIN_RUN_RESTARTS =~ ^[0-9]{1,6}$ ]] ||
        ctrain_die "CTRAIN_RUN_RESTARTS is '$CTRAIN_RUN_RESTARTS'; it is the run's restarts before this job, which ctrain sets: unset it"
}

# ctrain_restarts: how often the run started again before this start, its continuations' restarts and
# Slurm's requeues of this job together (CTRAIN_MAX_REQUEUES caps both).
ctrain_restarts() {
    echo $((${CTRAIN_RUN_RESTARTS:-0} + ${SLURM_RESTART_COUNT:-0}))
}

# ctrain_hand_over HOLDER: write HOLDER into the run's holder file, whole (a new file renamed over it).
ctrain_hand_over() {
    local file=$CTRAIN_PROJECT_DIR/.ctrain/$CTRAIN_RUN.holder
    { echo "$1" >"$file.$BASHPID" && mv -f "$file.$BASHPID" "$file"; } 2>/dev/null && return 0
    rm -f "$file.$BASHPID"
    echo "ctrain: cannot write $file (is its file system full? df $CTRAIN_PROJECT_DIR)"
    return 1
}

# ctrain_hold: take the run for this job, or return 1, saying which job holds it. The run's first job
# creates the holder file (noclobber: of two jobs starting together, one creates it and the other
# finds it); a continuation takes the run its predecessor handed over ("after JOB"); a requeued job
# finds its own id. A job that finds another's does not run: the run is that job's.
ctrain_hold() {
    local file=$CTRAIN_PROJECT_DIR/.ctrain/$CTRAIN_RUN.holder holder=
    mkdir -p "$CTRAIN_PROJECT_DIR/.ctrain" 2>/dev/null
    if (set -C && echo "$SLURM_JOB_ID" >"$file") 2>/dev/null; then
        echo "$SLURM_JOB_ID" >>"$CTRAIN_PROJECT_DIR/.ctrain/$CTRAIN_RUN.jobs"
        # A sweep's task: its run, found by the array's id and the task's index (ctrain results).
        [[ -z ${SLURM_ARRAY_JOB_ID:-} || -z ${SLURM_ARRAY_TASK_ID:-} ]] ||
            echo "$CTRAIN_RUN" >"$CTRAIN_PROJECT_DIR/.ctrain/${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID.run"
        return 0
    fi
    read -r holder 2>/dev/null <"$file"
    if [[ $holder == "$SLURM_JOB_ID" ]]; then
        return 0
    elif [[ -n $CTRAIN_CONTINUES && $holder == "after $CTRAIN_CONTINUES" ]]; then
        ctrain_hand_over "$SLURM_JOB_ID" && return 0
    fi
    echo "ctrain: not running: run $CTRAIN_RUN is held by ${holder:-another job starting now}" \
        "(.ctrain/$CTRAIN_RUN.holder), and a run is trained by one job at a time"
    return 1
}

# ctrain_continue EXCLUDED NODE...: submit the run's continuation: this job's own script with its
# arguments (CTRAIN_ARGUMENTS), nodes, partition, account, QOS and time limit, without EXCLUDED (the lost NODEs and those excluded
# before), with the run's identity; hand the run over to it and keep Slurm from running this job
# again. Where the batch host is among the NODEs (a sentinel decides), this job is cancelled, so that
# its healthy nodes go to the continuation. Returns 1, the run still this job's, where it cannot
# (CTRAIN_CONTINUE=0, or Slurm refused: it says why), for the requeue instead; 2 where the job was
# told to stop (Slurm's TERM: scancel, preemption), for neither. A TERM while it submits (`ctrain
# cancel` mid-recovery) cancels the continuation too.
ctrain_continue() {
    local excluded=$1 record script out job restarts field value options=() unset=() name termed= saved
    shift
    [[ $CTRAIN_CONTINUE == 1 && -n $CTRAIN_RUN ]] || return 1
    if [[ ${CTRAIN_SIGNAL:-} == TERM ]]; then
        echo "ctrain: no continuation: Slurm's TERM came (scancel, scontrol requeue or preemption), and Slurm" \
            "decides whether the run goes on"
        return 2
    fi
    restarts=$(($(ctrain_restarts) + 1))
    record=$(scontrol show job -o "$SLURM_JOB_ID" 2>&1) || {
        echo "ctrain: no continuation: the job's record cannot be read ($record)"
        return 1
    }
    script=$CTRAIN_PROJECT_DIR/.ctrain/$SLURM_JOB_ID.continuation
    if ! out=$(scontrol write batch_script "$SLURM_JOB_ID" "$script" 2>&1); then
        rm -f "$script"
        echo "ctrain: no continuation: the job's script cannot be read back (scontrol write batch_script: ${out//$'\n'/ })"
        return 1
    fi
    options=(--parsable --exclude="$excluded" --nodes="$CTRAIN_NNODES" --chdir="$SLURM_SUBMIT_DIR")
    options+=(--job-name="$SLURM_JOB_NAME")
    # A sweep's task goes on as a one-task array of its own index: the same line of the same table.
    [[ -z ${SLURM_ARRAY_TASK_ID:-} ]] || options+=(--array="$SLURM_ARRAY_TASK_ID")
    for field in Partition:partition Account:account QOS:qos TimeLimit:time; do
        value=$(sed -n "s/.* ${field%%:*}=\([^ ]*\).*/\1/p" <<<"$record")
        [[ -z $value || $value == "(null)" ]] || options+=(--"${field#*:}=$value")
    done
    # The new job gets its own SLURM_* variables, and none of this one's (its restart count, its array).
    while read -r name; do
        [[ $name != SLURM_* || $name == SLURM_CONF ]] || unset+=(-u "$name")
    done < <(compgen -e)
    ctrain_hand_over "after $SLURM_JOB_ID" || return 1
    saved=$(trap -p TERM)
    trap 'termed=1' TERM
    if ! out=$(env "${unset[@]}" CTRAIN_RUN="$CTRAIN_RUN" CTRAIN_CONTINUES="$SLURM_JOB_ID" \
        CTRAIN_RUN_RESTARTS="$restarts" sbatch "${options[@]}" "$script" "${CTRAIN_ARGUMENTS[@]}" 2>&1) || [[ ! ${out%%;*} =~ ^[0-9]+$ ]]; then
        eval "${saved:-trap - TERM}"
        rm -f "$script"
        ctrain_hand_over "$SLURM_JOB_ID"
        echo "ctrain: no continuation: sbatch refused it (${out//$'\n'/ }); the job is requeued instead"
        return 1
    fi
    eval "${saved:-trap - TERM}"
    rm -f "$script"
    job=${out%%;*}
    if [[ -n $termed ]]; then
        scancel "$job"
        ctrain_hand_over "$SLURM_JOB_ID"
        echo "ctrain: not requeueing: the job was cancelled (TERM) while its continuation, job $job, was" \
            "submitted: job $job is cancelled too"
        return 2
    fi
    echo "$job" >>"$CTRAIN_PROJECT_DIR/.ctrain/$CTRAIN_RUN.jobs"
    echo "$CTRAIN_RUN" >"$CTRAIN_PROJECT_DIR/.ctrain/$job.run"
    # Slurm requeues a job it finds on a failed node: this one would start again only to find the run held.
    scontrol update JobId="$SLURM_JOB_ID" Requeue=0 2>/dev/null
    echo "ctrain: requeueing as job $job (restart $restarts of run $CTRAIN_RUN) without $excluded:" \
        "a continuation, which starts on the healthy nodes now, not once Slurm lets go of the lost node;" \
        "$(ctrain_resumes)"
    if [[ " $* " == *" $CTRAIN_BATCH_HOST "* ]]; then
        echo "ctrain: ending job $SLURM_JOB_ID (scancel): its batch script was lost with $CTRAIN_BATCH_HOST," \
            "and its nodes that answer go to job $job"
        scancel "$SLURM_JOB_ID"
    fi
    return 0
}
