"""Checkpoints that are whole or ignored.

The Trainer writes ``checkpoint-STEP/`` file by file; a job killed in the middle leaves a directory
that looks like a checkpoint and is not one. ctrain marks a checkpoint complete only after every
rank has finished writing it: rank 0 then writes ``ctrain-complete.json`` (to a temporary name,
then renamed, so the marker itself is never half there). Resuming takes the newest checkpoint
with a marker; torn ones are reported and removed (training would otherwise write into them).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrain.files import atomic_write_json
from ctrain.train.recipe import COMPLETE_MARKER

log = logging.getLogger("ctrain.train")

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_marker(directory: Path, info: dict[str, Any]) -> None:
    """Mark ``directory`` complete: the marker appears whole (temp file, fsync, rename) or not at all."""
    files = [p for p in directory.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER]
    record = {
        **info,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_json(directory / COMPLETE_MARKER, record)


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint or final model; None when it is missing or unreadable."""
    try:
        data = json.loads((directory / COMPLETE_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def step_of(directory: Path) -> int | None:
    match = CHECKPOINT.match(directory.name)
    return int(match.group(1)) if match else None


@dataclass
class Scan:
    """Checkpoints found in an output directory, newest first."""

    complete: list[Path] = field(default_factory=list)
    torn: list[Path] = field(default_factory=list)

    @property
    def latest(self) -> Path | None:
        return self.complete[0] if self.complete else None


def scan(output_dir: Path) -> Scan:
    """Sort the ``checkpoint-STEP`` directories of ``output_dir`` into complete and torn."""
    result = Scan()
    if not output_dir.is_dir():
        return result
    found = sorted(
        (p for p in output_dir.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of, reverse=True
    )
    for directory in found:
        marker = read_marker(directory)
        if marker is not None and marker.get("step") == step_of(directory):
            result.complete.append(directory)
        else:
            result.torn.append(directory)
    return result


def explain(found: Scan) -> list[str]:
    """One line per checkpoint decision, for the log: which one resumes and why others do not."""
    lines = []
    if found.latest is not None:
        lines.append(f"resuming from {found.latest} (newest checkpoint with {COMPLETE_MARKER})")
    for directory in found.torn:
        lines.append(
            f"ignoring {directory}: no {COMPLETE_MARKER}, so it was not finished (the run stopped while writing "
            "it); removing it"
        )
    return lines


def remove(directories: list[Path]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def rotate(output_dir: Path, keep: int | None) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (torn ones are never counted as kept)."""
    if keep is None:
        return []
    old = scan(output_dir).complete[keep:]
    remove(old)
    return old
