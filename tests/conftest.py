"""Shared test policy. Fixtures for each area live in tests/plugins/<area>.py."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

pytest_plugins = [
    "tests.plugins.testbed",
    "tests.plugins.image",
    "tests.plugins.train",
    "tests.plugins.cluster",
    "tests.plugins.slurm",
    "tests.plugins.remote",
    "tests.plugins.timing",
]

STRICT = bool(os.environ.get("CTRAIN_STRICT") or os.environ.get("CI"))

# The testbed is one machine-wide cluster: every test that submits to it, stops it or reads what a
# job on it made runs in one pytest-xdist group (one worker, in collection order), beside the tests
# that need no testbed (scripts/test.sh runs two workers). These fixtures mark such a test.
TESTBED_FIXTURES = frozenset({"testbed", "tb", "quickstart", "demo_run", "sbatch_project", "login_host",
                              "demo_image"})  # fmt: skip


# The image the integration tests share (tests/plugins/image.py): its build is the longest set-up.
IMAGE_FIXTURES = frozenset({"test_wheelhouse", "cpu_image", "cpu_sif", "cpu_sqsh", "quickstart", "demo_run"})


def _uses(item: pytest.Item, fixtures: frozenset[str]) -> bool:
    return bool(fixtures & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests that use the testbed in one xdist group (see TESTBED_FIXTURES), before
    pytest-xdist's own hook, which reads the groups; and order the run for two workers: the testbed's
    group first (the run's long pole: one worker takes it at the start), its modules that need no
    image at its head (they run while the image is built), then the tests that build the image (the
    other worker starts on them at once), then the rest. Modules stay whole within the group, so a
    module's fixtures are made once."""
    group = [item for item in items if _uses(item, TESTBED_FIXTURES)]
    for item in group:
        item.add_marker(pytest.mark.xdist_group("testbed"))
    needs_image = {item.module for item in group if _uses(item, IMAGE_FIXTURES)}
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.module, index)

    grouped = set(group)

    def place(indexed: tuple[int, pytest.Item]) -> tuple[int, int, int, int]:
        index, item = indexed
        if item in grouped:
            return 0, int(item.module in needs_image), first[item.module], index
        return (1 if _uses(item, IMAGE_FIXTURES) else 2), 0, 0, index

    items[:] = [item for _, item in sorted(enumerate(items), key=place)]


def need(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing, except in CI/strict mode, where that is a failure."""
    if condition:
        return
    if STRICT:
        pytest.fail(f"prerequisite missing: {what} (CTRAIN_STRICT/CI set, so this fails instead of skipping)")
    pytest.skip(f"prerequisite missing: {what}", allow_module_level=True)


def need_root() -> None:
    need(os.geteuid() == 0, "root")


def require(module: str) -> ModuleType:
    """Import ``module`` for a test; where it is missing, skip, except in CI/strict mode, where that is a
    failure (``pytest.importorskip`` skips there too, and at a module's top it drops the whole file)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        need(False, f"the Python module {module} ({error})")
        raise  # not reached: need fails or skips
