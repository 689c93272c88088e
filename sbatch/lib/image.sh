#
# An image file is unpacked once per node, into CTRAIN_IMAGE_CACHE/KEY/rootfs, and every later job
# and requeue on that node runs that directory: no squashfuse process for Slurm's TERM to end, and no
# unpacking or deleting of GBs at each start and end. One entry (docs/sbatch.md lists the files):
#   rootfs/    the unpacked image          image     the file it came from
#   complete   written last: an entry without it is half-unpacked, never run, and removed
#   used       touched at each job's start (least recently used entries are evicted first)
#   size-kib   the unpacked size
# `lock` (the cache's) lets one job at a time unpack or evict on a node; each running task holds a
# shared lock on its entry's `complete` (CTRAIN_IMAGE_HOLD), and an entry so held is never evicted.
# `ctrain cache` lists and clears the entries of the node it runs on.

# ctrain_image_key IMAGE: the image's cache key: its size and first 64 KiB (a SIF's header holds the
# unique ID and modification time its build gave it), hashed. It reads 64 KiB, not the whole image,
# from the shared filesystem; "unread" when the file cannot be read (dry runs).
ctrain_image_key() {
    local size
    size=$(stat -L -c %s "$1" 2>/dev/null) && [[ -r $1 ]] || { echo unread; return; }
    { echo "$size"; head -c 65536 "$1"; } | sha256sum | cut -c1-16
}

# On each node (ctrain_on_nodes): $1 cache, $2 image, $3 key, $4 size limit in GiB. Unpacks the
# image unless complete, marks it used, then evicts the least recently used entries that no task
# holds and that no job started in the last 10 minutes, until the cache fits the limit.
ctrain_program CTRAIN_IMAGE_PREPARE image-prepare.sh

# What each srun task runs before Apptainer ($1 the entry, then Apptainer's words): a shared lock on
# the entry for as long as the container runs (the descriptor passes to Apptainer through exec), so
# that no other job evicts it; an entry evicted while this job started is named, not run.
ctrain_program CTRAIN_IMAGE_HOLD image-hold.sh

# ctrain_image_cache: the image unpacked and current in the cache of every node of the job.
ctrain_image_cache() {
    ctrain_on_nodes "$CTRAIN_IMAGE_PREPARE" "$CTRAIN_IMAGE_CACHE" "$CTRAIN_IMAGE" \
        "${CTRAIN_IMAGE_ENTRY##*/}" "$CTRAIN_IMAGE_CACHE_GB" ||
        ctrain_die "the image could not be made ready on every node: each node's line above says why and what to do" \
            "(CTRAIN_IMAGE_CACHE=$CTRAIN_IMAGE_CACHE)"
}
