"""An enroot image (squashfs) written without enroot, following ``enroot import``'s conventions so
pyxis (``srun --container-image=IMAGE.sqsh``) and ``enroot create`` start it as if enroot made it.

What enroot does when it imports a Docker image (src/docker.sh, ``docker::configure``; image format
in doc/image-format.md), and what this module reproduces:

- the layers are applied into one rootfs (whiteouts honoured); ``/dev`` is left empty and
  ``/.dockerenv`` dropped; directories made user-writable (enroot's ``fixperms``);
- ``/etc/environment``: the image's ``Env``, one ``KEY=VALUE`` per line;
- ``/etc/rc``: labels as comments, then ``cd`` to ``WorkingDir``, source ``/etc/rc.local``, and
  ``exec`` entrypoint + arguments (or entrypoint + ``Cmd`` without arguments);
- ``/etc/rc.local``: the empty hook enroot ships;
- ``/etc/fstab``: each ``Volume`` as a bind mount of the rootfs onto itself (``x-create=dir``);
- ``mksquashfs ROOTFS IMAGE -all-root`` with the chosen compression.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ctrain import proc, ui
from ctrain.errors import CtrainError

# mksquashfs options per compression. enroot's own default (ENROOT_SQUASH_OPTIONS) is
# "-comp lzo -noD": lzo metadata, uncompressed data. pyxis recommends no compression for
# fast starts; zstd is the middle ground (small files, fast to decompress), at level 3: as fast
# to write as no compression here, where mksquashfs's default level 15 takes many times longer.
SQUASH_OPTIONS: dict[str, tuple[str, ...]] = {
    "none": ("-noI", "-noD", "-noF", "-noX"),
    "lzo": ("-comp", "lzo"),
    "gzip": ("-comp", "gzip"),
    "zstd": ("-comp", "zstd", "-Xcompression-level", "3"),
    "xz": ("-comp", "xz"),
    "lz4": ("-comp", "lz4"),
}

RC_LOCAL = (
    "# This file is sourced by /etc/rc when the container starts.\n"
    "# It can be used to manipulate the entrypoint or the command of the container.\n"
)


def _quote(word: str) -> str:
    """Single-quote a word for sh, the way bash's ``${var@Q}`` does in enroot's rc."""
    return "'" + word.replace("'", "'\\''") + "'"


def enroot_files(config: Mapping[str, Any]) -> dict[str, str]:
    """The files enroot writes into an imported image, from the image config (OCI/Docker JSON)."""
    cfg = config.get("config") or config.get("Config") or {}
    env = list(cfg.get("Env") or [])
    entrypoint = list(cfg.get("Entrypoint") or [])
    cmd = list(cfg.get("Cmd") or [])
    workdir = cfg.get("WorkingDir") or "/"
    labels = cfg.get("Labels") or {}
    volumes = cfg.get("Volumes") or {}
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    entry = " ".join(_quote(w) for w in entrypoint)
    rc = "".join(f"# {key} {' '.join(str(value).split())}\n" for key, value in labels.items())
    if rc:
        rc += "\n"
    rc += (
        f'mkdir -p "{workdir}" 2> /dev/null\n'
        f'cd "{workdir}" && unset OLDPWD || exit 1\n'
        "\n"
        "if [ -s /etc/rc.local ]; then\n"
        "    . /etc/rc.local\n"
        "fi\n"
        "\n"
        "if [ $# -gt 0 ]; then\n"
        f'    exec {entry} "$@"\n'
        "else\n"
        f"    exec {entry} {' '.join(_quote(w) for w in cmd)}\n"
        "fi\n"
    )
    fstab = "".join(
        f"${{ENROOT_ROOTFS}}{volume} {volume} none x-create=dir,bind,rw,nosuid,nodev\n" for volume in sorted(volumes)
    )
    environment = "".join(f"{line}\n" for line in env)
    return {"etc/environment": environment, "etc/rc": rc, "etc/rc.local": RC_LOCAL, "etc/fstab": fstab}


def configure(rootfs: Path, config: Mapping[str, Any]) -> None:
    """Apply enroot's import conventions to an unpacked rootfs, in place."""
    for rel, text in enroot_files(config).items():
        path = rootfs / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_text(text)
        path.chmod(0o644)
    cfg = config.get("config") or config.get("Config") or {}
    (rootfs / (cfg.get("WorkingDir") or "/").lstrip("/")).mkdir(parents=True, exist_ok=True)
    dev = rootfs / "dev"
    if dev.is_dir():
        for child in dev.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    (rootfs / ".dockerenv").unlink(missing_ok=True)
    _fixperms(rootfs)


def _fixperms(rootfs: Path) -> None:
    """enroot's fixperms: everything user-readable, directories user-writable (so the user who
    unpacks the image on a node can also remove it)."""
    for top, dirs, files in os.walk(rootfs):
        for name in dirs:
            path = os.path.join(top, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and (mode & 0o700) != 0o700:
                os.chmod(path, mode | 0o700)
        for name in files:
            path = os.path.join(top, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode) and not mode & stat.S_IRUSR:
                os.chmod(path, mode | stat.S_IRUSR | (stat.S_IXUSR if mode & 0o011 else 0))


def unpack(layout: Path, tag: str, rootfs: Path) -> None:
    """Apply the image's layers into ``rootfs`` (umoci: whiteouts, hard links, xattrs)."""
    cmd = ["umoci", "raw", "unpack"]
    if os.geteuid() != 0:
        cmd.append("--rootless")
    proc.run([*cmd, "--image", f"{layout}:{tag}", rootfs])


def write(
    layout: Path,
    tag: str,
    config: Mapping[str, Any],
    output: Path,
    compression: str,
    workdir: Path,
    *,
    emit: Callable[[str], None] = ui.info,
) -> None:
    """Write the enroot image of the OCI layout's image to ``output`` (a path the caller renames)."""
    if compression not in SQUASH_OPTIONS:
        raise ValueError(f"unknown compression {compression!r}")
    proc.require("umoci")
    proc.require("mksquashfs")
    rootfs = workdir / "rootfs"
    emit("sqsh: unpacking the image layers")
    unpack(layout, tag, rootfs)
    emit("sqsh: writing enroot's /etc/environment, /etc/rc, /etc/rc.local, /etc/fstab")
    configure(rootfs, config)
    emit(f"sqsh: mksquashfs ({compression})")
    proc.stream(
        [
            "mksquashfs",
            rootfs,
            output,
            "-all-root",
            "-noappend",
            "-no-progress",
            "-quiet",
            *SQUASH_OPTIONS[compression],
        ],
        on_line=lambda line: emit("sqsh: " + line) if line.strip() else None,
    )


# What the sbatch scripts run in the container (pyxis with --no-container-entrypoint): the launcher,
# by name, from the image's PATH as enroot's login shell leaves it.
LAUNCHERS = ("torchrun", "python")
_FIND_LAUNCHERS = (
    'for c in "$@"; do command -v "$c" >/dev/null || { echo "$c is not on the container\'s PATH ($PATH)"; exit 3; }; '
    "done"
)
SELF_CHECK_TIMEOUT = 120.0


def self_check(image: Path, workdir: Path, emit: Callable[[str], None] = ui.info, *, shown: str = "") -> None:
    """Start ``image`` with enroot the way pyxis starts it (no entrypoint, enroot's login shell, the
    image's environment) and find the launchers. Reading /etc/environment cannot show what the
    login shell's /etc/profile does to PATH; enroot itself can. Skipped, and said, without enroot.
    ``shown``: the name the error gives the image (the caller's output, not its temporary file)."""
    enroot = proc.which("enroot")
    if not enroot:
        emit("sqsh: enroot is not on PATH here, so the squashfs was not started (pyxis starts it on the nodes)")
        return
    base = workdir / "enroot-check"
    env = {f"ENROOT_{key}_PATH": str(base / key.lower()) for key in ("DATA", "CACHE", "RUNTIME", "TEMP")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    rc = base / "rc"  # enroot's stand-in for the image's /etc/rc: run the command, not the entrypoint
    rc.write_text('exec "$@"\n')
    argv = [enroot, "start", "--rc", rc, image, "sh", "-c", _FIND_LAUNCHERS, "check", *LAUNCHERS]
    out = proc.run(argv, env=env, check=False, timeout=SELF_CHECK_TIMEOUT)
    if out.returncode != 0:
        said = (out.stdout + out.stderr).strip().splitlines()
        raise CtrainError(
            f"{shown or image.name} does not start as pyxis starts it (`enroot start IMAGE sh -c ...`): "
            f"{said[-1] if said else f'exit {out.returncode}'}. An image built on Debian loses its ENV PATH to "
            "/etc/profile in enroot's login shell: put it back in /etc/profile.d (containers/install.sh does; "
            "docs/sbatch.md, 'PATH under pyxis')"
        )
    emit(f"sqsh: started with enroot as pyxis does; {' and '.join(LAUNCHERS)} are on the image's PATH")
