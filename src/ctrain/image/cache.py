"""The node-local image cache that the Apptainer sbatch scripts unpack images into.

The sbatch library (``ctrain_image_cache`` in ``sbatch/lib/ctrain.sh``) writes it; this module only
reads and clears it, with the same locks, so that ``ctrain cache`` never removes an image a running
task holds or one that a job is unpacking. The entry layout is described beside the library's code.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ctrain import protocol
from ctrain.errors import ConfigError, CtrainError
from ctrain.files import NotRegularFile, control_problem, open_lock, read_bounded, shorten

# An entry's files and name, as the library's image program makes them (the protocol's names).
COMPLETE = protocol.IMAGE_ENTRY_COMPLETE
USED = protocol.IMAGE_ENTRY_USED
LOCK = protocol.IMAGE_CACHE_LOCK
ROOTFS = protocol.IMAGE_ENTRY_ROOTFS
# An entry's name, as ctrain_image_key makes it: 16 hex digits of a sha256.
KEY = protocol.IMAGE_KEY
# The files CTRAIN_IMAGE_PREPARE writes into an entry besides rootfs/, and nothing else: a directory
# holding anything more is not an entry, and not ctrain's to remove.
ENTRY_FILES = protocol.IMAGE_ENTRY_FILES


def default_dir(env: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """Where the sbatch library puts the cache when CTRAIN_IMAGE_CACHE is not set (its default)."""
    if env.get(protocol.IMAGE_CACHE_ENV):
        return Path(env[protocol.IMAGE_CACHE_ENV])
    tmp = env.get("APPTAINER_TMPDIR") or env.get("TMPDIR") or "/tmp"
    return Path(tmp) / f"ctrain-images-{os.getuid()}"


@dataclass(frozen=True)
class Entry:
    """One unpacked image: ``key``, the file it came from, its size, when a job last started on it."""

    path: Path
    image: str
    size_kib: int
    used: float | None
    complete: bool
    in_use: bool

    @property
    def key(self) -> str:
        return self.path.name


def _read(path: Path, limit: int = 4096) -> str:
    """A small file of an entry, "" when it cannot be read (bounded, and a FIFO does not block)."""
    try:
        return read_bounded(path, limit, "cache file").decode("utf-8", "replace").strip()
    except ConfigError:
        return ""


def is_entry(path: Path) -> bool:
    """Whether ``path`` is an entry the sbatch library made: a directory named by a key that holds
    only rootfs/ and the entry's own files. What else a directory holds is not the cache's, so
    ``ctrain cache clear`` given the wrong directory (a project, a home) removes none of it."""
    if path.is_symlink() or not path.is_dir() or not KEY.fullmatch(path.name):
        return False
    try:
        for child in path.iterdir():
            mode = child.lstat().st_mode
            if not (stat.S_ISDIR(mode) if child.name == ROOTFS else child.name in ENTRY_FILES and stat.S_ISREG(mode)):
                return False
    except OSError:
        return False
    return True


def _is_lock(path: Path) -> bool:
    return path.name == LOCK and not path.is_symlink() and path.is_file()


def others(cache: Path) -> list[Path]:
    """What ``cache`` holds that is neither an entry nor the cache's lock: left alone, and named."""
    if not cache.is_dir():
        return []
    return sorted(p for p in cache.iterdir() if not _is_lock(p) and not is_entry(p))


@contextmanager
def _unheld(complete: Path) -> Iterator[bool]:
    """Whether no running task holds the entry (each holds a shared lock on its ``complete``),
    keeping it so (an exclusive lock, as the library's eviction takes it) while the block runs."""
    try:
        fd = os.open(complete, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


def _held(complete: Path) -> bool:
    """Whether a running task holds the entry."""
    with _unheld(complete) as free:
        return not free


def entries(cache: Path) -> list[Entry]:
    """The cache's entries, least recently used first; none when the cache does not exist."""
    if not cache.is_dir():
        return []
    found = []
    for path in sorted(cache.iterdir()):
        if not is_entry(path):
            continue
        complete = path / COMPLETE
        size = _read(path / protocol.IMAGE_ENTRY_SIZE)
        try:
            used: float | None = (path / USED).stat().st_mtime
        except OSError:
            used = None
        image = _read(path / protocol.IMAGE_ENTRY_IMAGE)
        image = repr(image) if control_problem(image) else image  # printed: no terminal escapes
        found.append(Entry(path, image, int(size) if size.isdigit() else 0, used,
                           complete.is_file(), complete.is_file() and _held(complete)))  # fmt: skip
    return sorted(found, key=lambda entry: entry.used or 0.0)


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """The cache's lock, as a job takes it to unpack or evict: held, nothing else changes it. Never
    through a link, and never a FIFO (:func:`ctrain.files.open_lock`)."""
    try:
        fd = open_lock(cache / LOCK)
    except NotRegularFile:
        raise CtrainError(f"the image cache's lock {cache / LOCK} is not a regular file (a link, FIFO or directory): "
                          "remove it") from None  # fmt: skip
    except OSError as exc:
        raise CtrainError(f"cannot take the image cache's lock {cache / LOCK} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove an unpacked tree, whose directories the image may have made read-only."""

    def writable(function: object, name: str, _exc: object) -> None:
        parent = os.path.dirname(name)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
        if os.path.isdir(name) and not os.path.islink(name):
            os.chmod(name, os.stat(name).st_mode | stat.S_IRWXU)
            shutil.rmtree(name, onerror=writable)
        else:
            os.unlink(name)

    shutil.rmtree(path, onerror=writable)


@dataclass(frozen=True)
class Cleared:
    """What ``clear`` did: entries removed, entries kept (in use), and what is not an entry (left)."""

    removed: list[Entry] = field(default_factory=list)
    kept: list[Entry] = field(default_factory=list)
    left: list[Path] = field(default_factory=list)


def clear(cache: Path) -> Cleared:
    """Remove every entry no running task holds (and half-unpacked ones); anything else in ``cache``
    stays. A directory with no entry and no lock is no image cache: holding other things, it is
    refused, with nothing removed and no lock left in it."""
    if not cache.is_dir():
        return Cleared()
    left = others(cache)
    found = entries(cache)
    if not found and left and not _is_lock(cache / LOCK):
        names = ", ".join(shorten(p.name, 40) for p in left[:5]) + (", ..." if len(left) > 5 else "")
        raise ConfigError(
            f"{cache} is not an image cache (no {LOCK} file, no KEY/ entry of 16 hex digits; it holds {names}): "
            "nothing was removed; give the cache itself with --dir or CTRAIN_IMAGE_CACHE (the jobs' "
            f"CTRAIN_IMAGE_CACHE; unset, ctrain-images-{os.getuid()} in $APPTAINER_TMPDIR, $TMPDIR or /tmp)"
        )
    if not found:
        return Cleared(left=left)
    removed, kept = [], []
    with _locked(cache):
        for entry in entries(cache):
            if not entry.complete:
                _remove(entry.path)
                removed.append(entry)
                continue
            with _unheld(entry.path / COMPLETE) as free:
                if free:
                    _remove(entry.path)
                    removed.append(entry)
                else:
                    kept.append(entry)
    return Cleared(removed, kept, left)


def describe(entry: Entry, now: float | None = None) -> str:
    """One line of ``ctrain cache list``."""
    state = "in use" if entry.in_use else ("ready" if entry.complete else "half-unpacked")
    ago = "never" if entry.used is None else f"{(now or time.time()) - entry.used:.0f} s ago"
    return f"{entry.key}  {entry.size_kib / 1048576:7.2f} GiB  {state:13}  used {ago:>12}  {entry.image or '-'}"


def check_dir(cache: Path) -> Path:
    """The cache directory, refused when it is a link or not a directory (nothing outside it is touched)."""
    if cache.is_symlink():
        raise CtrainError(f"the image cache {cache} is a symbolic link; give the directory itself")
    if cache.exists() and not cache.is_dir():
        raise CtrainError(f"the image cache {cache} is not a directory")
    return cache
