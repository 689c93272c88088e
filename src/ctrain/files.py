"""Writing small files so that readers see the old content or the new, never a torn one; and
finding out, before a long job, whether a directory takes files at all."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ctrain.errors import CtrainError


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it into place and fsync
    the directory: a job killed mid-write (time limit, preemption, crash) leaves no half file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("w") as handle:
            handle.write(text)
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
