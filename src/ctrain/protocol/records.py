"""The records of the job's files, one line each, with a writer and a parser (ctrain.protocol)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ctrain.protocol.env import RESTART_PATTERN
from ctrain.protocol.files import UNFIT_FILE, rank_file, write_whole

# --- the records: one line each ----------------------------------------------------------------------

MESSAGE_CHARS = 300  # a record's message, as the batch script prints it


def one_line(text: str) -> str:
    """TEXT as one printable line of at most :data:`MESSAGE_CHARS` characters (the batch script prints it)."""
    words = " ".join(text.split())
    clean = "".join(c if c.isprintable() else "?" for c in words)
    return clean if len(clean) <= MESSAGE_CHARS else clean[: MESSAGE_CHARS - 3] + "..."


def word(text: str) -> str:
    """TEXT as one word of a record (a host, a check, a cause): spaces become ``_``; empty, ``-``."""
    return one_line(text).replace(" ", "_") or "-"


_INT = re.compile(r"-?[0-9]{1,18}")


def _int(text: str) -> int | None:
    return int(text) if _INT.fullmatch(text) else None


RETRY, END = "retry", "end"


@dataclass(frozen=True)
class ExitRecord:
    """``exit/rank-R``: why a rank ended. RETRY (``retry`` or ``end``) says whether a requeue can change
    the outcome; ``ctrain_rank_exit`` ends the job on the first record (by time) with a code other
    than 0 and ``end``, naming ``rank-CAUSE``. MESSAGE is only ever printed."""

    code: int
    cause: str
    retry: bool
    host: str
    message: str = ""

    def line(self) -> str:
        words = f"{self.code} {word(self.cause)} {RETRY if self.retry else END} {word(self.host)}"
        return f"{words} {one_line(self.message)}".rstrip() + "\n"

    @classmethod
    def parse(cls, line: str) -> ExitRecord | None:
        words = line.strip().split(" ", 4)
        if len(words) < 4 or _int(words[0]) is None or words[2] not in (RETRY, END):
            return None
        return cls(int(words[0]), words[1], words[2] == RETRY, words[3], words[4] if len(words) > 4 else "")


def write_exit(directory: Path, rank: int, record: ExitRecord) -> Path:
    """RECORD as rank RANK's file in DIRECTORY (CTRAIN_EXITS), written whole."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file(rank)
    write_whole(path, record.line())
    return path


DONE = "done"  # a heartbeat's first word once the rank's run is over


@dataclass(frozen=True)
class HeartbeatLine:
    """``heartbeat/rank-R``: the last step this rank finished (None: its run is over, ``done``), on
    HOST, by process PID. The watchdog goes by the file's time stamp, and stops expecting steps
    from a rank whose line says ``done``."""

    step: int | None
    host: str
    pid: int

    def line(self) -> str:
        return f"{DONE if self.step is None else self.step} {word(self.host)} {self.pid}\n"

    @classmethod
    def parse(cls, line: str) -> HeartbeatLine | None:
        words = line.split()
        if len(words) != 3 or _int(words[2]) is None or (words[0] != DONE and _int(words[0]) is None):
            return None
        return cls(None if words[0] == DONE else int(words[0]), words[1], int(words[2]))


@dataclass(frozen=True)
class UnfitLine:
    """A line of ``unfit``: HOST failed CHECK, MESSAGE says how. Only the job's own node names count
    (``ctrain_unfit_nodes``); a node named is left out of the requeued job."""

    host: str
    check: str
    message: str

    def line(self) -> str:
        return f"{word(self.host)} {word(self.check)} {one_line(self.message)}".rstrip() + "\n"

    @classmethod
    def parse(cls, line: str) -> UnfitLine | None:
        words = line.strip().split(" ", 2)
        if len(words) < 2:
            return None
        return cls(words[0], words[1], words[2] if len(words) > 2 else "")


def append_unfit(directory: Path, record: UnfitLine) -> Path:
    """Append RECORD to the run's unfit file in DIRECTORY (the node checks append to it too)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / UNFIT_FILE
    with open(path, "a") as handle:
        handle.write(record.line())
    return path


@dataclass(frozen=True)
class NodeDone:
    """``node-N.done``, written by each node's task (bash) once its launcher ended: its exit code and
    the node's ``uname -n``."""

    code: int
    host: str

    def line(self) -> str:
        return f"{self.code} {self.host}\n"

    @classmethod
    def parse(cls, line: str) -> NodeDone | None:
        words = line.split()
        if len(words) != 2 or _int(words[0]) is None:
            return None
        return cls(int(words[0]), words[1])


# A run's states (CTRAIN_LIFE in the library; docs/architecture.md, "A run's life"): a run is
# `starting` until its first transition, and the decided states have no way out.
STATES = ("starting", "running", "ending", "terminating", "deciding", "requeued", "left", "finished", "ended")
DECIDED = ("requeued", "left", "finished", "ended")


@dataclass(frozen=True)
class RunState:
    """``state``: run RESTART of the job is in STATE (``ctrain_transition`` is its only writer; a file
    of another run means this one is ``starting``)."""

    restart: int
    state: str

    def line(self) -> str:
        return f"{self.restart} {self.state}\n"

    @classmethod
    def parse(cls, line: str) -> RunState | None:
        words = line.split()
        if len(words) != 2 or not RESTART_PATTERN.fullmatch(words[0]) or words[1] not in STATES:
            return None
        return cls(int(words[0]), words[1])
