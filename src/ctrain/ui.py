"""Small terminal helpers: aligned tables and status lines (stdlib and click only)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

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
