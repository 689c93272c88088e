"""Golden-file comparison for generated text (sbatch scripts, configs, image files).

A golden is compared, never trusted: ``CTRAIN_UPDATE_GOLDEN=1`` (that value exactly) rewrites a
golden that differs and skips the test, so an update run asserts nothing it did not check. Under CI
or strict mode (``CI``, ``CTRAIN_STRICT``) an update is refused, and a missing golden always fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = "CTRAIN_UPDATE_GOLDEN"


def _updating() -> bool:
    """Whether this run may rewrite goldens; any value but ``1`` is a mistake, said as one."""
    value = os.environ.get(UPDATE, "")
    if not value:
        return False
    if value != "1":
        pytest.fail(f"{UPDATE}={value!r}: set it to 1 to rewrite the goldens that differ, or unset it")
    if os.environ.get("CI") or os.environ.get("CTRAIN_STRICT"):
        pytest.fail(f"{UPDATE} is set under CI or CTRAIN_STRICT: goldens are compared there, never rewritten")
    return True


def assert_golden(area: str, name: str, text: str) -> None:
    """``text`` equals tests/golden/AREA/NAME (see the module's docstring for updates)."""
    path = GOLDEN / area / name
    updating = _updating()
    if path.is_file() and text == path.read_text():
        return
    if not updating:
        assert path.is_file(), f"{path} missing: run once with {UPDATE}=1 (not under CI) and review it"
        raise AssertionError(f"{area}/{name} differs from the golden file ({UPDATE}=1 to rewrite it, then review)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    pytest.skip(f"rewrote golden {area}/{name}: review the change and run again without {UPDATE}")


def pyxis_options() -> dict[str, str]:
    """pyxis's srun options (tests/golden/sbatch/pyxis-srun-options.txt): name -> its argument, "-"
    for a flag without one. The testbed checks the file against the pyxis it runs."""
    options = {}
    for line in (GOLDEN / "sbatch" / "pyxis-srun-options.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, argument = line.split(None, 1)
            options[name] = argument.strip()
    return options
