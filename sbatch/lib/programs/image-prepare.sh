# The image made ready in a node's cache (image.sh): unpacked once, marked used, old entries evicted.
# POSIX sh and coreutils only; its arguments are described where it is loaded.
# shellcheck shell=sh
cache=$1 image=$2 key=$3 limit_kib=$(($4 * 1048576)) node=$(uname -n)
remove() { chmod -R u+rwX "$1" 2>/dev/null; rm -rf "$1"; } # unpacked images have read-only directories
umask 077
mkdir -p "$cache" && exec 8>>"$cache/lock" && flock 8 || exit 1
entry=$cache/$key
if [ -e "$entry/complete" ]; then
    echo "ctrain: $node: the image is cached in $entry"
else
    remove "$entry"
    mkdir "$entry" || exit 1
    start=$(date +%s)
    apptainer=apptainer
    command -v apptainer >/dev/null || apptainer=singularity
    if ! "$apptainer" build --force --sandbox "$entry/rootfs" "$image" >"$entry/unpack.log" 2>&1; then
        why=$(tail -n 3 "$entry/unpack.log")
        # What to do depends on why: the cache's disk, or what Apptainer may do on this node.
        case $why in
            *"o space left"* | *"isk quota"*) fix="give CTRAIN_IMAGE_CACHE ($cache) node-local disk with room for the unpacked image" ;;
            *"ead-only file system"*) fix="point CTRAIN_IMAGE_CACHE ($cache) at a writable node-local directory" ;;
            *"ermission denied"* | *"not permitted"* | *apabilit* | *"user namespace"* | *fakeroot* | *setuid*)
                fix="Apptainer may not unpack images on this node: run the image without unpacking (CTRAIN_APPTAINER_UNSQUASH=0)" ;;
            *) fix="check the image (apptainer inspect $image), or run it without unpacking (CTRAIN_APPTAINER_UNSQUASH=0)" ;;
        esac
        echo "ctrain: $node: could not unpack $image into $entry: $why; $fix" >&2
        remove "$entry"
        exit 1
    fi
    du -sk "$entry/rootfs" | cut -f1 >"$entry/size-kib"
    printf "%s\n" "$image" >"$entry/image"
    rm -f "$entry/unpack.log"
    : >"$entry/complete"
    echo "ctrain: $node: unpacked $image into $entry in $(($(date +%s) - start)) s (kept for later jobs)"
fi
touch "$entry/used"
total=0
for dir in "$cache"/*/; do
    dir=${dir%/}
    [ -d "$dir" ] || continue
    [ -e "$dir/complete" ] || { [ "$dir" = "$entry" ] || remove "$dir"; continue; }
    total=$((total + $(cat "$dir/size-kib" 2>/dev/null || echo 0)))
done
[ "$total" -gt "$limit_kib" ] || exit 0
ls -1dtr "$cache"/*/used | while IFS= read -r used; do
    dir=${used%/used}
    [ "$total" -gt "$limit_kib" ] || break
    [ "$dir" != "$entry" ] && [ -z "$(find "$used" -mmin -10)" ] || continue
    size=$(cat "$dir/size-kib" 2>/dev/null || echo 0) name=$(cat "$dir/image" 2>/dev/null)
    if flock -n -x "$dir/complete" sh -c "chmod -R u+rwX \"\$0\" 2>/dev/null; rm -rf \"\$0\"" "$dir"; then
        total=$((total - size))
        echo "ctrain: $node: evicted $name ($((size / 1024)) MiB) from the image cache"
    fi
done
