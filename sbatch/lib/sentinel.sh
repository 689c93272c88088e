# The sentinels: deciding in the batch script's place when its host is lost.

# ctrain_alive (in the background, on the batch host): a heartbeat for ctrain_sentinel, a number
# that changes every 2 s in CTRAIN_RUN_DIR/batch-alive. Its content, not its time stamp, is compared,
# so a shared file system's attribute cache cannot make a live batch host look dead.
ctrain_alive() {
    local beat=0
    while :; do
        echo $((beat++)) >"$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR/batch-alive"
        sleep 2
    done
}

# ctrain_sentinel_payload: what ctrain_sentinel runs on its node, which has only what it is sent: every
# function it calls, found by following the calls from ctrain_sentinel (not listed by hand), and the
# CTRAIN_* variables those functions read that are set here. Its arguments: BATCH-HOST LOG.
ctrain_sentinel_payload() {
    local -A shipped=()
    local todo=(ctrain_sentinel) fn word names=()
    while ((${#todo[@]} > 0)); do
        fn=${todo[-1]}
        unset 'todo[-1]'
        [[ -z ${shipped[$fn]-} ]] || continue
        shipped[$fn]=1
        while read -r word; do
            [[ -n ${shipped[$word]-} ]] || ! declare -F "$word" >/dev/null || todo+=("$word")
        done < <(declare -f "$fn" | grep -o '\bctrain_[a-z_]*' | sort -u)
    done
    mapfile -t names < <(printf '%s\n' "${!shipped[@]}" | sort)
    local variables=()
    while read -r word; do
        ! declare -p "$word" >/dev/null 2>&1 || variables+=("$word") # set here (an array's [0] need not be)
    done < <(declare -f "${names[@]}" | grep -o '\bCTRAIN_[A-Z0-9_]*' | sort -u)
    declare -p "${variables[@]}"
    declare -f "${names[@]}"
    echo 'ctrain_sentinel "$@"'
}

# ctrain_sentinel_step (in the background, beside the training step): ctrain_sentinel on the second
# node and, in a job of 3 nodes or more, on the last one too, on the host (not in the container: it
# needs Slurm's commands). The batch script decides what happens after a failure, but it runs on the
# first node, which is also the rendezvous host: when that node dies, the batch script dies with
# it, and without a sentinel the job would stay RUNNING with no trainer anywhere until Slurm
# declares the node dead (SlurmdTimeout), then wait, requeued, for that node. Two sentinels, so
# that losing the first two nodes at once (one switch, one power feed) is decided as well; the first
# of them to claim the decision (CTRAIN_RUN_DIR/claim, made by mkdir, which is atomic on shared file
# systems) makes it. A sentinel writes straight to the job's log: srun, which would carry its
# output, ran on the lost node too.
# Each sentinel runs in a session of its own, no longer a child of its step's task (which waits for
# it): when the batch host dies, slurmctld may SIGKILL every step whose srun ran there, the
# sentinel's own step included, at once (seen on the testbed in about one run in four). Where Slurm
# tracks a step's processes by parentage (proctrack/linuxproc, pgid) that kill does not reach the
# sentinel; with proctrack/cgroup it does, and Slurm's own node-failure handling is left.
ctrain_sentinel_step() {
    local log hosts=() watchers count=1
    log=$(readlink -f /proc/$$/fd/1 2>/dev/null)
    [[ -f $log ]] || log=
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    watchers=${hosts[1]}
    ((${#hosts[@]} < 3)) || { watchers+=,${hosts[-1]} count=2; }
    local code
    code=$(ctrain_sentinel_payload)
    [[ -z $log ]] || exec >/dev/null 2>&1 # srun's own lines (the step's end) would only be noise
    # shellcheck disable=SC2016 # expanded by the step's shell
    exec srun --overlap --nodes="$count" --ntasks="$count" --nodelist="$watchers" bash -c '
        pid=$( (setsid bash -c "$0" "$@" </dev/null >/dev/null 2>&1 & echo $!) )
        while kill -0 "$pid" 2>/dev/null; do sleep 1; done' "$code" ctrain-sentinel "$CTRAIN_BATCH_HOST" "$log"
}

# ctrain_sentinel BATCH-HOST LOG: decide in the batch script's place when it cannot. It watches the
# batch host's heartbeat from another node, and the run's state. The batch host is lost when its
# heartbeat has not changed for CTRAIN_STEP_GRACE seconds, or Slurm ended the sentinel's step (its
# srun ran there: a TERM while the run is undecided means just that, so the batch host is asked at
# once, well before the SIGKILL KillWait seconds later), and its slurmd does not answer either.
# A batch host that dies slowly may also take the batch script first while its slurmd still
# reports the death: Slurm then ends the job (FAILED) or requeues it with no decision made; an
# undecided run whose job left RUNNING is decided here as well. Either way ctrain_decide makes the
# decision, so it is the batch script's own: requeued without the lost node where the partition has
# enough other nodes, else ended (scancel), so that the job neither holds the other nodes until
# Slurm notices nor waits, requeued by Slurm, for the lost node. It ends itself once the run is
# decided (by either of them) or its directory is gone.
ctrain_sentinel() {
    local batch=$1 log=$2 dir=$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR why= unanswered=() me=${SLURMD_NODENAME:-$(uname -n)}
    [[ -z $log ]] || exec >>"$log" 2>&1
    ctrain_sentinel_watch why unanswered "$batch" "$me" || return 0
    mkdir "$dir/claim" 2>/dev/null || return 0 # the other sentinel decides
    if [[ " ${unanswered[*]} " != *" $batch "* ]]; then
        # Only the job left RUNNING: its batch script died on a host that still answers.
        echo "ctrain: the batch script on $batch ended before it decided (the job left RUNNING); deciding from $me"
    else
        local with=() node
        for node in "${unanswered[@]}"; do
            echo "$node" >>"$dir/lost"
            [[ $node == "$batch" ]] || with+=("$node")
        done
        if ((${#with[@]} == 0)); then
            why="the batch host: $why and its slurmd does not answer; seen from $me"
        else
            why="the batch host and ${with[*]}: $why and their slurmds do not answer; seen from $me"
        fi
        # What is left of the training step goes at once (SIGKILL): a rank waiting on the lost node in
        # a collective would otherwise outlive the decision by up to KillWait seconds, or longer.
        ctrain_kill_step
    fi
    ctrain_decide "$dir" 137 batch-gone "$why"
    # No batch script is left to clear the run's files; a requeued run clears them as it starts.
    [[ $(ctrain_state) != ended ]] || rm -rf "${dir:?}"
}

# ctrain_sentinel_watch WHY UNANSWERED BATCH-HOST ME: watch until the batch script is gone (returns 0,
# with the caller's WHY set to how that was seen and UNANSWERED to the nodes that do not answer) or
# the sentinel is no longer needed (returns 1: the run is decided, or its directory is gone).
ctrain_sentinel_watch() {
    local -n _why=$1 _gone=$2
    local batch=$3 me=$4 dir=$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR beat last= seen=$SECONDS termed= state record
    local restarts=${SLURM_RESTART_COUNT:-0} others=()
    # The nodes lost with the batch host (one switch, one power feed) are asked at the same time.
    mapfile -t others < <(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vx -e "$batch" -e "$me")
    trap 'termed=1' TERM
    while :; do
        sleep 1 &
        wait $!
        # The batch script removes the directory when its run ends; a requeued run makes it anew.
        [[ -d $dir ]] || return 1
        state=$(ctrain_state)
        case $state in
            running | ending | deciding) ;;
            *) return 1 ;; # decided, Slurm's TERM (Slurm decides), or a later run's
        esac
        beat=$(cat "$dir/batch-alive" 2>/dev/null)
        record=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || continue # slurmctld restarting: wait
        if [[ $record != *" JobState=RUNNING "* || $record != *" Restarts=$restarts "* ]]; then
            # Slurm ended or requeued the job, and the run is undecided: the batch script is gone,
            # maybe the first of its node's processes to go.
            sleep "$CTRAIN_SETTLE"
            ctrain_probe _gone "$batch" "${others[@]}"
            _why="the job left RUNNING undecided"
            # A run that is deciding, on a batch host that answers, may have requeued the job itself.
            [[ $state != deciding || " ${_gone[*]} " == *" $batch "* ]] || return 1
            return 0
        elif [[ -n $termed ]]; then
            termed=
            _why="Slurm ended the sentinel's step, whose srun ran there,"
        elif [[ $beat != "$last" ]]; then
            last=$beat seen=$SECONDS
            continue
        elif ((SECONDS - seen >= CTRAIN_STEP_GRACE)); then
            _why="no heartbeat for ${CTRAIN_STEP_GRACE}s"
        else
            continue
        fi
        ctrain_probe _gone "$batch" "${others[@]}"
        [[ " ${_gone[*]} " != *" $batch "* ]] || return 0
        last=$beat seen=$SECONDS # the batch host answers: only its heartbeat was late
    done
}
