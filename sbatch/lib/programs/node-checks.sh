# The node checks (preflight.sh): what runs on each node's host before the training step.
# POSIX sh and coreutils only; its arguments are described where it is loaded.
# shellcheck shell=sh
project=$1 token=$2 tmp_mib=$3 entry=$4 entry_mib=$5 min_driver=${6:-} node=${SLURMD_NODENAME:-$(uname -n)}
unfit() { echo "unfit $node $1 $2"; }
mib_free() { df -Pk "$1" 2>/dev/null | awk "NR == 2 { print int(\$4 / 1024) }"; }
shared=$project/.ctrain/$SLURM_JOB_ID.preflight
if [ "$(cat "$shared" 2>/dev/null)" != "$token" ]; then
    unfit shared "$shared is missing or different on this node: $project is not the file system the batch host writes"
elif ! echo "$token" 2>/dev/null >"$shared.$node"; then
    unfit shared "cannot write in $project/.ctrain from this node"
fi
rm -f "$shared.$node"
tmp=${TMPDIR:-/tmp}
free=$(mib_free "$tmp")
if [ -z "$free" ]; then
    unfit disk "cannot read the free space of TMPDIR $tmp"
elif [ "$free" -lt "$tmp_mib" ]; then
    unfit disk "TMPDIR $tmp has $free MiB free, the job needs $tmp_mib MiB of node-local scratch (CTRAIN_PREFLIGHT_TMP_MB)"
elif ! probe=$(mktemp "$tmp/ctrain-preflight.XXXXXX" 2>/dev/null); then
    unfit disk "cannot create a file in TMPDIR $tmp"
else
    rm -f "$probe"
fi
summary="TMPDIR $free MiB free"
if [ -n "$entry" ] && [ ! -e "$entry/complete" ]; then
    dir=$entry
    while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
    room=$(mib_free "$dir")
    if [ -n "$room" ] && [ "$room" -lt "$entry_mib" ]; then
        unfit disk "the image cache $dir has $room MiB free, unpacking the image takes about $entry_mib MiB (CTRAIN_IMAGE_CACHE)"
    fi
fi
gpus=${SLURM_GPUS_ON_NODE:-0}
case $gpus in "" | *[!0-9]*) gpus=0 ;; esac
if [ "$gpus" -gt 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
    if ! out=$(nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits 2>&1); then
        unfit gpu "nvidia-smi fails: $(echo "$out" | tail -n 1)"
    else
        seen=$(echo "$out" | grep -c .)
        [ "$seen" -ge "$gpus" ] || unfit gpu "nvidia-smi sees $seen GPU(s), the job was given $gpus"
        echo "$out" | while IFS=", " read -r index ecc; do
            case $ecc in "" | 0 | *[!0-9]*) ;; *) unfit gpu "GPU $index has $ecc uncorrected ECC errors since the driver loaded (nvidia-smi -q -d ECC)" ;; esac
        done
        nvidia-smi --query-gpu=index,remapped_rows.pending --format=csv,noheader 2>/dev/null | while IFS=", " read -r index pending; do
            [ "$pending" != Yes ] || unfit gpu "GPU $index has a row remapping pending: reset it (nvidia-smi -r) before it trains"
        done
        driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
        oldest=$(printf '%s\n%s\n' "$min_driver" "$driver" | sort -t. -k1,1n -k2,2n -k3,3n | head -n 1)
        if [ -n "$min_driver" ] && [ -n "$driver" ] && [ "$oldest" != "$min_driver" ]; then
            unfit driver "NVIDIA driver $driver is older than $min_driver, the oldest the image's CUDA runs on: ask for nodes with a newer driver (--exclude this one), or use an image built for an older CUDA"
        fi
        summary="$summary, $seen GPU(s), driver $driver"
    fi
fi
echo "ok $node $summary"
