"""Checkpoints that are whole and intact, or not trusted.

The Trainer writes ``checkpoint-STEP/`` file by file; a job killed in the middle leaves a directory
that looks like a checkpoint and is not one. ctrain marks a checkpoint complete only after every
rank has finished writing it: rank 0 then writes ``ctrain-complete.json`` (to a temporary name,
then renamed, so the marker itself is never half there). Resuming takes the newest checkpoint
with a marker; torn ones are reported and removed (training would otherwise write into them).

A marker also records every file's size and checksum (``manifest``), because files can be
damaged after they were complete: a disk or filesystem fault, a copy cut short, a stray write.
Before a checkpoint is trusted, :func:`verify` compares sizes and checksums and opens each file's
container (safetensors header, torch's zip archive, JSON) as the loaders would. A damaged
checkpoint is moved aside (:func:`quarantine`), never deleted, and the next older one is tried.

The checksum is CRC-32 in 8 MiB chunks, one per GiB of a larger file: 1.8 GB/s on one core
where measured, 1.5 times sha256 and almost 4 times blake2b, about as fast as reading the file
from disk (docs/reliability.md). It detects truncation and random damage; it is not meant
against deliberate tampering. The pieces are shared out among the ranks by size and hashed in
threads, so each rank reads only its part, and every rank gets the same verdict (:func:`seal`,
:func:`verify`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import sys
import time
import zipfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError
from ctrain.files import atomic_write_json, control_problem, load_json_bounded
from ctrain.train.artifacts import COMPLETE_MARKER

log = logging.getLogger("ctrain.train")

#: A marker lists each file of a checkpoint with its size and checksums (about 100 bytes a file).
MAX_MARKER_BYTES = 16 * 2**20

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
DIGEST = "crc32"
CHUNK = 8 << 20
# Files larger than this get one checksum per segment, so that the ranks and threads share the
# reading of one big file (a DDP run's optimizer.pt, a large unsharded model) instead of one
# thread reading it all.
SEGMENT = 1 << 30
# Files are hashed in threads (zlib and hashlib release the GIL): reading in parallel is faster
# on network filesystems, and one rank then does not take long on a checkpoint of few ranks.
THREADS = min(4, os.cpu_count() or 1)
# A manifest entry: file path relative to the checkpoint -> [size in bytes, checksum], the
# checksum a list of one per SEGMENT bytes for larger files.
Manifest = dict[str, list[Any]]
Piece = tuple[str, int]  # a file and one of its segments: the unit of work shared out


# --- one file -------------------------------------------------------------------------------------


def file_digest(path: Path, algorithm: str = DIGEST, segment: int | None = None) -> str:
    """The checksum of a file (or of its ``segment``-th SEGMENT bytes): ``crc32`` or any :mod:`hashlib` algorithm."""
    import hashlib

    left = -1 if segment is None else SEGMENT
    crc, digest = 0, (None if algorithm == "crc32" else hashlib.new(algorithm))
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        if segment:
            handle.seek(segment * SEGMENT)
        while left and (size := handle.readinto(view[: CHUNK if left < 0 else min(CHUNK, left)])):
            left = left - size if left > 0 else left
            if digest is None:
                crc = zlib.crc32(view[:size], crc)
            else:
                digest.update(view[:size])
    return f"{crc:08x}" if digest is None else digest.hexdigest()


def segments(size: int) -> int:
    return max(1, -(-size // SEGMENT))


def pieces(sizes: dict[str, int]) -> dict[Piece, int]:
    """Every file's segments with their lengths (a file of at most SEGMENT bytes is one piece)."""
    return {
        (name, index): min(SEGMENT, size - index * SEGMENT) if size > SEGMENT else size
        for name, size in sizes.items()
        for index in range(segments(size))
    }


def _entry(size: int, digests: list[str]) -> list[Any]:
    return [size, digests[0] if len(digests) == 1 else digests]


def _piece_digest(directory: Path, piece: Piece, size: int, algorithm: str) -> str:
    name, index = piece
    return file_digest(directory / name, algorithm, index if size > SEGMENT else None)


#: The longest safetensors header read: safetensors' own limit (MAX_HEADER_SIZE, 100 MB), so a header
#: it would refuse to load is not read into memory here either.
MAX_SAFETENSORS_HEADER = 100_000_000
#: The largest JSON file of a checkpoint or prepared data set that is parsed: far above the largest
#: real one (a big vocabulary's tokenizer.json is tens of MB; trainer_state.json grows ~150 bytes a
#: logged step), far below what would exhaust memory.
MAX_JSON_MEMBER_BYTES = 256 * 2**20


def container_problem(path: Path) -> str | None:
    """Why the loaders could not open ``path`` (its header or archive directory), or None.

    Cheap: reads headers, not tensors, each within a bound. It is what catches damage in checkpoints
    whose marker has no checksums (written by ctrain before they were recorded).
    """
    try:
        if path.suffix == ".safetensors":
            return _safetensors_problem(path)
        if path.suffix == ".json":
            size = path.stat().st_size  # refused unread: a sparse file of gigabytes costs nothing to make
            if size > MAX_JSON_MEMBER_BYTES:
                return f"a JSON file of {size:,} bytes, more than such a file can be ({MAX_JSON_MEMBER_BYTES:,})"
            load_json_bounded(path, MAX_JSON_MEMBER_BYTES, "JSON file")
            return None
        with path.open("rb") as handle:
            zipped = handle.read(4) == b"PK\x03\x04"  # torch.save's format since PyTorch 1.6
        if zipped:
            with zipfile.ZipFile(path) as archive:
                size = path.stat().st_size
                for info in archive.infolist():
                    if info.header_offset + info.compress_size > size:
                        return f"zip member {info.filename} ends past the end of the file"
    except ConfigError as exc:  # a JSON file too large, too deep, not UTF-8 or not JSON: one line already
        return str(exc)
    except (OSError, ValueError, LookupError, TypeError, AttributeError, RecursionError, zipfile.BadZipFile) as exc:
        # Whatever a damaged header makes the parsing trip over: it would not load either.
        return f"{type(exc).__name__}: {exc}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes: too short for a safetensors header"
        length = int.from_bytes(head, "little")
        if length > MAX_SAFETENSORS_HEADER:
            return f"header of {length:,} bytes, more than safetensors reads ({MAX_SAFETENSORS_HEADER:,})"
        if 8 + length > size:
            return f"header of {length} bytes does not fit in {size} bytes"
        header = json.loads(handle.read(length))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"{size} bytes, the header describes {8 + length + end}"
    return None


@dataclass(frozen=True)
class Damage:
    """What is wrong with one file of a checkpoint."""

    file: str  # relative to the checkpoint
    reason: str  # one word, for the name it is moved aside to: missing, size, checksum, unreadable
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.detail}"


def check_piece(directory: Path, piece: Piece, expected: list[Any] | None, algorithm: str) -> Damage | None:
    """Compare one file's segment with its manifest entry ``[size, checksum]`` (None: containers only).

    The size first (free), the container with the first segment, then the checksum.
    """
    name, index = piece
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return Damage(name, "unreadable", "the marker names a file outside the checkpoint")
    path = directory / name
    try:
        status = path.stat()
    except FileNotFoundError:
        return Damage(name, "missing", "missing")
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        return Damage(name, "unreadable", str(exc))
    if not stat.S_ISREG(status.st_mode):  # a FIFO would block the reader, a device never end
        return Damage(name, "unreadable", "not a regular file")
    size = status.st_size
    if expected is not None and size != expected[0]:
        return Damage(name, "size", f"{size:,} bytes, the marker recorded {expected[0]:,}")
    if index == 0:
        problem = container_problem(path)
        if problem is not None:
            return Damage(name, "unreadable", problem)
    if expected is None:
        return None
    try:
        digest = _piece_digest(directory, piece, size, algorithm)
    except OSError as exc:
        return Damage(name, "unreadable", str(exc))
    recorded = expected[1] if isinstance(expected[1], str) else expected[1][index]
    if digest != recorded:
        end = min(size, (index + 1) * SEGMENT)
        where = "" if isinstance(expected[1], str) else f" of bytes {index * SEGMENT:,}-{end:,}"
        return Damage(name, "checksum", f"{algorithm}{where} {digest}, the marker recorded {recorded}")
    return None


# --- sharing work among ranks ---------------------------------------------------------------------


def _collective() -> Any:
    """``torch.distributed`` when a process group is running, else None (one process: no collectives).

    Without torch imported there is no process group, so checking needs no torch.
    """
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _from_rank0(value: Any, group: Any = None) -> Any:
    dist = _collective()
    if dist is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(value: Any, group: Any = None) -> list[Any]:
    dist = _collective()
    if dist is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def share(weights: dict[Any, int], rank: int, world: int) -> list[Any]:
    """The pieces rank ``rank`` of ``world`` reads: largest first, each to the least loaded rank."""
    loads = [0] * world
    mine = []
    for key in sorted(weights, key=lambda k: (-weights[k], k)):
        target = loads.index(min(loads))
        loads[target] += weights[key] + 1
        if target == rank:
            mine.append(key)
    return mine


def _each(items: list[Any], work: Callable[[Any], Any]) -> list[Any]:
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(min(THREADS, len(items))) as pool:
        return list(pool.map(work, items))


def _assemble(sizes: dict[str, int], digests: dict[Piece, str]) -> Manifest:
    return {name: _entry(size, [digests[(name, i)] for i in range(segments(size))]) for name, size in sizes.items()}


# --- markers --------------------------------------------------------------------------------------


def _listing(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint but its marker (and a marker's temporary file), with its size."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith((COMPLETE_MARKER, f".{COMPLETE_MARKER}"))
    }


def _not_regular(directory: Path) -> list[str]:
    """The entries of a checkpoint that are neither files nor directories (a FIFO, a socket, a device)."""
    return [str(p.relative_to(directory)) for p in sorted(directory.rglob("*")) if not (p.is_file() or p.is_dir())]


def manifest(directory: Path, algorithm: str = DIGEST) -> Manifest:
    """Size and checksum(s) of every file in ``directory``, read in threads by this process alone."""
    sizes = _listing(directory)
    work = list(pieces(sizes))
    digests = _each(work, lambda piece: _piece_digest(directory, piece, sizes[piece[0]], algorithm))
    return _assemble(sizes, dict(zip(work, digests)))


def write_marker(directory: Path, info: dict[str, Any], files: Manifest | None = None) -> None:
    """Mark ``directory`` complete: the marker appears whole (temp file, fsync, rename) or not at all.

    ``files`` is the manifest when the ranks computed it together (:func:`seal`); by default this
    process reads every file.
    """
    files = manifest(directory) if files is None else files
    record = {
        **info,
        "files": len(files),
        "bytes": sum(size for size, _ in files.values()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "digest": DIGEST,
        "manifest": dict(sorted(files.items())),
    }
    atomic_write_json(directory / COMPLETE_MARKER, record)


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint or final model; None when it is missing or unreadable."""
    try:
        data = load_json_bounded(directory / COMPLETE_MARKER, MAX_MARKER_BYTES, "the marker")
    except ConfigError:
        return None
    return data if isinstance(data, dict) else None


def seal(directory: Path, info: dict[str, Any], rank: int = 0, world: int = 1, group: Any = None) -> Damage | None:
    """Check a just-written checkpoint and mark it complete; every rank calls it, after a barrier.

    Rank 0 lists the files; each rank checks the containers of its share and checksums them; rank
    0 writes the marker from all the checksums. A file that cannot be opened leaves the checkpoint
    unmarked (never trusted, removed on the next start); the damage found is returned on every rank.
    ``group`` is the process group of the collectives (a background writer's own; else the default).
    """
    sizes, odd = _from_rank0((_listing(directory), _not_regular(directory)) if rank == 0 else None, group)
    if odd:  # a FIFO or a device where a file should be: never read, never trusted
        return Damage(odd[0], "unreadable", "not a regular file")

    def work(piece: Piece) -> tuple[Piece, Damage | None, str | None]:
        name, index = piece
        problem = container_problem(directory / name) if index == 0 else None
        if problem is not None:
            return piece, Damage(name, "unreadable", problem), None
        try:
            return piece, None, _piece_digest(directory, piece, sizes[name], DIGEST)
        except OSError as exc:  # every rank must reach the gather below, whatever one of them finds
            return piece, Damage(name, "unreadable", str(exc)), None

    results = [r for part in _gather(_each(share(pieces(sizes), rank, world), work), group) for r in part]
    damages = sorted((d for _, d, _ in results if d is not None), key=lambda d: d.file)
    if damages:
        return damages[0]
    if rank == 0:
        write_marker(directory, info, _assemble(sizes, {piece: digest for piece, _, digest in results}))
    return None


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found: the first damaged file (None: intact) and what it read."""

    damage: Damage | None
    files: int
    bytes: int
    seconds: float
    checksummed: bool  # False for markers without a manifest: only the containers were checked

    def summary(self) -> str:
        what = "verified" if self.checksummed else "opened (no checksums in its marker)"
        return f"{self.files} files, {self.bytes / 1e6:,.1f} MB {what} in {self.seconds:.2f} s"


#: The largest file a marker may record: far past any checkpoint file.
MAX_RECORDED_BYTES = 1 << 50
#: The most pieces (files, and segments of files over SEGMENT) one marker may plan, the tighter bound:
#: each piece planned costs about 2.3 KB while it is checked (measured), so a hostile marker's plan
#: stays under about 0.6 GB. It is still more files than a marker of MAX_MARKER_BYTES lists (about 100
#: bytes a file) and 256 TiB of segments, far past any checkpoint or prepared data set.
MAX_PIECES = 1 << 18


def _digest_problem(algorithm: Any) -> str | None:
    """Why ``algorithm`` cannot check a file: not crc32 nor a fixed-length hashlib digest (shake_* take a length)."""
    import hashlib

    if algorithm == "crc32":
        return None
    if isinstance(algorithm, str) and algorithm in hashlib.algorithms_available:
        try:
            hashlib.new(algorithm).hexdigest()
            return None
        except (TypeError, ValueError):  # an XOF wants a length; a FIPS build refuses some
            pass
    return f"the marker names no known checksum of fixed length ({str(algorithm)[:40]!r})"


def _recorded_pieces(entry: Any) -> int | None:
    """How many pieces a manifest entry ``[size, checksum]`` plans, or None when it is no such entry: a
    size, and one checksum string for a file of at most one segment or a list of one per segment."""
    if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int):
        return None
    size, digests = entry
    if not 0 <= size <= MAX_RECORDED_BYTES:
        return None
    if isinstance(digests, str):
        return 1 if size <= SEGMENT else None
    if isinstance(digests, list) and len(digests) == segments(size) and all(isinstance(d, str) for d in digests):
        return len(digests)
    return None


def marker_problem(files: dict[Any, Any], algorithm: Any) -> str | None:
    """Why a marker's manifest cannot be checked as it stands (a damaged or foreign marker), else None:
    the checks would otherwise trip over its values, or plan pieces for sizes no file has."""
    problem = _digest_problem(algorithm)
    if problem is not None:
        return problem
    planned = 0
    for name, entry in files.items():
        # A NUL cannot be in a file name, and other control characters would reach the log as written.
        if entry is not None and (not isinstance(name, str) or control_problem(name)):
            return f"the marker names a file with a control character ({str(name)[:80]!r})"
        count = 1 if entry is None else _recorded_pieces(entry)
        if count is None:
            return f"the marker's entry for {str(name)[:80]!r} is not [size, checksum]"
        planned += count
        if planned > MAX_PIECES:
            return f"the marker lists more than {MAX_PIECES:,} files and segments, more than ctrain writes"
    return None


def verify(directory: Path, rank: int = 0, world: int = 1) -> Verdict:
    """Check a complete checkpoint (or final model) against its marker; every rank calls it.

    Sizes first, then each file's container, then its checksum. Every rank checks a share of the
    files and all get the same verdict.
    """
    started = time.perf_counter()
    if rank == 0:
        marker = read_marker(directory) or {}
        files = marker.get("manifest")
        algorithm = marker.get("digest", DIGEST)
        if not isinstance(files, dict):
            files = {name: None for name in _listing(directory)} if directory.is_dir() else {}
        plan = (files, algorithm, marker_problem(files, algorithm))
    else:
        plan = None
    files, algorithm, problem = _from_rank0(plan)
    if problem is not None:
        return Verdict(Damage(COMPLETE_MARKER, "unreadable", problem), 0, 0, time.perf_counter() - started, False)
    return check_files(directory, files, algorithm, rank, world, started)


def check_files(directory: Path, files: dict[str, Any], algorithm: str, rank: int = 0, world: int = 1,
                started: float | None = None) -> Verdict:  # fmt: skip
    """Check the files of ``directory`` against a manifest ``{name: [size, checksum] or None}`` whose
    values :func:`marker_problem` accepted; every rank of ``world`` calls it and checks a share."""
    started = time.perf_counter() if started is None else started
    sizes = {name: (entry[0] if entry else 0) for name, entry in files.items()}
    # Sizes first, read once by rank 0 for all: a file whose size is not the one recorded is damaged
    # whatever its checksums, so it is planned as one piece (check_piece then reports the size, cheaply)
    # instead of one per segment of a size no file on disk has.
    if world > 1:
        wrong = _from_rank0(_wrong_sizes(directory, files) if rank == 0 else None)
    else:  # one process checking alone (prepared data on rank 0 while the others wait): no collective
        wrong = _wrong_sizes(directory, files)
    planned = {name: 0 if name in wrong else size for name, size in sizes.items()}
    work = share(pieces(planned), rank, world)
    mine = _each(work, lambda piece: check_piece(directory, piece, files[piece[0]], algorithm))
    found = _gather(mine) if world > 1 else [mine]  # one process checking alone: no collective
    damages = sorted((d for part in found for d in part if d is not None), key=lambda d: d.file)
    checksummed = all(entry is not None for entry in files.values())
    total = sum(sizes.values()) if checksummed else sum(_listing(directory).values())
    return Verdict(damages[0] if damages else None, len(files), total, time.perf_counter() - started, checksummed)


def _wrong_sizes(directory: Path, files: dict[str, Any]) -> set[str]:
    """The files of a manifest whose size on disk is not the recorded one (missing, not a regular file,
    outside the directory: any the check reports without reading)."""
    wrong = set()
    for name, entry in files.items():
        if entry is None:
            continue
        try:
            status = None if Path(name).is_absolute() or ".." in Path(name).parts else (directory / name).stat()
        except (OSError, ValueError):
            status = None
        if status is None or not stat.S_ISREG(status.st_mode) or status.st_size != entry[0]:
            wrong.add(name)
    return wrong


def quarantine(directory: Path, reason: str) -> Path:
    """Move a damaged checkpoint aside, as ``NAME.damaged-REASON`` (kept for inspection, never deleted)."""
    target = directory.with_name(f"{directory.name}.damaged-{reason}")
    number = 1
    while target.exists():
        number += 1
        target = directory.with_name(f"{directory.name}.damaged-{reason}-{number}")
    directory.rename(target)
    return target


# --- an output directory's checkpoints ------------------------------------------------------------


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
    """One line per torn checkpoint, for the log: why it is not resumed from."""
    return [
        f"ignoring {directory}: no {COMPLETE_MARKER}, so it was not finished (the run stopped while writing "
        "it); removing it"
        for directory in found.torn
    ]


def choose(found: Scan, rank: int = 0, world: int = 1) -> Path | None:
    """The newest complete checkpoint that verifies; every rank calls it and gets the same answer.

    The candidates are rank 0's (a shared filesystem may show another node a directory listing a
    moment old). Damaged ones are moved aside by rank 0, each with one log line; the other ranks
    wait for that before they go on, so no rank sees a directory half renamed.
    """
    candidates: list[Path] = _from_rank0(list(found.complete) if rank == 0 else None)
    for index, directory in enumerate(candidates):
        verdict = verify(directory, rank, world)
        if verdict.damage is None:
            if rank == 0:
                log.info(
                    "resuming from %s (newest checkpoint with %s; %s)", directory, COMPLETE_MARKER, verdict.summary()
                )
            return directory
        if rank == 0:
            moved = quarantine(directory, verdict.damage.reason)
            older = candidates[index + 1] if index + 1 < len(candidates) else None
            log.warning(
                "%s is damaged (%s): moved it to %s and falling back to %s", directory, verdict.damage, moved.name,
                older.name if older else "step 0 (no older complete checkpoint)",
            )  # fmt: skip
        _barrier()
    return None


def _barrier() -> None:
    dist = _collective()
    if dist is not None:
        dist.barrier()


def remove(directories: list[Path]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def rotate(output_dir: Path, keep: int | None, newest: Path) -> list[Path]:
    """After ``newest`` is sealed, delete the complete checkpoints older than it beyond ``keep`` in all.

    Only checkpoints older than the one just verified are candidates, so the newest good one is
    never deleted before a newer one is verified; torn ones are never counted as kept, and
    damaged ones moved aside are not checkpoints any more.
    """
    if keep is None or read_marker(newest) is None:
        return []
    step = step_of(newest)
    older = [p for p in scan(output_dir).complete if step is not None and (step_of(p) or 0) < step]
    old = older[keep - 1 :]
    remove(old)
    return old


#: Where a save failed and less than this is free, the save filled the file system: a failed write
#: leaves at most its last buffer's worth free, while an error of another kind leaves the space as it was.
FULL_BELOW = 4 << 20
_FULL_WORDS = ("no space left on device", "disk quota exceeded")


def size_of(directory: Path) -> int:
    """The bytes of the files of the checkpoint in DIRECTORY, in every subdirectory (FSDP writes one)."""
    return sum(_listing(directory).values())


def free_bytes(directory: Path) -> int | None:
    """The bytes this process may still write under DIRECTORY (root may use the reserved blocks); None if unknown."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail) * stats.f_frsize


def full_disk(directory: Path) -> str:
    """The opening of a full-disk error: which file system, and what is left on it."""
    free = free_bytes(directory)
    return f"the file system of {directory} is full ({'?' if free is None else f'{free / 2**20:.1f} MiB'} free)"


def out_of_space(exc: BaseException, directory: Path) -> bool:
    """Whether EXC, raised while a run wrote into DIRECTORY, comes from its file system being full.

    An ENOSPC or EDQUOT anywhere in its chain says so, and so do their words in a message; torch's
    zip writer reports the same failed write as ``unexpected pos N vs M``, so with no such sign the
    free space decides."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(current).lower() for words in _FULL_WORDS):
            return True
        current = current.__cause__ or current.__context__
    free = free_bytes(directory)
    return free is not None and free < FULL_BELOW


def discard_unfinished(output_dir: Path, final: Path) -> list[Path]:
    """Remove the checkpoints and the final model a full disk left unmarked (never resumable: the
    next start would remove them too), so the space they took is free again; returns them."""
    gone = [*scan(output_dir).torn, *([final] if final.is_dir() and read_marker(final) is None else [])]
    remove(gone)
    return gone

