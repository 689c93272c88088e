"""Writing files: small ones so that readers see the old content or the new, never a torn one; and
finding out, before a long job, whether the places a command will write to take files at all."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import pwd
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError, CtrainError


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it into place and fsync
    the directory: a job killed mid-write (time limit, preemption, crash) leaves no half file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    descriptor = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write_json(path: Path, data: Any, indent: int = 1) -> None:
    """:func:`atomic_write_text` of ``data`` as JSON with a trailing newline."""
    atomic_write_text(path, json.dumps(data, indent=indent) + "\n")


def writable_dir_problem(directory: Path) -> str | None:
    """Why files cannot be created in ``directory`` (missing, not a directory, read-only, no
    permission, full), or None when they can. Found by creating and removing an empty file: the only
    test that root, read-only mounts, ACLs and quotas all answer truthfully."""
    if not directory.exists():
        return f"{directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".ctrain-probe-", dir=directory)
    except OSError as exc:
        return f"{directory} is not writable ({exc.strerror})"
    os.close(descriptor)
    os.unlink(probe)
    return None


def creatable_dir_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be made, or once made cannot take files; None when it can. Checks
    the nearest part of it that exists, so nothing is created to find out."""
    existing = next(d for d in (directory, *directory.parents) if d.exists() or d == d.parent)
    if existing != directory and not existing.is_dir():
        return f"{existing} is not a directory"
    return writable_dir_problem(existing)


def make_dirs(directory: Path, fix: str) -> list[Path]:
    """Create ``directory`` and its missing parents; returns those it created, deepest first, so a
    command that fails later can take them away again (:func:`remove_dirs`). ``fix`` completes the
    error when they cannot be created."""
    missing = []
    here = directory
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_dirs(missing)
        raise CtrainError(f"cannot create {directory} ({exc.strerror}): {fix}") from exc
    return missing


def remove_dirs(directories: list[Path]) -> None:
    """Remove the (empty) directories :func:`make_dirs` created; what is not empty stays."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


# Linux's limit on one file name (NAME_MAX) and on a whole path (PATH_MAX, with its NUL).
NAME_MAX = 255
PATH_MAX = 4095


def shorten(text: str, limit: int = 60) -> str:
    """``text`` cut to about ``limit`` characters for a message (a 300-character name once is enough)."""
    return text if len(text) <= limit else f"{text[: limit - 15]}...{text[-12:]}"


def control_problem(value: str) -> str | None:
    """Why ``value`` cannot go into a job script or a name as written (a control character), else None."""
    for char in value:
        if ord(char) < 32 or ord(char) == 127:
            return f"contains a control character ({char!r})"
    return None


def name_problem(value: str) -> str | None:
    """Why ``value`` cannot be one file or directory name (a run name under outputs/), else None."""
    if not value.strip():
        return "is empty"
    if "\0" in value:
        return "contains a NUL character"
    if "/" in value:
        return "contains '/' (it names one directory, not a path)"
    if value in (".", ".."):
        return "names the directory it would be made in (or its parent)"
    if value.startswith("-"):
        return "starts with '-' (commands would read it as an option)"
    if control_problem(value):
        return "contains a control character"
    size = len(value.encode("utf-8", "surrogateescape"))
    if size > NAME_MAX:
        return f"is {size} bytes long; a file name holds at most {NAME_MAX}"
    return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _can_write(path: Path) -> bool:
    mode = os.W_OK | (os.X_OK if path.is_dir() else 0)
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _why_not(path: Path, top: Path | None = None) -> tuple[str, str]:
    """(what is wrong with writing ``path``, how to fix it), for a path that exists and cannot be written;
    the fix takes in all of ``top`` when given."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only file system", "choose a directory on a writable file system"
        info = path.stat()
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror})", "check the path"
    me = _user(os.geteuid())
    if info.st_uid != os.geteuid():
        owner = _user(info.st_uid)
        return (
            f"{path} belongs to {owner} and {me} cannot write to it",
            f"run `sudo chown -R {me} {top or path}` (left by a run as {owner})",
        )
    return f"{path} is not writable (mode {stat.filemode(info.st_mode)})", f"run `chmod -R u+w {top or path}`"


def _name_problem(path: Path) -> tuple[str, str] | None:
    """A path no file system takes: NUL, a name longer than NAME_MAX, a path longer than PATH_MAX."""
    if "\0" in str(path):
        return f"{str(path)!r} contains a NUL character", "remove it"
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return (
                f"the name {part[:32]}... is {len(os.fsencode(part))} bytes long; a file name holds at most {NAME_MAX}",
                "shorten it",
            )
    if len(os.fsencode(str(path))) > PATH_MAX:
        return f"{str(path)[:48]}... is longer than a path can be ({PATH_MAX} bytes)", "choose a shorter path"
    return None


def directory_problem(path: Path) -> tuple[str, str] | None:
    """Why a directory cannot be created at ``path`` (or, when it exists, written into), with the fix;
    None when it can. Creates nothing (at most an empty probe file, removed at once), so a refused
    command leaves nothing behind."""
    path = Path(os.path.abspath(path))
    problem = _name_problem(path)
    if problem is not None:
        return problem
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == path else f", so {path} cannot be created"
        return f"{existing} is a file, not a directory{where}", "move the file away"
    if not _can_write(existing):
        return _why_not(existing)
    problem = writable_dir_problem(existing)  # what access() cannot know: quotas, root-squashed NFS
    return (problem, "free some space or choose another directory") if problem else None


def check_directory(path: Path, what: str, other: str = "choose another directory") -> None:
    """A ConfigError unless a directory can be created at ``path`` or written into, before the work starts."""
    problem = directory_problem(path)
    if problem is not None:
        raise ConfigError(f"{what} {path} cannot be written: {problem[0]}: {problem[1]}, or {other}")


def check_file(path: Path, what: str, other: str = "choose another file") -> None:
    """A ConfigError unless a file can be written at ``path``, in a directory that exists."""
    path = Path(os.path.abspath(path))
    problem = _name_problem(path)
    if problem is None and path.is_dir():
        problem = (f"{path} is a directory", "name a file")
    if problem is None and os.path.lexists(path) and not _can_write(path):
        problem = _why_not(path)
    if problem is None and not path.parent.is_dir():
        problem = directory_problem(path.parent) or (f"the directory {path.parent} does not exist", "create it")
    if problem is None:
        problem = directory_problem(path.parent)
    if problem is not None:
        raise ConfigError(f"{what} {path} cannot be written: {problem[0]}: {problem[1]}, or {other}")


# Directories and files check_tree looks at, at most: an output directory holds a few dozen.
MAX_TREE_ENTRIES = 10_000


def check_tree(directory: Path, what: str, other: str, skip: Iterable[Path] = ()) -> None:
    """:func:`check_directory`, and every directory inside and every file at the top can be written:
    a run as another user (root, in a container) leaves its files behind, owned by that user."""
    check_directory(directory, what, other)
    if not directory.is_dir():
        return
    skipped = {Path(os.path.abspath(p)) for p in skip}
    found: list[Path] = [p for p in directory.iterdir() if p.is_file() and not p.is_symlink()]
    for root, dirs, _ in os.walk(directory):
        dirs[:] = [d for d in dirs if Path(os.path.abspath(os.path.join(root, d))) not in skipped]
        found.append(Path(root))
        if len(found) > MAX_TREE_ENTRIES:  # a directory named by mistake (/, a home): do not search it all
            break
    for path in found:
        # Gone since it was listed: another rank's probe or atomic write's temporary, not a problem.
        if not _can_write(path) and os.path.lexists(path):
            problem, fix = _why_not(path, directory)
            raise ConfigError(f"{what} {directory} cannot be written: {problem}: {fix}, or {other}")


# --- reading files a user or another process may have put anywhere --------------------------------

#: How deep a JSON file ctrain reads may nest (its own records nest 3 levels, a model's config 4).
MAX_JSON_DEPTH = 64


class NotRegularFile(OSError):
    """What :func:`read_regular` or :func:`open_lock` found is a directory, device, pipe, socket or (for a lock)
    a link (``mode``: its st_mode)."""

    def __init__(self, path: Path, mode: int) -> None:
        super().__init__(f"{path} is not a regular file")
        self.mode = mode


def read_regular(path: Path, limit: int, offset: int = 0) -> bytes:
    """At most LIMIT bytes of PATH from OFFSET (negative: from that many bytes before its end).

    Opened without blocking and checked on the open descriptor (:class:`NotRegularFile` otherwise),
    so a FIFO cannot block the reader, a device cannot make it read forever, and a path swapped
    meanwhile is checked as read. The one place ctrain opens a file someone else may have put there."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(path, info.st_mode)
        if offset < 0:
            limit = min(limit, -offset)
        os.lseek(fd, max(0, info.st_size + offset) if offset < 0 else offset, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _special_mode(path: Path) -> int | None:
    """``path``'s st_mode when it is there and no regular file (a link not followed); else None."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else mode


def open_lock(path: Path, mode: int = 0o600) -> int:
    """A descriptor of the lock file PATH (made with MODE if missing), for the caller to flock and close.

    A lock file sits where others can put things: never opened through a link, a FIFO never waited on
    (opening one for writing waits for a reader that never comes), a device never opened. Each is a
    :class:`NotRegularFile`, checked before the open and on the open descriptor (a path swapped
    meanwhile); any other failure to open it is the OSError."""
    special = _special_mode(path)
    if special is not None:
        raise NotRegularFile(path, special)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError:
        special = _special_mode(path)
        if special is not None:
            raise NotRegularFile(path, special) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegularFile(path, info.st_mode)
    return fd


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """PATH's bytes, at most LIMIT of them; refused with one ConfigError naming WHAT when it is not
    a regular file (a FIFO would block the reader, a device would never end) or holds more.

    Opened without blocking and checked on the open descriptor, so a path swapped meanwhile is
    checked as read, and read with the bound, so a file that grows is refused too."""
    try:
        data = read_regular(path, limit + 1)
    except NotRegularFile as exc:
        if stat.S_ISDIR(exc.mode):
            raise ConfigError(f"{what} {path} is a directory, not a file") from None
        raise ConfigError(f"{what} {path} is not a regular file (a device, pipe or socket): name a file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {(exc.strerror or str(exc)).lower()}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path} is larger than {_amount(limit)}, more than such a file can be: is it the "
                          "right file?")  # fmt: skip
    return data


def read_text_bounded(path: Path, limit: int, what: str) -> str:
    """:func:`read_bounded` as UTF-8 text (a BOM dropped); other bytes are refused with their line."""
    # The BOM dropped by hand: the utf-8-sig codec is imported on first use, which a process that has
    # dropped its privileges (testbed status as another user) may no longer be able to do.
    raw = read_bounded(path, limit, what).removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{what} {path} line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8 text") from None


def json_depth_problem(value: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why VALUE (parsed JSON) nests too deep for ctrain to walk, or None; iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return f"it nests deeper than {limit} levels"
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return None


def load_json_bounded(path: Path, limit: int, what: str, depth: int = MAX_JSON_DEPTH) -> Any:
    """PATH's JSON through :func:`read_text_bounded`; a file that is not JSON, or nests deeper than
    DEPTH, is one ConfigError naming WHAT (never a RecursionError)."""
    text = read_text_bounded(path, limit, what)
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{what} {path}: it nests deeper than {depth} levels") from None
    except ValueError as exc:
        raise ConfigError(f"{what} {path} is not valid JSON ({exc})") from None
    problem = json_depth_problem(value, depth)
    if problem:
        raise ConfigError(f"{what} {path}: {problem}")
    return value


def _amount(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB" if n >= 2**10 else f"{n} bytes"
