"""Installing host packages from the distribution (Debian/Ubuntu, as root).

Package sets are named by what they serve, so ``ctrain testbed up`` and the test setup install
from the same list. Apptainer is not in Debian bookworm: it comes from Debian sid through an
apt source pinned low, so nothing else is upgraded unless Apptainer needs it.

A package counts as present when dpkg has it installed, or when the programs ctrain runs from it
are all on PATH (installed from an offline bundle, built from source, another package name):
then nothing is installed, so a machine without a package registry works once the tools are there.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ctrain import proc
from ctrain.errors import CtrainError

PACKAGES: dict[str, tuple[str, ...]] = {
    "testbed": ("slurm-wlm", "munge", "squashfs-tools", "iproute2", "util-linux", "procps", "debootstrap"),
    "apptainer": ("apptainer", "squashfuse", "fuse2fs"),
    "image": ("buildah", "podman", "skopeo", "umoci", "squashfs-tools", "debootstrap", "rsync", "openssh-client"),
    "registry": ("docker-registry",),
    "push": ("rsync", "openssh-client", "openssh-server"),
    # ParallelCluster's CLI generates CloudFormation with the AWS CDK, which runs on Node.js (also for dry runs).
    "cluster": ("nodejs",),
    # enroot and pyxis built from source for the testbed (ctrain.testbed.pyxis), and what enroot runs.
    "pyxis": ("make", "gcc", "libc6-dev", "makeself", "libslurm-dev", "jq", "zstd", "squashfs-tools"),
    # The batch scripts and their bash library are linted in the CI tier (tests/unit/test_shellcheck.py).
    "lint": ("shellcheck",),
}

# The programs ctrain runs from each package; a package whose programs are all on PATH needs no
# installing. Packages not named here are looked up in dpkg only.
PROGRAMS: dict[str, tuple[str, ...]] = {
    "slurm-wlm": ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel"),
    "munge": ("munged",),
    "squashfs-tools": ("mksquashfs", "unsquashfs"),
    "iproute2": ("ip",),
    "util-linux": ("nsenter", "unshare", "setpriv"),
    "procps": ("pgrep", "pkill"),
    "debootstrap": ("debootstrap",),
    "apptainer": ("apptainer",),
    "squashfuse": ("squashfuse",),
    "fuse2fs": ("fuse2fs",),
    "buildah": ("buildah",),
    "podman": ("podman",),
    "skopeo": ("skopeo",),
    "umoci": ("umoci",),
    "rsync": ("rsync",),
    "openssh-client": ("ssh", "scp"),
    "openssh-server": ("sshd",),
    "nodejs": ("node",),
    "make": ("make",),
    "gcc": ("gcc",),
    "makeself": ("makeself",),
    "jq": ("jq",),
    "zstd": ("zstd",),
    "shellcheck": ("shellcheck",),
}

SID_SOURCE = Path("/etc/apt/sources.list.d/ctrain-sid.sources")
SID_PIN = Path("/etc/apt/preferences.d/ctrain-sid")
_SID_SOURCE_TEXT = """\
# Added by ctrain: Apptainer is not packaged for Debian bookworm.
Types: deb
URIs: http://deb.debian.org/debian
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
_SID_PIN_TEXT = """\
# Added by ctrain: take only what is asked for from sid (apptainer and its needs).
Package: *
Pin: release a=unstable
Pin-Priority: 100
"""
_APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
_NO_EXPIRY = ["-o", "Acquire::Check-Valid-Until=false"]


def is_root() -> bool:
    return os.geteuid() == 0


def _installed(package: str) -> bool:
    result = proc.run(["dpkg-query", "-W", "-f=${Status}", package], check=False)
    return result.returncode == 0 and "install ok installed" in result.stdout


def _programs_present(package: str) -> bool:
    programs = PROGRAMS.get(package)
    # sbin directories too: root's PATH has them, a user's or a minimal environment's may not.
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    return bool(programs) and all(shutil.which(program, path=path) for program in programs)


def missing(packages: tuple[str, ...] | list[str]) -> list[str]:
    """The packages among ``packages`` that are neither installed (dpkg) nor present as programs."""
    dpkg = shutil.which("dpkg-query") is not None
    return [p for p in packages if not _programs_present(p) and not (dpkg and _installed(p))]


def _apt_candidate(package: str) -> bool:
    result = proc.run(["apt-cache", "policy", package], check=False)
    return "Candidate:" in result.stdout and "Candidate: (none)" not in result.stdout


def ensure(*groups: str, quiet: bool = False) -> list[str]:
    """Install whatever is missing from the named package groups; returns what was installed."""
    wanted: list[str] = []
    for group in groups:
        for package in PACKAGES[group]:
            if package not in wanted:
                wanted.append(package)
    todo = missing(wanted)
    if not todo:
        return []
    if not is_root():
        raise CtrainError(
            f"missing packages: {' '.join(todo)}; install them as root "
            f"(apt-get install {' '.join(todo)}) or rerun this command as root"
        )
    if not shutil.which("apt-get"):
        raise CtrainError(
            f"missing packages: {' '.join(todo)}; ctrain installs packages only on Debian/Ubuntu (apt-get)"
        )
    log = (lambda line: None) if quiet else (lambda line: print("  apt: " + line, file=sys.stderr, flush=True))
    print(f"installing: {' '.join(todo)}", file=sys.stderr, flush=True)
    proc.stream(["apt-get", *_NO_EXPIRY, "update", "-q"], env=_APT_ENV, on_line=log)
    sid_group = [p for p in todo if p in PACKAGES["apptainer"]]
    from_sid = sid_group if sid_group and not _apt_candidate("apptainer") else []
    plain = [p for p in todo if p not in from_sid]
    if plain:
        proc.stream(["apt-get", "install", "-y", "-q", "--no-install-recommends", *plain], env=_APT_ENV, on_line=log)
    if from_sid:
        _add_sid()
        proc.stream(["apt-get", *_NO_EXPIRY, "update", "-q"], env=_APT_ENV, on_line=log)
        proc.stream(
            ["apt-get", *_NO_EXPIRY, "install", "-y", "-q", "--no-install-recommends", "-t", "sid", *from_sid],
            env=_APT_ENV,
            on_line=log,
        )
    still = missing(todo)
    if still:
        raise CtrainError(f"apt-get finished but these packages are still missing: {' '.join(still)}")
    return todo


def _add_sid() -> None:
    if not SID_SOURCE.exists():
        SID_SOURCE.write_text(_SID_SOURCE_TEXT)
    if not SID_PIN.exists():
        SID_PIN.write_text(_SID_PIN_TEXT)
