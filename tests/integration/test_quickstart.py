"""The README's first command, scripts/quickstart.sh, as a user runs it (on the shared testbed).

It runs once per session (the ``quickstart`` fixture); the tests that need a trained demo model
read the model it trained.
"""

from __future__ import annotations

import re

import pytest

from tests.plugins.train import Quickstart

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_quickstart_trains_the_demo_on_two_nodes_and_passes_the_bar(quickstart: Quickstart) -> None:
    result = quickstart.result
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    accuracy = re.findall(r"^accuracy: ([0-9.]+) \((\d+)/(\d+) exact\)", result.stdout, re.MULTILINE)
    assert accuracy, output[-3000:]
    assert float(accuracy[-1][0]) >= 0.9
    # The job's own log (`ctrain logs --follow`): its four ranks, two on each node, each naming its host.
    ranks = set(re.findall(r"\[rank (\d+) host (node\d)\]", result.stdout))
    assert ranks == {("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")}, ranks
    assert "on 4 process(es)" in result.stdout
    assert quickstart.testbed_up, "the quickstart leaves the testbed running"
    assert (quickstart.work / "outputs/demo-addition/final/model.safetensors").is_file()
