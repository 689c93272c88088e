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
from dataclasses import dataclass
from pathlib import Path

from ctrain.errors import CtrainError

COMPLETE = "complete"
USED = "used"
LOCK = "lock"


def default_dir(env: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """Where the sbatch library puts the cache when CTRAIN_IMAGE_CACHE is not set (its default)."""
    if env.get("CTRAIN_IMAGE_CACHE"):
        return Path(env["CTRAIN_IMAGE_CACHE"])
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
    try:
        with path.open("rb") as handle:
            return handle.read(limit).decode("utf-8", "replace").strip()
    except OSError:
        return ""


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
        if path.is_symlink() or not path.is_dir():
            continue
        complete = path / COMPLETE
        size = _read(path / "size-kib")
        try:
            used: float | None = (path / USED).stat().st_mtime
        except OSError:
            used = None
        found.append(Entry(path, _read(path / "image"), int(size) if size.isdigit() else 0, used,
                           complete.is_file(), complete.is_file() and _held(complete)))  # fmt: skip
    return sorted(found, key=lambda entry: entry.used or 0.0)


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """The cache's lock, as a job takes it to unpack or evict: held, nothing else changes it."""
    fd = os.open(cache / LOCK, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
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


def clear(cache: Path) -> tuple[list[Entry], list[Entry]]:
    """Remove every entry no running task holds (and half-unpacked ones); (removed, kept in use)."""
    if not cache.is_dir():
        return [], []
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
    return removed, kept


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
