"""Results you can look at: the loss curves of runs or a sweep's tasks (``ctrain results ... --plot``) and a
run's time across its requeues (``ctrain report JOB --plot``), drawn by matplotlib (the laptop-side extra
``ctrain-slurm[plot]``) as a PNG, an SVG, or a self-contained HTML page (the SVG inline, no script).

Every series carries an id (``train-JOB``, ``eval-JOB``, ``run-N-SEGMENT``) that the SVG keeps, and its
colour is fixed by its order (:data:`COLOURS`), so a test reads the drawing back: the points of each
curve from the page, the pixels of each colour from the PNG."""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError, ToolNotFound

SUFFIXES = (".png", ".svg", ".html")
# Matplotlib's tab10, in order: the n-th run's curves are drawn in the n-th colour (a test reads them back).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")  # fmt: skip
# A run's segments (goodput.SEGMENTS), each in its colour.
SEGMENT_COLOURS = {"queue": "#c7c7c7", "start_up": "#ff7f0e", "prepare": "#bcbd22", "training": "#2ca02c",
                   "saves": "#1f77b4", "evals": "#9467bd", "lost": "#d62728", "end": "#7f7f7f"}  # fmt: skip


def check_target(path: Path) -> None:
    """Refuse a file the picture cannot be, before any work: its kind is its suffix."""
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"--plot {path}: name a .png, .svg or .html file (the picture's kind is its suffix)")
    if path.is_dir():
        raise ConfigError(f"--plot {path} is a directory: give a file name, e.g. {path}/losses.html")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ToolNotFound("--plot draws with matplotlib, which is not installed: pip install 'ctrain-slurm[plot]' "
                           "(or pip install matplotlib)") from None  # fmt: skip
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: the legend is searchable
    matplotlib.rcParams["svg.hashsalt"] = "ctrain"  # the same picture for the same data
    import matplotlib.pyplot as plt

    return plt


def series(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of every record that has both as finite numbers; the last value of a step wins (a
    resumed run logs the steps after its checkpoint again)."""
    from ctrain.jobs.results import _number

    points: dict[float, float] = {}
    for record in records:
        step, value = _number(record.get("step")), _number(record.get(key))
        if step is not None and value is not None:
            points[step] = value
    return sorted(points.items())


def loss_curves(rows: list[dict[str, Any]], path: Path, title: str) -> int:
    """Every row's training loss (solid) and evaluation loss (dashed, where it has one) against steps, a
    colour per row; written to PATH. The number of curves drawn."""
    from ctrain.jobs.results import _records

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    drawn = 0
    for index, row in enumerate(rows):
        records = _records(Path(row["output"])) if row.get("output") else []
        colour = COLOURS[index % len(COLOURS)]
        label = f"{row['job']} {row['ran']}"[:70]
        for key, style, name in (("loss", "-", "train"), ("eval_loss", "--", "eval")):
            points = series(records, key)
            if points:
                (line,) = ax.plot([s for s, _ in points], [v for _, v in points], style, color=colour, linewidth=2,
                                  label=f"{label} ({name})")  # fmt: skip
                line.set_gid(f"{name}-{row['job']}")
                drawn += 1
    if not drawn:
        plt.close(fig)
        raise ConfigError("--plot: no run has a loss to draw yet (their metrics.jsonl have none)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, plt, path, title, _table(rows))
    return drawn


def timeline(result: dict[str, Any], path: Path, title: str) -> None:
    """A run's jobs one after another (``goodput.account``'s rows): a bar per run, its segments in their
    colours from queue to end, labelled with how it ended and why; written to PATH."""
    from ctrain.train.goodput import CAUSES, SEGMENTS

    plt = _pyplot()
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(runs)), dpi=100)
    at, labelled = 0.0, set()
    for index, run in enumerate(runs):
        for name in SEGMENTS:
            seconds = float(run["seconds"].get(name, 0.0))
            if seconds <= 0:
                continue
            bars = ax.barh(index, seconds, left=at, color=SEGMENT_COLOURS[name], height=0.6,
                           label=None if name in labelled else name.replace("_", "-"))  # fmt: skip
            bars.patches[0].set_gid(f"run-{run['restart']}-{name}")
            labelled.add(name)
            at += seconds
    ax.set_yticks(range(len(runs)))
    ax.set_yticklabels([f"run {r['restart']}: {r['outcome'] or 'running'}"
                        + (f" ({CAUSES.get(r['cause'], r['cause'])})" if r.get("cause") not in (None, "none") else "")
                        for r in runs], fontsize="small")  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(ncol=4, fontsize="small", loc="lower right")
    fig.tight_layout()
    _save(fig, plt, path, title, "")


def _table(rows: list[dict[str, Any]]) -> str:
    cells = "".join(f"<tr><td>{'*' if r.get('best') else ''}</td><td>{html.escape(r['job'])}</td>"
                    f"<td>{html.escape(r['ran'])}</td>"
                    f"<td>{html.escape(', '.join(f'{k} {v:.4g}' for k, v in sorted(r['metrics'].items())))}</td></tr>"
                    for r in rows)  # fmt: skip
    return f"<table><tr><th></th><th>job</th><th>ran</th><th>metrics</th></tr>{cells}</table>"


def _save(fig: Any, plt: Any, path: Path, title: str, extra: str) -> None:
    from ctrain.files import atomic_write_bytes

    buffer = io.BytesIO()
    kind = path.suffix.lower()
    fig.savefig(buffer, format="png" if kind == ".png" else "svg", bbox_inches="tight")
    plt.close(fig)
    data = buffer.getvalue()
    if kind == ".html":
        svg = data.decode()
        svg = svg[svg.index("<svg"):]
        data = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head>"
                f"<body><h1>{html.escape(title)}</h1>\n{svg}\n{extra}</body></html>\n").encode()  # fmt: skip
    atomic_write_bytes(path, data)
