"""Small terminal helpers: aligned tables and status lines (stdlib and click only)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ctrain.redact import redact


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces, header in upper case."""
    cells = [[str(h).upper() for h in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def info(message: str) -> None:
    """A progress line on stderr, so stdout stays parseable; credentials masked."""
    print(redact(message), file=sys.stderr, flush=True)


def size(n: float) -> str:
    """Bytes as people read them: 950 KB, 3.0 MB, 12.4 GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


#: Seconds between the progress lines of a long copy or conversion.
PROGRESS_EVERY = 10.0


@contextmanager
def file_progress(
    path: Path, label: str, total: int | None = None, every: float = PROGRESS_EVERY,
    emit: Callable[[str], None] = info,
) -> Iterator[None]:  # fmt: skip
    """While the block runs, say every ``every`` seconds how far ``path`` has grown and how fast:
    ``push: 1.2 GB of 5.9 GB (20%), 110.0 MB/s`` (a multi-GB copy otherwise prints nothing for
    minutes). Silent while the file does not grow."""
    done = threading.Event()

    def watch() -> None:
        last, then = 0, time.monotonic()
        while not done.wait(every):
            try:
                now_size = os.stat(path).st_size
            except OSError:
                continue
            now = time.monotonic()
            if now_size != last:
                rate = (now_size - last) / max(now - then, 1e-9)
                share = f" of {size(total)} ({100 * now_size / total:.0f}%)" if total else ""
                emit(f"{label}: {size(now_size)}{share}, {size(rate)}/s")
            last, then = now_size, now

    thread = threading.Thread(target=watch, name=f"progress {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
