"""Shared test policy. Fixtures for each area live in tests/plugins/<area>.py."""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "tests.plugins.testbed",
    "tests.plugins.image",
    "tests.plugins.train",
    "tests.plugins.cluster",
    "tests.plugins.slurm",
    "tests.plugins.remote",
]

STRICT = bool(os.environ.get("CTRAIN_STRICT") or os.environ.get("CI"))

# The testbed is one machine-wide cluster: every test that submits to it, stops it or reads what a
# job on it made runs in one pytest-xdist group (one worker, in collection order), beside the tests
# that need no testbed (scripts/test.sh runs two workers). These fixtures mark such a test.
TESTBED_FIXTURES = frozenset({"testbed", "tb", "quickstart", "demo_run", "sbatch_project", "login_host",
                              "demo_image"})  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests that use the testbed in one xdist group (see TESTBED_FIXTURES); before
    pytest-xdist's own hook, which reads the groups."""
    for item in items:
        if TESTBED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("testbed"))


def need(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing, except in CI/strict mode, where that is a failure."""
    if condition:
        return
    if STRICT:
        pytest.fail(f"prerequisite missing: {what} (CTRAIN_STRICT/CI set, so this fails instead of skipping)")
    pytest.skip(f"prerequisite missing: {what}")


def need_root() -> None:
    need(os.geteuid() == 0, "root")
