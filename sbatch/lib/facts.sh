# The facts a run's end is decided from (decide.sh): what the step left in the run's directory
# (docs/architecture.md lists its files), read here and nowhere else. Each file is data written by
# tasks and ranks: a value is only ever compared or printed.

# ctrain_facts OUT DIR: appends to the caller's array OUT the facts of the run's directory DIR, as
# ctrain_classify takes them (KEY=VALUE): the job's node count, the nodes the preflight found unfit
# and those found lost, the first rank's own record that a retry cannot help, a hang, the first
# failed launcher.
ctrain_facts() {
    local -n _facts=$1
    local dir=$2 hosts=()
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    _facts+=("nodes=${#hosts[@]}" "unfit=$(ctrain_unfit_nodes "$dir/unfit")")
    _facts+=("rank=$(ctrain_rank_exit "$dir/exit")" "failed=$(ctrain_failed_node "$dir")")
    [[ ! -e $dir/hung ]] || _facts+=(hung=1)
    [[ ! -e $dir/lost ]] || _facts+=("lost=$(sort -u "$dir/lost" | paste -sd' ')")
}

# ctrain_failed_node DIR: "EXIT-CODE HOST" of the node whose launcher failed first (an exit code
# other than 0 and CTRAIN_REQUEUE_EXIT in its node-N.done), nothing when none did.
ctrain_failed_node() {
    local file rc host
    while read -r file; do
        read -r rc host <"$file" || continue
        [[ $rc == 0 || $rc == "$CTRAIN_REQUEUE_EXIT" ]] || { echo "$rc $host"; return; }
    done < <(ls -1tr "$1"/node-*.done 2>/dev/null)
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

# ctrain_unfit_nodes FILE: the job's nodes named in the preflight's unfit FILE (CTRAIN_RUN_DIR/unfit),
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
