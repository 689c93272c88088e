# Before Apptainer in each task (image.sh): a shared lock on the cache entry while the container runs.
# POSIX sh and coreutils only; its arguments are described where it is loaded.
# shellcheck shell=sh
[ -e "$1/complete" ] && command exec 9<"$1/complete" && flock -s 9 && [ -e "$1/complete" ] || {
    echo "ctrain: $(uname -n): the cached image $1 is gone (removed while the job started); submit again" >&2
    exit 1
}
shift
exec "$@"
