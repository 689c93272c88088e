"""Results you can compare (``ctrain results JOB...``): one row per run, from what the run left in its
output directory (``metrics.jsonl``: the last training loss, the last evaluation, the mean throughput;
``eval.json``) and in its timeline (goodput, GPU- or node-hours, the cost), sorted by one metric with
the best marked. The output directory is the one ``ctrain submit`` recorded (``ctrain.jobs.history``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ctrain import protocol
from ctrain.errors import ConfigError, CtrainError
from ctrain.files import json_depth_problem, read_regular

METRICS_LIMIT = 16 * 2**20  # the end of a run's metrics.jsonl that is read (its last records)
EVAL_LIMIT = 2**20
# Metrics where more is better; any other (losses, perplexity) is best at its least.
HIGHER_IS_BETTER = ("accuracy", "acc", "f1", "bleu", "rouge", "exact", "match", "score")


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def read_metrics(output: Path) -> dict[str, float]:
    """The run's last training loss (``loss``), its last evaluation (``eval_*``), its mean tokens/s and the
    step reached, from OUTPUT's metrics.jsonl; ``eval.json``'s numbers (``eval/KEY``) on top."""
    from ctrain.train.artifacts import EVAL_FILE

    found: dict[str, float] = {}
    rates: list[float] = []
    for record in _records(output):
        if (step := _number(record.get("step"))) is not None:
            found["step"] = step
        if (loss := _number(record.get("loss"))) is not None:
            found["loss"] = loss
        if (rate := _number(record.get("throughput/tokens_per_second"))) is not None:
            rates.append(rate)
        for key, value in record.items():
            if str(key).startswith("eval_") and (number := _number(value)) is not None:
                found[str(key)[:40]] = number
    if rates:
        found["tokens_per_second"] = sum(rates) / len(rates)
    try:
        evaluated = json.loads(read_regular(output / EVAL_FILE, EVAL_LIMIT))
    except (OSError, ValueError):
        evaluated = None
    if isinstance(evaluated, dict) and not json_depth_problem(evaluated, 3):
        for key, value in evaluated.items():
            if (number := _number(value)) is not None:
                found[f"eval/{str(key)[:36]}"] = number
    return found


def _records(output: Path) -> list[dict[str, Any]]:
    """The run's metrics records (its metrics.jsonl's end, bounded; lines that are not ctrain's skipped)."""
    from ctrain.train.artifacts import METRICS_FILE

    try:
        data = read_regular(output / METRICS_FILE, METRICS_LIMIT, -METRICS_LIMIT)
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    found = []
    for raw in lines[1:] if len(data) >= METRICS_LIMIT else lines:
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and not json_depth_problem(record, 3):
            found.append(record)
    return found


def pace(output: Path) -> tuple[int, float] | None:
    """The step the run in OUTPUT reached and its seconds a step, from its last run's training records
    (their steps and times); None where fewer than two say."""
    records = [r for r in _records(output) if _number(r.get("loss")) is not None
               and _number(r.get("step")) is not None and _number(r.get("time")) is not None]  # fmt: skip
    if not records:
        return None
    last = [r for r in records if r.get("run") == records[-1].get("run")]
    steps = float(last[-1]["step"]) - float(last[0]["step"])
    if len(last) < 2 or steps <= 0:
        return None
    return int(last[-1]["step"]), (float(last[-1]["time"]) - float(last[0]["time"])) / steps


def read_account(project: Path, run: str, gpu_hour_price: float | None) -> dict[str, float]:
    """The run's goodput, hours and cost, from its timeline; empty where it has none."""
    from ctrain.train import goodput

    path = project / protocol.STATE_DIR / protocol.timeline_file(run)
    if not path.is_file():
        return {}
    try:
        result, _ = goodput.report(path, run, gpu_hour_price=gpu_hour_price)
    except (OSError, CtrainError, ValueError):
        return {}
    return {key: result[key] for key in ("goodput", "gpu_hours", "node_hours", "cost") if result.get(key) is not None}


def higher_is_better(metric: str) -> bool:
    return any(word in metric.lower() for word in HIGHER_IS_BETTER)


def rank(rows: list[dict[str, Any]], metric: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """ROWS sorted by METRIC (default: the eval loss every row has, else the training loss), best first,
    the best one marked (``best``); rows without it last. The metric sorted by, None if no row has one."""
    if metric is None:
        metric = next((m for m in ("eval_loss", "loss") if any(m in r["metrics"] for r in rows)), None)
    elif not any(metric in r["metrics"] for r in rows):
        known = sorted({k for r in rows for k in r["metrics"]})
        raise ConfigError(f"--sort {metric}: no run has it; these do: {', '.join(known) or 'none (no metrics yet)'}")
    if metric is None:
        return rows, None
    sign = -1 if higher_is_better(metric) else 1
    having = sorted((r for r in rows if metric in r["metrics"]), key=lambda r: sign * r["metrics"][metric])
    for row in rows:
        row["best"] = bool(having) and row is having[0]
    return having + [r for r in rows if metric not in r["metrics"]], metric


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of ``ctrain results``' table: every metric any row has, as a column."""
    shown = [m for m in ("loss", "eval_loss") if any(m in r["metrics"] for r in rows)]
    shown += sorted({k for r in rows for k in r["metrics"]} - {"loss", "eval_loss", "step", "tokens_per_second"})
    header = ["", "job", "ran", "step", *shown, "tok/s", "goodput", "hours", "cost"]
    cells = []
    for r in rows:
        m, a = r["metrics"], r["account"]
        hours = a.get("gpu_hours", a.get("node_hours"))
        cells.append(["*" if r.get("best") else "", r["job"], r["ran"][:60], f"{m['step']:.0f}" if "step" in m else "-",
                      *(f"{m[k]:.4g}" if k in m else "-" for k in shown),
                      f"{m['tokens_per_second']:,.0f}" if "tokens_per_second" in m else "-",
                      f"{100 * a['goodput']:.1f}%" if "goodput" in a else "-",
                      f"{hours}" if hours is not None else "-", f"{a['cost']}" if "cost" in a else "-"])  # fmt: skip
    return header, cells
