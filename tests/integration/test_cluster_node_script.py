"""cluster/scripts/enroot-pyxis.sh, run for real in a private mount namespace.

enroot and pyxis cannot run here, and neither can a ParallelCluster node. The node is a double:
overlays keep /etc, /usr and /var as they are outside the namespace, and the files and programs the
script relies on on an official ParallelCluster >= 3.11 AMI are stand-ins (``cfnconfig``, pyxis's
disabled example config, the plugin file, ``enroot``, ``scontrol``, ``sysctl``). The test checks
exactly the boundary: the configuration the script writes for enroot, Slurm and pyxis.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from ctrain import resources
from ctrain.config import ClusterConfig
from tests.conftest import need, need_root

pytestmark = pytest.mark.integration

SCRIPT = resources.path("cluster", "scripts", "enroot-pyxis.sh")
SQUASH = ClusterConfig().enroot_squash_options
PLUGIN = "/usr/local/lib/slurm/spank_pyxis.so"
# pyxis's plugstack arguments and the values it accepts: NVIDIA/pyxis config.c (pyxis_config_parse).
# An unknown argument stops pyxis from loading, and with `required`, every srun. ParallelCluster
# 3.11+ AMIs ship pyxis 0.20, which knows all of these.
PYXIS_ARGUMENTS = {
    "runtime_path": None,  # a path
    "execute_entrypoint": {"0", "1", "true", "false", "yes", "no", "y", "n"},
    "container_scope": {"job", "global"},
    "sbatch_support": {"0", "1", "true", "false", "yes", "no", "y", "n"},
    "use_enroot_load": {"0", "1", "true", "false", "yes", "no", "y", "n"},
    "importer": None,
    "use_squashfuse": {"0", "1", "true", "false", "yes", "no", "y", "n"},
}

# The node double, set up inside the namespace; then the script; then the results copied out.
NODE = r"""
set -eu
T="$1"; NODE_TYPE="$2"; OS_VERSION="$3"; NVME="$4"; HAS_PYXIS="$5"
for d in etc usr var; do
    mkdir -p "$T/$d-up" "$T/$d-work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$T/$d-up,workdir=$T/$d-work" "/$d"
done
mount -t tmpfs none /run
mount -t tmpfs none /opt
mkdir -p /etc/parallelcluster /opt/parallelcluster/examples/pyxis /opt/slurm/bin /opt/slurm/etc \
         /usr/local/lib/slurm /usr/share/enroot/hooks.d /etc/tmpfiles.d /etc/sysctl.d "$T/bin" "$T/nvme"
echo "cfn_node_type=$NODE_TYPE" > /etc/parallelcluster/cfnconfig
rm -f /etc/os-release
printf 'ID=ubuntu\nVERSION_ID="%s"\n' "$OS_VERSION" > /etc/os-release
echo "required PLUGIN runtime_path=/run/pyxis" > /opt/parallelcluster/examples/pyxis/pyxis.conf
if [ "$HAS_PYXIS" = yes ]; then touch PLUGIN; fi
touch /usr/share/enroot/hooks.d/50-slurm-pmi.sh /usr/share/enroot/hooks.d/50-slurm-pytorch.sh
for tool in /opt/slurm/bin/scontrol "$T/bin/sysctl" "$T/bin/enroot"; do
    printf '#!/bin/sh\necho "$(basename "$0") $*" >> %s/calls\n' "$T" > "$tool"
    chmod +x "$tool"
done
if [ "$NVME" = yes ]; then mount -t tmpfs none "$T/nvme"; fi
set +e
PATH="$T/bin:$PATH" bash "$T/enroot-pyxis.sh" "$T/nvme" "SQUASH" > "$T/output" 2>&1
echo $? > "$T/rc"
set -e
mkdir -p "$T/out"
cp -a /etc/enroot "$T/out/enroot"
cp -a /opt/slurm/etc "$T/out/slurm-etc"
cp /etc/tmpfiles.d/ctrain-enroot.conf "$T/out/tmpfiles.conf" 2>/dev/null || true
cp /etc/sysctl.d/99-ctrain-enroot-userns.conf "$T/out/userns.conf" 2>/dev/null || true
for d in /run/enroot /run/pyxis /var/enroot /var/enroot/data "$T/nvme/enroot" "$T/nvme/enroot/cache"; do
    if [ -d "$d" ]; then stat -c '%a %n' "$d"; fi
done > "$T/out/modes"
""".replace("PLUGIN", PLUGIN).replace("SQUASH", SQUASH)


@dataclass
class Node:
    rc: int
    output: str
    calls: list[str]
    dir: Path

    def read(self, name: str) -> str:
        return (self.dir / "out" / name).read_text()

    def enroot_conf(self) -> dict[str, str]:
        lines = self.read("enroot/enroot.conf").splitlines()
        return dict(line.split(None, 1) for line in lines if line.strip() and not line.startswith("#"))

    def modes(self) -> dict[str, str]:
        return {path: mode for mode, path in (line.split(" ", 1) for line in self.read("modes").splitlines())}


def boot(tmp_path: Path, node_type: str, *, os_version: str = "22.04", nvme: bool = True, pyxis: bool = True) -> Node:
    need_root()
    need(shutil.which("unshare") is not None, "unshare (util-linux)")
    shutil.copy(SCRIPT, tmp_path / "enroot-pyxis.sh")
    flags = ["yes" if nvme else "no", "yes" if pyxis else "no"]
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "bash",
            "-c",
            NODE,
            "node",
            str(tmp_path),
            node_type,
            os_version,
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    calls = tmp_path / "calls"
    return Node(
        int((tmp_path / "rc").read_text()),
        (tmp_path / "output").read_text(),
        calls.read_text().splitlines() if calls.exists() else [],
        tmp_path,
    )


def test_head_node_enables_pyxis_and_puts_enroot_on_nvme(tmp_path: Path) -> None:
    node = boot(tmp_path, "HeadNode")
    assert node.rc == 0, node.output
    nvme = f"{tmp_path}/nvme/enroot"
    assert node.enroot_conf() == {
        "ENROOT_RUNTIME_PATH": "/run/enroot/user-$(id -u)",
        "ENROOT_CACHE_PATH": f"{nvme}/cache/group-$(id -g)",
        "ENROOT_DATA_PATH": f"{nvme}/data/user-$(id -u)",
        "ENROOT_TEMP_PATH": f"{nvme}/tmp",
        "ENROOT_SQUASH_OPTIONS": SQUASH,
        "ENROOT_MOUNT_HOME": "no",
        "ENROOT_RESTRICT_DEV": "yes",
        "ENROOT_ROOTFS_WRITABLE": "yes",
    }
    assert node.modes() == {"/run/enroot": "1777", "/run/pyxis": "1777", nvme: "1777", f"{nvme}/cache": "1777"}
    assert node.read("tmpfiles.conf").split("\n")[:2] == [
        "d /run/enroot 1777 root root -",
        "d /run/pyxis 1777 root root -",
    ]
    assert node.read("slurm-etc/plugstack.conf").strip() == "include /opt/slurm/etc/plugstack.conf.d/*"
    words = node.read("slurm-etc/plugstack.conf.d/pyxis.conf").split()
    assert words[:2] == ["required", PLUGIN]
    options = dict(word.split("=", 1) for word in words[2:])
    for key, value in options.items():
        allowed = PYXIS_ARGUMENTS[key]  # KeyError: pyxis would refuse to load
        assert allowed is None or value in allowed, f"{key}={value}"
    assert options == {
        "runtime_path": "/run/pyxis",
        "execute_entrypoint": "0",
        "container_scope": "job",
        "sbatch_support": "1",
    }
    assert node.calls == ["scontrol reconfigure"]
    assert sorted(p.name for p in (tmp_path / "out" / "enroot" / "hooks.d").iterdir()) == ["50-slurm-pmi.sh"]


def test_compute_node_without_nvme_configures_only_enroot(tmp_path: Path) -> None:
    node = boot(tmp_path, "ComputeFleet", nvme=False)
    assert node.rc == 0, node.output
    conf = node.enroot_conf()
    assert conf["ENROOT_DATA_PATH"] == "/var/enroot/data/user-$(id -u)"
    assert conf["ENROOT_CACHE_PATH"] == "/var/enroot/cache/group-$(id -g)"
    assert node.modes()["/var/enroot/data"] == "1777"
    assert not (tmp_path / "out" / "slurm-etc" / "plugstack.conf").exists()  # the head node's job
    assert node.calls == []
    assert not (tmp_path / "out" / "userns.conf").exists()  # 22.04 needs no AppArmor change


def test_ubuntu_2404_allows_unprivileged_user_namespaces(tmp_path: Path) -> None:
    node = boot(tmp_path, "ComputeFleet", os_version="24.04")
    assert node.rc == 0, node.output
    assert node.read("userns.conf").strip() == "kernel.apparmor_restrict_unprivileged_userns = 0"
    assert node.calls == ["sysctl --system"]


def test_head_node_without_pyxis_fails_clearly(tmp_path: Path) -> None:
    node = boot(tmp_path, "HeadNode", pyxis=False)
    assert node.rc == 1
    assert "pyxis plugin not found" in node.output
    assert node.calls == []
