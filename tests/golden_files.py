"""Golden-file comparison for generated text (sbatch scripts, configs, image files)."""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"


def assert_golden(area: str, name: str, text: str) -> None:
    """``text`` equals tests/golden/AREA/NAME; CTRAIN_UPDATE_GOLDEN=1 rewrites the file instead."""
    path = GOLDEN / area / name
    if os.environ.get("CTRAIN_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with CTRAIN_UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"{area}/{name} differs from the golden file (CTRAIN_UPDATE_GOLDEN=1 to accept)"


def pyxis_options() -> dict[str, str]:
    """pyxis's srun options (tests/golden/sbatch/pyxis-srun-options.txt): name -> its argument, "-"
    for a flag without one. The testbed checks the file against the pyxis it runs."""
    options = {}
    for line in (GOLDEN / "sbatch" / "pyxis-srun-options.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, argument = line.split(None, 1)
            options[name] = argument.strip()
    return options
