#!/usr/bin/env bash
# Remove everything the test suite creates outside the checkout, so the next run starts as on a
# fresh machine: the testbed (processes, network, state directory, shared dir, job user, what its
# jobs left in /tmp), the
# test image store (/var/tmp/ctrain-test or $CTRAIN_TEST_IMAGES) with its images and base image in
# containers-storage, buildah working containers, pytest's temporary directories, the remote tests'
# sshd and ctrain's shared SSH connections.
# CI runs it before scripts/test.sh. Host packages and .venv stay: setup installs those.
# Run as root, after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "clean-slate.sh must run as root" >&2; exit 1; }

.venv/bin/ctrain testbed down
# What the testbed's jobs left in /tmp: the job user's image cache (each image unpacked once, about
# 2 GB for the CPU image; docs/sbatch.md), and what Apptainer's own --unsquash leaves when a run is
# killed. Unpacked images have read-only directories: made writable first.
for dir in /tmp/ctrain-images-* /tmp/ctrain-unsquash-* /tmp/rootfs-* /var/tmp/rootfs-*; do
    [ -e "$dir" ] || continue
    chmod -R u+rwX -- "$dir" 2>/dev/null || true
    rm -rf -- "$dir"
done
.venv/bin/ctrain testbed down --purge

images=${CTRAIN_TEST_IMAGES:-/var/tmp/ctrain-test}
rm -rf -- "$images"
if command -v buildah >/dev/null; then
    buildah rm --all >/dev/null
    # The test images and the debootstrap base (ctrain.image.localbase.DEFAULT_REF's name).
    mapfile -t refs < <(buildah images --format '{{.Name}}:{{.Tag}}' |
        grep -E '^localhost/(ctrain-test|ctrain-base|ctrain-private-index):' || true)
    [ "${#refs[@]}" -eq 0 ] || buildah rmi --force "${refs[@]}" >/dev/null
    buildah rmi --prune >/dev/null 2>&1 || true
fi
rm -rf -- "/tmp/pytest-of-$(id -un)"
# The login host's sshd of the remote tests (tests/plugins/remote.py), and ctrain's shared SSH
# connections (ctrain.remote): their sockets, and the master processes that hold them.
pkill -f -- "-f /var/tmp/ctrain-login-sshd-" || true
rm -rf -- /var/tmp/ctrain-login-sshd-*
for socket in "${XDG_RUNTIME_DIR:-/tmp}/ctrain-ssh-$(id -u)"/*; do
    [ -S "$socket" ] && ssh -o ControlPath="$socket" -O exit placeholder >/dev/null 2>&1 || true
done
rm -rf -- "${XDG_RUNTIME_DIR:-/tmp}/ctrain-ssh-$(id -u)"
echo "clean slate: no testbed, no test images, no test temp dirs, no test sshd or ssh connections"
