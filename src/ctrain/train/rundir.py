"""What a run directory says about the run in it: the settings that define it.

Every start writes the recipe it ran to ``OUTPUT_DIR/recipe.yaml``. A later start into the same
directory with settings that define another run (``max_steps``, the data, the model; everything
but :data:`~ctrain.train.recipe.RUN_INDEPENDENT`) would otherwise resume from that run's
checkpoints, or report "already finished" for work it never did (a 30-step trial, then the real
run): it is refused with what differs and what to do, unless ``training.resume`` says
``continue``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError
from ctrain.settings import load_yaml
from ctrain.train.artifacts import EVAL_FILE, RECIPE_COPY
from ctrain.train.recipe import RUN_INDEPENDENT, Recipe

log = logging.getLogger("ctrain.train")


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys to values, without the run-independent ones."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if name in RUN_INDEPENDENT:
            continue
        flat.update(_flat(value, name) if isinstance(value, dict) and value else {name: value})
    return flat


def differences(output_dir: Path, recipe: Recipe) -> list[str]:
    """``KEY: THERE -> HERE`` for each setting that defines the run and differs from the run recorded
    in ``output_dir``; empty when there is none (no record, or the same run)."""
    copy = output_dir / RECIPE_COPY
    if not copy.is_file():
        return []
    try:
        before = load_yaml(copy)  # bounded like any settings file
    except ConfigError as exc:
        log.warning("%s is not a readable recipe (%s): the settings of the run there are not compared", copy, exc)
        return []
    there, here = _flat(before), _flat(recipe.record())
    return [
        f"{key}: {there.get(key, '(unset)')} -> {here.get(key, '(unset)')}"
        for key in sorted(set(there) | set(here))
        if there.get(key) != here.get(key)
    ]


def check(output_dir: Path, recipe: Recipe) -> list[str]:
    """Refuse a start whose settings define another run than the one in ``output_dir`` (module
    docstring); returns the differences a ``training.resume: continue`` start goes on with."""
    changed = differences(output_dir, recipe)
    if not changed or recipe.training.resume != "auto":
        return changed
    shown = "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
    raise ConfigError(
        f"training.output_dir {output_dir} holds a run with other settings ({shown}): train into another "
        f"directory (training.output_dir=...), or continue that run from its newest checkpoint with these "
        "settings (training.resume=continue)"
    )


#: Entries a listing of a foreign output directory shows in an error before "and N more".
_SHOWN = 5


def check_owned(output_dir: Path, prepared_dir: Path) -> None:
    """Refuse an output directory that holds files no ctrain run wrote.

    A start removes unfinished ``checkpoint-N`` and ``final`` directories, resumes from complete
    ones and writes its own files over any of the same name; in the directory of another program
    (a Trainer's output, a project) that would destroy its checkpoints. Every start writes
    ``recipe.yaml`` before it trains, so a directory without it holds nothing of ctrain's but what
    comes before: the prepared data, hidden staging directories, and ``ctrain eval``'s result (a
    base model evaluated before its fine-tuning)."""
    if not output_dir.is_dir() or (output_dir / RECIPE_COPY).exists():
        return
    prepared = os.path.abspath(prepared_dir)
    ours = {prepared, os.path.abspath(output_dir / EVAL_FILE)}
    foreign = sorted(p.name for p in output_dir.iterdir()
                     if os.path.abspath(p) not in ours and not p.name.startswith("."))  # fmt: skip
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else "")
        raise ConfigError(
            f"training.output_dir {output_dir} holds files no ctrain run wrote ({shown}; no {RECIPE_COPY}), and "
            "training would resume from, remove or overwrite them: set training.output_dir to a new or empty directory"
        )

