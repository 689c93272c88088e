# What each srun task runs, once per node, inside the container (launch.sh says what it does and why).
# POSIX sh: any image has one. Its text is part of every job's srun line, so it changes only on purpose.
# shellcheck shell=sh disable=SC2010 # `ls | grep -c` counts the nodes' done files; their names are ours
unset RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT
trap "" USR1
if [ "$1" = accelerate ]; then shift 2; set -- accelerate launch --machine_rank="$SLURM_NODEID" "$@"; fi
echo "ctrain: $(uname -n): $*"
store=
if [ -n "${CTRAIN_STORE:-}" ] && [ "${SLURM_NODEID:-0}" = 0 ]; then
    python3 -c "
@CTRAIN_TCP_STORE@
" "${CTRAIN_STORE%:*}" "${CTRAIN_STORE##*:}" &
    store=$!
fi
trap : TERM
"$@" &
launcher=$!
echo $launcher >"$CTRAIN_PIDS/$(uname -n).pid"
echo "${SLURM_STEP_ID:-0}" >"$CTRAIN_PIDS/step"
wait $launcher
rc=$?
while kill -0 $launcher 2>/dev/null; do wait $launcher; rc=$?; done
echo "$rc $(uname -n)" >"$CTRAIN_PIDS/node-${SLURM_NODEID:-0}.done"
if [ -n "$store" ]; then
    waited=0
    while [ "$(ls "$CTRAIN_PIDS" | grep -c "[.]done$")" -lt "${SLURM_STEP_NUM_NODES:-1}" ] &&
        [ $waited -lt 300 ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    kill -9 $store
fi
exit $rc
