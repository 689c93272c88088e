"""scripts/hello-nodes.sh, the testbed's smoke job, as a user runs it (on the shared testbed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ctrain.testbed import Testbed
from tests.plugins.testbed import PYXIS_SOURCES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("runtime", ["apptainer", pytest.param("pyxis", marks=pytest.mark.full)])
def test_hello_nodes_runs_a_two_node_job_inside_the_image(testbed: Testbed, runtime: str) -> None:
    """Apptainer with a SIF; pyxis (built from the sources the testbed fixture used) with a squashfs. The
    pyxis run is in the full tier alone; CI tier: test_through_pyxis_faults_behave_as_under_apptainer (a
    2-node job through pyxis and enroot)."""
    pyxis = ["--pyxis", str(PYXIS_SOURCES)] if runtime == "pyxis" else []
    result = subprocess.run(
        [REPO / "scripts" / "hello-nodes.sh", *pyxis], capture_output=True, text=True, timeout=1800, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    image = "hello-node.sqsh" if runtime == "pyxis" else "hello-node.sif"
    hello = re.findall(
        rf"^hello from (node\d+) ip=(10\.77\.0\.\d+) image={re.escape(image)} task=\d$", result.stdout, re.MULTILINE
    )
    assert len(hello) == 2 and len({h for h, _ in hello}) == 2 and len({ip for _, ip in hello}) == 2, result.stdout
    assert "hello-nodes: OK" in result.stdout
    assert testbed.is_up(), "the smoke job leaves the testbed running"
