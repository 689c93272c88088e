# Before each run's training step, unless CTRAIN_PREFLIGHT=off, each node is checked on its host
# (ctrain_preflight), and every rank of `ctrain train` checks its GPU and the network once the
# process group is up (src/ctrain/train/health.py; CTRAIN_PREFLIGHT=full runs those longer). A node
# that fails a check is written to CTRAIN_RUN_DIR/unfit ("HOST CHECK MESSAGE"), and ctrain_decide
# requeues the job without it, as it does a lost node. docs/reliability.md lists the checks.
#
# What runs on each node's host ($1 the project directory, $2 the batch host's token, $3 the MiB of
# TMPDIR a job needs, $4 the image's cache entry or "", $5 the MiB unpacking it takes, $6 the oldest
# NVIDIA driver the image runs on, CTRAIN_IMAGE_MIN_DRIVER, or ""): one line per
# failed check, "unfit NODE CHECK MESSAGE", then "ok NODE SUMMARY". POSIX sh and coreutils only.
ctrain_program CTRAIN_PREFLIGHT_NODE node-checks.sh

# ctrain_preflight: the node checks above on every node of the job, at once; returns 1 when a node
# is unfit (recorded in CTRAIN_RUN_DIR/unfit) or gave no answer. The answers come back through srun,
# not through the shared file system that one of the checks doubts.
ctrain_preflight() {
    [[ $CTRAIN_PREFLIGHT != off ]] || return 0
    local dir=$CTRAIN_PROJECT_DIR/$CTRAIN_RUN_DIR token=$RANDOM$RANDOM$RANDOM started=${EPOCHREALTIME/[^0-9]/.}
    local shared=$CTRAIN_PROJECT_DIR/.ctrain/$SLURM_JOB_ID.preflight entry= need=0 kind host check message
    local answered=() nodes=() node seconds
    echo "$token" >"$shared" || ctrain_die "cannot write $shared: the project directory must be writable"
    if [[ -n $CTRAIN_IMAGE_ENTRY && -f $CTRAIN_IMAGE ]]; then
        entry=$CTRAIN_IMAGE_ENTRY
        need=$(($(stat -c %s "$CTRAIN_IMAGE") * 3 / 1048576 + 1)) # a SIF unpacks to about 2-3 times its size
    fi
    while read -r kind host check message; do
        case $kind in
            ok) answered+=("$host") && echo "ctrain: preflight: $host: $check $message" ;;
            unfit)
                echo "ctrain: preflight: $host: unfit: $check: $message"
                echo "$host $check $message" >>"$dir/unfit"
                ;;
            "") ;;
            *) echo "ctrain: preflight: $kind $host $check $message" ;; # srun's own lines
        esac
    done < <(ctrain_on_nodes "$CTRAIN_PREFLIGHT_NODE" "$CTRAIN_PROJECT_DIR" "$token" "$CTRAIN_PREFLIGHT_TMP_MB" \
        "$entry" "$need" "$CTRAIN_IMAGE_MIN_DRIVER" 2>&1)
    rm -f "$shared"
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    for node in "${nodes[@]}"; do
        [[ " ${answered[*]} " == *" $node "* ]] && continue
        echo "ctrain: preflight: $node: unfit: answer: its checks did not run or did not answer (ctrain_on_nodes)"
        echo "$node answer its checks did not run or did not answer" >>"$dir/unfit"
    done
    seconds=$(awk -v a="$started" -v b="${EPOCHREALTIME/[^0-9]/.}" 'BEGIN { printf "%.2f", b - a }')
    if [[ -s $dir/unfit ]]; then
        ctrain_mark preflight "$seconds" "$(wc -l <"$dir/unfit")"
        return 1
    fi
    echo "ctrain: preflight: ${#nodes[@]} node(s) fit in $seconds s"
    ctrain_mark preflight "$seconds" 0
}
