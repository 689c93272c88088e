"""The README's first command, scripts/quickstart.sh, as a user runs it (on the shared testbed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ctrain.testbed import Testbed

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_trains_the_demo_on_two_nodes_and_passes_the_bar(testbed: Testbed) -> None:
    result = subprocess.run(
        [REPO / "scripts" / "quickstart.sh"], capture_output=True, text=True, timeout=2400, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    accuracy = re.findall(r"^accuracy: ([0-9.]+) \((\d+)/(\d+) exact\)", result.stdout, re.MULTILINE)
    assert accuracy, output[-3000:]
    assert float(accuracy[-1][0]) >= 0.9
    assert "node1" in output and "node2" in output, "the job's log shows both nodes"
    assert testbed.is_up(), "the quickstart leaves the testbed running"
