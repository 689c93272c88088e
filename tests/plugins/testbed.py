"""Fixtures for tests on the Slurm testbed.

``testbed`` is the machine-wide testbed (at least 2 nodes), shared by every test of the session:
reused when one is already up, started otherwise, and taken down at the end only if this session
started it. The lifecycle tests take the testbed down and up themselves, so they run first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctrain.testbed import Testbed, build_demo_image
from ctrain.testbed.pyxis import Sources
from tests.conftest import need, need_root

REPO = Path(__file__).resolve().parents[2]
# enroot's and pyxis's release tarballs; a user gets them from GitHub, this machine has no route there.
PYXIS_SOURCES = Path(os.environ.get("CTRAIN_PYXIS_SOURCES", REPO.parent / "shared" / "vendor"))
LIFECYCLE_TESTS = "tests/integration/test_testbed_lifecycle.py"
MIN_NODES = 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the lifecycle tests (which stop and restart the testbed) before anything uses the testbed."""
    lifecycle = [item for item in items if item.nodeid.startswith(LIFECYCLE_TESTS)]
    rest = [item for item in items if not item.nodeid.startswith(LIFECYCLE_TESTS)]
    first = next((i for i, item in enumerate(rest) if "testbed" in getattr(item, "fixturenames", ())), len(rest))
    items[:] = rest[:first] + lifecycle + rest[first:]


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    """A running testbed with at least 2 nodes and pyxis, as a :class:`ctrain.testbed.Testbed`.

    Useful members: ``user``, ``shared_dir``, ``nodes``, ``run_as_user(args, env=, cwd=, input=)``,
    ``submit(script, *sbatch_args, env=) -> job id``, ``wait(job_id, timeout) -> final state``,
    ``job_state(job_id)``, ``slurm`` (the Slurm client as root: ``slurm.run(args)``, ``slurm.job(id)``).
    """
    need_root()
    need(any(PYXIS_SOURCES.glob("pyxis*")), f"enroot's and pyxis's sources in {PYXIS_SOURCES} (CTRAIN_PYXIS_SOURCES)")
    tb = Testbed()
    was_up = tb.is_up()
    if was_up and len(tb.nodes) < MIN_NODES:
        tb.down()
        was_up = False
    # Harmless when up; restarts one with an outdated config. pyxis is loaded, as on ParallelCluster.
    tb.up(len(tb.nodes) if was_up else MIN_NODES, with_pyxis=Sources.from_dir(PYXIS_SOURCES))
    yield tb
    if not was_up:
        tb.down()


@pytest.fixture(scope="session")
def demo_image(testbed: Testbed) -> Path:
    """examples/hello-node.def built into a SIF in the shared dir (busybox only, about a megabyte)."""
    return build_demo_image(testbed, REPO / "examples" / "hello-node.def")
