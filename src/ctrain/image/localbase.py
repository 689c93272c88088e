"""A local base image for the CPU flavour, made with debootstrap: for machines that cannot pull
images (air-gapped build hosts, CI). A minimal Debian with python3 and python3-venv, imported into
the builder's store as an image; ``ctrain build --local-base`` uses it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ctrain import proc, ui
from ctrain.errors import CtrainError
from ctrain.image import store

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# g++ and python3-dev: DeepSpeed compiles its CPU ops (shared-memory all-reduce) when a job starts,
# as NGC's GPU bases allow; without a compiler a DeepSpeed run on CPU nodes fails.
PACKAGES = ("python3", "python3-venv", "ca-certificates", "g++", "python3-dev")
# The tag names the package set, so a changed list makes a new base instead of reusing the old one.
DEFAULT_REF = f"localhost/ctrain-base:{SUITE}-{hashlib.sha256(' '.join(PACKAGES).encode()).hexdigest()[:8]}"
# Trimmed from the rootfs: package lists, caches and docs the image never needs.
_TRIM = (
    "var/lib/apt/lists",
    "var/cache/apt",
    "var/cache/debconf",
    "var/log",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/info",
)


def debootstrap_base(
    ref: str = DEFAULT_REF,
    *,
    builder: str = "auto",
    suite: str = SUITE,
    mirror: str = MIRROR,
    reuse: bool = True,
    workdir: Path | None = None,
) -> store.Image:
    """Make (or, with ``reuse``, find) a debootstrap base image ``ref`` in the builder's store."""
    target = _import_store(builder)
    if reuse:
        existing = store.inspect(ref, target)
        if existing is not None:
            ui.info(f"base: using existing {ref} ({existing.short_id})")
            return existing
    if os.geteuid() != 0:
        raise CtrainError(
            "debootstrap needs root to make a local base image; run as root, or pass --base with an image "
            "that has python3 (>= 3.10) and python3-venv (e.g. debian:bookworm-slim plus python3-venv)"
        )
    proc.require("debootstrap")
    with tempfile.TemporaryDirectory(prefix="ctrain-base-", dir=workdir) as tmp:
        rootfs = Path(tmp) / "rootfs"
        ui.info(f"base: debootstrap {suite} (minbase + {', '.join(PACKAGES)}) ...")
        proc.stream(
            ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, rootfs, mirror],
            prefix="base: ",
        )
        for rel in _TRIM:
            path = rootfs / rel
            if path.is_dir():
                for child in path.iterdir():
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        _import(rootfs, ref, target)
    image = store.inspect(ref, target)
    if image is None:
        raise CtrainError(f"imported the base as {ref}, but the image store does not show it")
    ui.info(f"base: {ref} ({image.short_id})")
    return image


def _import_store(builder: str) -> store.StoreName:
    if builder == "docker" or (builder == "auto" and store.docker_daemon_up()):
        return "docker"
    if builder in ("podman", "buildah", "auto") and (proc.which("podman") or proc.which("buildah")):
        return "containers"
    raise CtrainError(f"a local base image needs docker, podman or buildah (builder: {builder})")


def _import(rootfs: Path, ref: str, target: store.StoreName) -> None:
    """Tar the rootfs and ``docker import`` / ``podman import`` it (buildah alone: copy it in)."""
    if target == "containers" and not proc.which("podman"):
        _buildah_import(rootfs, ref)
        return
    tarball = rootfs.parent / "rootfs.tar"
    proc.run(
        [
            "tar",
            "-C",
            rootfs,
            "--numeric-owner",
            "--exclude=./proc/*",
            "--exclude=./sys/*",
            "--exclude=./dev/*",
            "-cf",
            tarball,
            ".",
        ]
    )
    tool = "docker" if target == "docker" else "podman"
    proc.run([tool, "import", "--change", 'CMD ["/bin/bash"]', tarball, ref])


def _buildah_import(rootfs: Path, ref: str) -> None:
    container = proc.run(["buildah", "from", "scratch"]).stdout.strip()
    try:
        mount = proc.run(["buildah", "mount", container]).stdout.strip()
        proc.run(["cp", "-a", f"{rootfs}/.", mount])
        proc.run(["buildah", "config", "--cmd", "/bin/bash", container])
        proc.run(["buildah", "commit", "--quiet", container, ref])
    finally:
        proc.run(["buildah", "rm", container], check=False)
