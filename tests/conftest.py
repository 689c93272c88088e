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


def need(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing, except in CI/strict mode, where that is a failure."""
    if condition:
        return
    if STRICT:
        pytest.fail(f"prerequisite missing: {what} (CTRAIN_STRICT/CI set, so this fails instead of skipping)")
    pytest.skip(f"prerequisite missing: {what}")


def need_root() -> None:
    need(os.geteuid() == 0, "root")
