#!/bin/bash
# Switch on enroot and pyxis on an AWS ParallelCluster node. ParallelCluster >= 3.11 AMIs carry both,
# switched off; this is a custom action, run as root: HeadNode OnNodeConfigured (after Slurm is up),
# compute queues OnNodeStart (before slurmd starts, so pyxis finds enroot configured).
#
# Usage: enroot-pyxis.sh LOCAL_STORAGE SQUASH_OPTIONS
#   LOCAL_STORAGE   instance-store NVMe mount (ParallelCluster's EphemeralVolume MountDir). When it is
#                   mounted, enroot's cache and container data live there; otherwise on the root volume.
#   SQUASH_OPTIONS  ENROOT_SQUASH_OPTIONS, the mksquashfs options for images enroot imports.
#
# Every node: /etc/enroot/enroot.conf, runtime directories on tmpfs (/run), the PMIx hook.
# Head node:  the pyxis SPANK plugin in /opt/slurm/etc/plugstack.conf (shared with compute nodes).
set -euo pipefail

local_storage=${1:?usage: enroot-pyxis.sh LOCAL_STORAGE SQUASH_OPTIONS}
squash_options=${2:?usage: enroot-pyxis.sh LOCAL_STORAGE SQUASH_OPTIONS}
say() { echo "ctrain enroot-pyxis: $*"; }

# Both values end up in enroot.conf, and enroot runs each value there through `eval echo` whenever it
# runs: only plain paths and options pass (the forms `ctrain cluster init` and `validate` allow), so
# nothing in them is ever run as a command. Byte-wise, so no locale widens the character classes.
export LC_ALL=C
path_form='^(/[A-Za-z0-9._-]+)+/?$'
flag_or_word='(-[A-Za-z0-9_-]+|[A-Za-z0-9][A-Za-z0-9._,]*)'
squash_form="^${flag_or_word}( +${flag_or_word})*\$"
if ! [[ $local_storage =~ $path_form ]]; then
    say "LOCAL_STORAGE $(printf %q "$local_storage") is not an absolute path of letters, digits," \
        "'.', '_', '-' and '/'" >&2
    exit 2
fi
if ! [[ $squash_options =~ $squash_form ]]; then
    say "SQUASH_OPTIONS $(printf %q "$squash_options") are not mksquashfs options (flags such as -noI, plain" \
        "arguments such as zstd or 3, separated by spaces)" >&2
    exit 2
fi

# shellcheck source=/dev/null
. /etc/parallelcluster/cfnconfig   # cfn_node_type: HeadNode, ComputeFleet or LoginNode
command -v enroot >/dev/null || { say "enroot is not installed; use an official ParallelCluster >= 3.11 AMI"; exit 1; }

if mountpoint -q "$local_storage"; then
    enroot_dir=$local_storage/enroot
else
    enroot_dir=/var/enroot
fi
say "node type ${cfn_node_type}, enroot data in ${enroot_dir}"

# Runtime state on tmpfs, recreated at boot; cache, data and temporary files on local disk.
install -d -m 1777 /run/enroot /run/pyxis "$enroot_dir" "$enroot_dir/cache" "$enroot_dir/data" "$enroot_dir/tmp"
cat > /etc/tmpfiles.d/ctrain-enroot.conf <<EOF
d /run/enroot 1777 root root -
d /run/pyxis 1777 root root -
EOF

# User-specific paths stay as $(id -u)/$(id -g): enroot expands them for each user.
install -d -m 0755 /etc/enroot /etc/enroot/hooks.d
cat > /etc/enroot/enroot.conf <<EOF
ENROOT_RUNTIME_PATH    /run/enroot/user-\$(id -u)
ENROOT_CACHE_PATH      ${enroot_dir}/cache/group-\$(id -g)
ENROOT_DATA_PATH       ${enroot_dir}/data/user-\$(id -u)
ENROOT_TEMP_PATH       ${enroot_dir}/tmp
ENROOT_SQUASH_OPTIONS  ${squash_options}
ENROOT_MOUNT_HOME      no
ENROOT_RESTRICT_DEV    yes
ENROOT_ROOTFS_WRITABLE yes
EOF
chmod 0644 /etc/enroot/enroot.conf

# PMIx for MPI inside containers. The PyTorch hook (50-slurm-pytorch.sh) stays off: it sets
# RANK/WORLD_SIZE/MASTER_ADDR per Slurm task, which is not how torchrun's launcher works.
if [ -f /usr/share/enroot/hooks.d/50-slurm-pmi.sh ]; then
    ln -sf /usr/share/enroot/hooks.d/50-slurm-pmi.sh /etc/enroot/hooks.d/50-slurm-pmi.sh
fi

# Ubuntu 24.04's AppArmor blocks the unprivileged user namespaces enroot needs.
. /etc/os-release
if [ "${ID:-}${VERSION_ID:-}" = "ubuntu24.04" ]; then
    echo "kernel.apparmor_restrict_unprivileged_userns = 0" > /etc/sysctl.d/99-ctrain-enroot-userns.conf
    sysctl --system >/dev/null
fi

if [ "$cfn_node_type" = "HeadNode" ]; then
    # The AMI's disabled example names the plugin's installed path.
    plugin=$(awk '$2 ~ /spank_pyxis\.so$/ {print $2; exit}' /opt/parallelcluster/examples/pyxis/pyxis.conf)
    [ -n "$plugin" ] && [ -f "$plugin" ] || { say "pyxis plugin not found (looked in the AMI's pyxis example)"; exit 1; }
    install -d -m 0755 /opt/slurm/etc/plugstack.conf.d
    echo "include /opt/slurm/etc/plugstack.conf.d/*" > /opt/slurm/etc/plugstack.conf
    # execute_entrypoint=0: run the job's command, not the image's entrypoint; container_scope=job:
    # named containers are removed when the job ends; sbatch_support=1: --container-* on sbatch too.
    echo "required ${plugin} runtime_path=/run/pyxis execute_entrypoint=0 container_scope=job sbatch_support=1" \
        > /opt/slurm/etc/plugstack.conf.d/pyxis.conf
    /opt/slurm/bin/scontrol reconfigure
    say "pyxis enabled: srun --container-image=... is available"
fi
