#!/usr/bin/env bash
# The testbed's smoke job, as root on a fresh Debian 12 or Ubuntu machine: install what is missing, start a
# 2-node Slurm cluster on this machine (`ctrain testbed`), build a small Apptainer image as the
# cluster's unprivileged job user, and run a 2-node sbatch job whose tasks run inside the image
# and report their node. Fails unless the tasks ran on 2 distinct nodes. Safe to rerun.
#   scripts/hello-nodes.sh                  the tasks run in Apptainer
#   scripts/hello-nodes.sh --pyxis DIR      they run through pyxis and enroot, built from the
#                                           enroot-*.tar.gz and pyxis-*.tar.gz in DIR (their releases)
set -euo pipefail
cd "$(dirname "$0")/.."
pyxis=()
if [ "${1:-}" = --pyxis ]; then
    pyxis=(--pyxis "${2:?usage: scripts/hello-nodes.sh [--pyxis DIR]}")
fi

scripts/setup.sh testbed apptainer ${pyxis[@]+pyxis}
export PATH="$PWD/.venv/bin:$PATH"

echo "== 1/3 a 2-node Slurm cluster on this machine"
ctrain testbed up --nodes 2 ${pyxis[@]+"${pyxis[@]}"}
shared=$(ctrain testbed status --shared-dir)   # like a cluster's /scratch: same path on every node

echo "== 2/3 a small image, built as the unprivileged job user"
image=$(ctrain testbed demo-image examples/hello-node.def ${pyxis[@]+--sqsh})

echo "== 3/3 a 2-node job: one task per node, each inside the image"
install -m 0644 examples/hello-nodes.sbatch "$shared/hello-nodes.sbatch"
rm -f "$shared/hello-nodes.out"
status=0
ctrain testbed exec -- sbatch --wait --nodes=2 --output=hello-nodes.out hello-nodes.sbatch "$(basename "$image")" \
    || status=$?
cat "$shared/hello-nodes.out" 2>/dev/null || true
[ "$status" -eq 0 ] || { echo "hello-nodes: the job failed (sbatch exit $status)" >&2; exit 1; }

# Each task printed "hello from HOSTNAME ip=IP image=... task=N".
hosts=$(awk '/^hello from/ {print $3}' "$shared/hello-nodes.out" | sort -u | wc -l)
ips=$(awk '/^hello from/ {print $4}' "$shared/hello-nodes.out" | sort -u | wc -l)
if [ "$hosts" -ne 2 ] || [ "$ips" -ne 2 ]; then
    echo "hello-nodes: expected tasks on 2 distinct nodes, saw $hosts hostname(s) and $ips address(es)" >&2
    exit 1
fi
echo "hello-nodes: OK: the job ran on 2 nodes with distinct hostnames and IPs, inside $image"
echo "next: ctrain testbed status; ctrain testbed exec -- squeue; ctrain testbed down (see docs/testbed.md)"
