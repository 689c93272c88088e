"""The small demo image: an Apptainer definition built into a SIF as the job user.

No base image can be pulled on many machines (and none is needed): the definition starts from
scratch and gets a static busybox, taken from the distribution's ``busybox-static`` package
without installing it on the host. The build runs unprivileged, the way users build on a cluster.
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

from ctrain import ui
from ctrain.errors import CtrainError
from ctrain.testbed.control import Log, Testbed

BUSYBOX_PACKAGE = "busybox-static"


def _own(tb: Testbed, *paths: Path) -> None:
    user = pwd.getpwnam(tb.user)
    for path in paths:
        os.chown(path, user.pw_uid, user.pw_gid)


def busybox(tb: Testbed, work: Path) -> Path:
    """A static busybox from the distribution's package, downloaded and unpacked once into ``work``."""
    binary = work / "busybox-static" / "bin" / "busybox"
    if binary.is_file():
        return binary
    debs = sorted(work.glob(f"{BUSYBOX_PACKAGE}_*.deb"))
    if not debs:
        tb.run_as_user(["apt-get", "download", BUSYBOX_PACKAGE], cwd=work, timeout=300)
        debs = sorted(work.glob(f"{BUSYBOX_PACKAGE}_*.deb"))
    if not debs:
        raise CtrainError(f"`apt-get download {BUSYBOX_PACKAGE}` left no .deb in {work}")
    tb.run_as_user(["dpkg-deb", "-x", debs[-1], binary.parent.parent], cwd=work)
    return binary


def build_demo_image(tb: Testbed, definition: Path, output: Path | None = None, *, sqsh: bool = False,
                     log: Log = ui.info) -> Path:
    """Build ``definition`` (which may use ``{{ busybox }}``) into a SIF as the job user; with ``sqsh``,
    into a squashfs for enroot (pyxis) instead, made from the SIF's root filesystem.

    The image goes to ``output`` (default: the shared directory, named after the definition);
    rebuilding overwrites it.
    """
    definition = Path(definition)
    if not definition.is_file():
        raise CtrainError(f"definition {definition} does not exist")
    if not tb.shared_dir.is_dir():
        raise CtrainError(f"{tb.shared_dir} does not exist: run `ctrain testbed up` first")
    suffix = ".sqsh" if sqsh else ".sif"
    output = Path(output).absolute() if output else tb.shared_dir / f"{definition.stem}{suffix}"
    sif = output.with_suffix(".sif") if sqsh else output
    work = tb.shared_dir / ".demo-image"
    work.mkdir(exist_ok=True)
    _own(tb, work)
    # The job user may not be able to read the checkout (e.g. under /root): build from a copy.
    copy = work / definition.name
    shutil.copyfile(definition, copy)
    _own(tb, copy)
    log(f"building {output} from {definition} as {tb.user}")
    code = tb.stream_as_user(
        ["apptainer", "build", "--force", "--build-arg", f"busybox={busybox(tb, work)}", str(sif), str(copy)],
        on_line=lambda line: log("  apptainer: " + line),
    )
    if code != 0:
        raise CtrainError(f"apptainer build of {definition} failed (exit {code}); its output is above")
    if sqsh:
        rootfs = work / "rootfs"
        commands = (
            ["rm", "-rf", str(rootfs)],
            ["apptainer", "build", "--force", "--sandbox", str(rootfs), str(sif)],
            ["mksquashfs", str(rootfs), str(output), "-noappend", "-quiet", "-no-xattrs"],
            ["rm", "-rf", str(rootfs)],
        )
        for argv in commands:
            code = tb.stream_as_user(argv, on_line=lambda line: log("  " + line))
            if code != 0:
                raise CtrainError(f"{' '.join(argv[:2])} for the squashfs of {definition} failed (exit {code})")
    return output
