"""enroot and pyxis on the testbed, built from their release sources (``ctrain testbed up --pyxis``).

Neither is packaged for Debian, so they are compiled here: enroot against glibc (its musl and
makeself submodules are not in a release tarball; Debian's makeself stands in for the latter),
pyxis against the headers of the Slurm the testbed runs (``libslurm-dev``; a plugin built for
another Slurm refuses to load). Both go into one prefix in the testbed's state directory, so
``down --purge`` removes them and nothing lands in /usr/local.

The testbed's nodes share one filesystem, where a cluster's nodes each have a local disk: enroot's
data, cache and runtime directories are made per node and per user in ``enroot.conf`` (enroot
evaluates its values in a shell, and each node has its own hostname), or two nodes unpacking the
same job's container would write into one directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ctrain import proc
from ctrain.errors import CtrainError
from ctrain.files import load_json_bounded
from ctrain.testbed.plan import Layout

BUILD_TIMEOUT = 600.0
MAX_RECORD_BYTES = 64 * 1024  # installed.json: three short strings
SLURM_HEADERS = Path("/usr/include/slurm")
# Debian's makeself package: the files enroot's deps/makeself submodule would hold.
MAKESELF = (Path("/usr/bin/makeself"), Path("/usr/share/makeself/makeself-header.sh"))
# The plugin, under the prefix; plugstack.conf names it, with a runtime directory in the prefix, not /run.
PLUGIN = "lib/slurm/spank_pyxis.so"


@dataclass(frozen=True)
class Sources:
    """Where enroot's and pyxis's sources are: each a release tarball or an unpacked source tree."""

    enroot: Path
    pyxis: Path

    @classmethod
    def from_dir(cls, directory: Path) -> Sources:
        """The enroot-*.tar.gz and pyxis-*.tar.gz (or enroot*/, pyxis*/ trees) in ``directory``."""

        def one(name: str) -> Path:
            found = sorted(p for p in directory.glob(f"{name}*") if p.is_dir() or p.name.endswith(".tar.gz"))
            if len(found) != 1:
                what = "none" if not found else ", ".join(p.name for p in found)
                raise CtrainError(
                    f"{directory}: expected one {name} source (a {name}-VERSION.tar.gz from its GitHub releases, "
                    f"or its source tree), found {what}"
                )
            return found[0]

        return cls(one("enroot"), one("pyxis"))

    def fingerprint(self) -> str:
        """Changes when either source does: a new release rebuilds, the same one does not."""
        digest = hashlib.sha256()
        for source in (self.enroot, self.pyxis):
            digest.update(str(source.resolve()).encode())
            files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
            for path in files:
                stat = path.stat()
                digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Installed:
    """What the testbed runs: versions and the source fingerprint they were built from."""

    enroot: str
    pyxis: str
    fingerprint: str


def _record(layout: Layout) -> Path:
    return layout.pyxis_prefix / "installed.json"


def installed(layout: Layout) -> Installed | None:
    """enroot and pyxis as installed in this testbed, or None."""
    try:
        record = _record(layout)
        data = load_json_bounded(record, MAX_RECORD_BYTES, "the pyxis record") if record.exists() else {}
        found = Installed(str(data["enroot"]), str(data["pyxis"]), str(data["fingerprint"]))
    except (CtrainError, OSError, KeyError, TypeError):
        return None
    if not (layout.pyxis_prefix / PLUGIN).is_file() or not (layout.pyxis_prefix / "bin" / "enroot").is_file():
        return None
    return found


def bin_dir(layout: Layout) -> Path:
    """Put first on slurmd's PATH: pyxis runs ``enroot`` from it, and enroot its helpers."""
    return layout.pyxis_prefix / "bin"


def node_dir(layout: Layout) -> Path:
    """Each node's enroot directories (one per node and user below it): the nodes' "local disks"."""
    return layout.pyxis_prefix / "nodes"


# The prefix's path goes into enroot.conf, whose values enroot evaluates in a shell, and into
# plugstack.conf, whose words are split on spaces: plain path characters only.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/+-]+")


def check_prefix(layout: Layout) -> None:
    """Refuse a state directory whose path enroot.conf or plugstack.conf could not hold as it is."""
    if not _PLAIN_PATH.fullmatch(str(layout.pyxis_prefix)):
        raise CtrainError(
            f"the testbed's state directory {str(layout.root)!r} has characters enroot.conf and plugstack.conf "
            "cannot hold (enroot evaluates its settings in a shell): use a path of letters, digits and . _ + - / "
            "(--state-dir or CTRAIN_TESTBED_DIR)"
        )


def render_plugstack(layout: Layout, with_pyxis: bool) -> str:
    """plugstack.conf: pyxis for every slurmd and srun, or no plugin."""
    head = "# Written by `ctrain testbed up`; see docs/testbed.md (pyxis).\n"
    if not with_pyxis:
        return head + "# No SPANK plugin: start the testbed with --pyxis to load pyxis here.\n"
    # required: a node whose pyxis cannot load runs no job at all, rather than jobs without containers.
    return head + f"required {layout.pyxis_prefix / PLUGIN} runtime_path={layout.pyxis_prefix / 'run'}\n"


def render_enroot_conf(layout: Layout) -> str:
    """The lines added to enroot.conf: enroot's directories per node (hostname) and per user."""
    base = node_dir(layout)
    lines = ["", "# ctrain testbed: the nodes share one filesystem, so each node (hostname) gets its own directories."]
    for key, sub in (("RUNTIME", "runtime"), ("CACHE", "cache"), ("DATA", "data"), ("TEMP", "tmp")):
        lines.append(f"ENROOT_{key}_PATH {base}/$(uname -n)/{sub}/user-$(id -u)")
    return "\n".join(lines) + "\n"


def _slurm_versions() -> tuple[str, str]:
    """The running Slurm's version and that of the headers pyxis compiles against."""
    running = proc.run([proc.require("slurmd"), "-V"]).stdout.split()[-1]
    header = SLURM_HEADERS / "slurm_version.h"
    try:
        match = re.search(r"SLURM_VERSION_NUMBER\s+0x([0-9a-fA-F]{6})", header.read_text())
    except OSError:
        match = None
    if not match:
        return running, ""
    number = int(match.group(1), 16)
    return running, f"{number >> 16}.{(number >> 8) & 0xFF:02d}.{number & 0xFF}"


def _unpack(source: Path, into: Path, name: str) -> Path:
    """A fresh copy of ``source`` (tarball or tree) under ``into``: the build writes only there."""
    target = into / name
    if target.exists():
        shutil.rmtree(target)
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True)
        return target
    if not source.is_file() or not source.name.endswith((".tar.gz", ".tgz")):
        raise CtrainError(f"{source}: give a {name} release tarball (.tar.gz) or its source directory")
    target.mkdir(parents=True)
    try:
        with tarfile.open(source) as archive:
            archive.extractall(target, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise CtrainError(f"{source}: cannot unpack it as a {name} source tarball: {exc}") from exc
    tops = list(target.iterdir())
    return tops[0] if len(tops) == 1 and tops[0].is_dir() else target


def _version(tree: Path) -> str:
    """The version both Makefiles state (enroot: ``VERSION :=``, pyxis: ``PYXIS_VER ?=``)."""
    match = re.search(r"^(?:VERSION|PYXIS_VER)\s*[:?]=\s*(\S+)", (tree / "Makefile").read_text(), re.M)
    return match.group(1) if match else "unknown"


def _check_trees(enroot: Path, pyxis: Path) -> None:
    if not (enroot / "enroot.in").is_file():
        raise CtrainError(f"{enroot} does not look like enroot's source (no enroot.in)")
    if not (pyxis / "pyxis_slurmstepd.c").is_file():
        raise CtrainError(f"{pyxis} does not look like pyxis's source (no pyxis_slurmstepd.c)")


def install(layout: Layout, sources: Sources, log: Callable[[str], None]) -> Installed:
    """Build and install enroot and pyxis into the testbed's prefix (skipped when already built from
    the same sources); write enroot's per-node paths. Returns what is installed."""
    check_prefix(layout)
    fingerprint = sources.fingerprint()
    current = installed(layout)
    if current is not None and current.fingerprint == fingerprint:
        return current
    running, headers = _slurm_versions()
    if headers != running:
        raise CtrainError(
            f"pyxis must be compiled against the Slurm that runs it ({running}), and the headers in {SLURM_HEADERS} "
            f"are {headers or 'missing'}: install libslurm-dev {running}"
        )
    prefix = layout.pyxis_prefix
    work = layout.root / "pyxis-build"
    work.mkdir(parents=True, exist_ok=True)
    enroot = _unpack(sources.enroot, work, "enroot")
    pyxis = _unpack(sources.pyxis, work, "pyxis")
    _check_trees(enroot, pyxis)
    versions = _version(enroot), _version(pyxis)
    log(f"building enroot {versions[0]} and pyxis {versions[1]} (against Slurm {running}) into {prefix}")
    makeself = enroot / "deps" / "makeself"
    if not (makeself / "makeself.sh").is_file():
        makeself.mkdir(parents=True, exist_ok=True)
        shutil.copy(MAKESELF[0], makeself / "makeself.sh")
        shutil.copy(MAKESELF[1], makeself / "makeself-header.sh")
    headers_dir = enroot / "deps" / "linux-headers"
    if not any(headers_dir.glob("*")):  # the submodule is absent: the system's kernel headers serve
        (enroot / "deps" / "dist" / "linux").mkdir(parents=True, exist_ok=True)
        headers_dir.mkdir(parents=True, exist_ok=True)
        (headers_dir / ".stamp").touch()
    if prefix.exists():
        shutil.rmtree(prefix)
    where = [f"prefix={prefix}", f"sysconfdir={prefix / 'etc'}", "FORCE_GLIBC=1"]
    make = proc.require("make")
    proc.run([make, "-C", enroot, "-j2", *where], timeout=BUILD_TIMEOUT)
    proc.run([make, "-C", enroot, "install", *where], timeout=BUILD_TIMEOUT)
    # CPPFLAGS from the environment: on make's command line it would replace pyxis's own -D_GNU_SOURCE.
    proc.run([make, "-C", pyxis, "-j2"], env={"CPPFLAGS": f"-I{SLURM_HEADERS}"}, timeout=BUILD_TIMEOUT)
    plugin = prefix / PLUGIN
    plugin.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(pyxis / "spank_pyxis.so", plugin)
    with (prefix / "etc" / "enroot" / "enroot.conf").open("a") as conf:
        conf.write(render_enroot_conf(layout))
    node_dir(layout).mkdir(exist_ok=True)
    node_dir(layout).chmod(0o1777)  # each user makes its own directories below, as in /tmp
    (prefix / "run").mkdir(exist_ok=True)
    for path in [prefix, *prefix.rglob("*")]:  # readable by the job user whatever the umask
        if path.is_dir() and path != node_dir(layout):
            path.chmod(0o755)
        elif path.is_file():
            path.chmod(0o755 if path.stat().st_mode & 0o100 else 0o644)
    shutil.rmtree(work)
    done = Installed(versions[0], versions[1], fingerprint)
    _record(layout).write_text(json.dumps(done.__dict__) + "\n")
    return done
