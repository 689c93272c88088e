#!/usr/bin/env python3
"""What checkpoint verification costs on this machine: the figures in docs/reliability.md.

    python scripts/verify-cost.py [CHECKPOINT_DIR ...] [--gib 1] [--scratch DIR]

For each complete checkpoint directory given (e.g. one of the demo's), and for a generated
safetensors file of --gib GiB (in --scratch, deleted afterwards), it times checksumming every
file as sealing does and :func:`ctrain.train.checkpoint.verify` (sizes, containers, checksums
against the marker) as resuming does, with the
files in the page cache ("warm") and evicted from it first ("cold": posix_fadvise DONTNEED on
each file, so only these files leave the cache). Given directories are only read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctrain.train import checkpoint


def evict(directory: Path) -> None:
    """Drop ``directory``'s files from the page cache, so the next read comes from the disk."""
    for path in directory.rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def best(work: Callable[[], Any], repeat: int, before: Callable[[], None] = lambda: None) -> tuple[float, Any]:
    """The shortest of ``repeat`` timings (others' load on a shared machine only adds time)."""
    times, result = [], None
    for _ in range(repeat):
        before()
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
    return min(times), result


def measure(directory: Path, repeat: int) -> None:
    files = checkpoint.manifest(directory)  # also warms the cache
    size = sum(entry[0] for entry in files.values()) / 1e6
    for state, before in (("warm", lambda: None), ("cold", lambda: evict(directory))):
        hashed, _ = best(lambda: checkpoint.manifest(directory), repeat, before)
        verified, verdict = best(lambda: checkpoint.verify(directory), repeat, before)
        assert verdict.damage is None and verdict.checksummed, verdict
        print(
            f"{directory}: {len(files)} files, {size:,.1f} MB, {state}: checksums {hashed:.3f} s "
            f"({size / hashed:,.0f} MB/s), verify {verified:.3f} s ({size / verified:,.0f} MB/s)"
        )


def read(path: Path) -> None:
    buffer = bytearray(checkpoint.CHUNK)
    with path.open("rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass


def algorithms(path: Path, repeat: int) -> None:
    """One file, one thread, from the page cache: reading alone, CRC-32 and hashlib's usual choices."""
    size = path.stat().st_size / 1e6
    work: dict[str, Callable[[], Any]] = {"read only": lambda: read(path)}
    for name in ("crc32", "sha256", "blake2b"):
        work[name] = lambda name=name: checkpoint.file_digest(path, name)
    fastest = {name: float("inf") for name in work}
    for _ in range(repeat):  # interleaved, so a burst of others' load does not fall on one of them only
        for name, run in work.items():
            fastest[name] = min(fastest[name], best(run, 1)[0])
    for name, seconds in fastest.items():
        print(f"  {name}: {size / seconds:,.0f} MB/s, one thread, warm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*", type=Path)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the generated file (0: none)")
    parser.add_argument("--scratch", type=Path, default=None, help="where to write it (default: the temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="report the best of this many timings")
    args = parser.parse_args()
    print(f"CRC-32 in {checkpoint.CHUNK >> 20} MiB chunks, up to {checkpoint.THREADS} threads; load {os.getloadavg()}")
    for directory in args.checkpoints:
        measure(directory, args.repeat)
    if args.gib > 0:
        import numpy as np
        from safetensors.numpy import save_file

        scratch = Path(tempfile.mkdtemp(prefix="verify-cost-", dir=args.scratch))
        try:
            rows = int(args.gib * 2**30 / 4 / 1024)
            weights = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
            save_file({"w": weights}, str(scratch / "model.safetensors"))
            del weights
            checkpoint.write_marker(scratch, {"step": 0})
            measure(scratch, args.repeat)
            algorithms(scratch / "model.safetensors", args.repeat)
        finally:
            shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
