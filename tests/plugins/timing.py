"""Where the suite's time goes: its parts in seconds, so the next regression is seen, not guessed.

Each pytest process records how long its session fixtures take to set up (the image build and its
conversions, the testbed, the quickstart); pytest-xdist's workers hand theirs to the controller,
which also sees every test's start and stop. At the end the controller prints one
``suite part | NAME | SECONDS`` line per part and, with ``CTRAIN_SUITE_TIMES=FILE``, writes the parts
and the slowest items as JSON (``.ci/run`` reads it for its closing lines).

The parts: ``image fixtures`` (the wheelhouse, the CPU image, its SIF and squashfs: set-up seconds),
``testbed chain`` (the first testbed test's start to the last one's end: they run in order on one
worker, the run's long pole), ``the rest`` (every other test's seconds, summed over both workers).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TIMES_ENV = "CTRAIN_SUITE_TIMES"
IMAGE_FIXTURES = ("test_wheelhouse", "cpu_image", "cpu_sif", "cpu_sqsh")
SHOWN = (*IMAGE_FIXTURES, "quickstart")  # the session fixtures whose seconds are shown one by one
GROUP_SUFFIX = "@testbed"  # pytest-xdist's suffix for the testbed's group (tests/conftest.py)
SLOWEST = 20

_fixtures: dict[str, float] = {}  # session fixture -> its set-up seconds (the longest process's)
_tests: dict[str, dict[str, float]] = {}  # test id -> start, stop, seconds (controller or single process)
_started = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Iterator[None]:
    started = time.monotonic()
    yield
    if fixturedef.scope == "session":
        _fixtures[fixturedef.argname] = time.monotonic() - started


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _tests.setdefault(report.nodeid, {"start": report.start, "stop": report.stop, "seconds": 0.0})
    entry["start"], entry["stop"] = min(entry["start"], report.start), max(entry["stop"], report.stop)
    entry["seconds"] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller adds it up
        workeroutput["ctrain_fixtures"] = json.dumps(_fixtures)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """A worker ended: its session fixtures' set-up seconds join the controller's. Both workers ask for
    the image; one builds it while the other waits for its lock, so the longer of the two is its cost."""
    for name, seconds in json.loads(getattr(node, "workeroutput", {}).get("ctrain_fixtures", "{}")).items():
        _fixtures[name] = max(_fixtures.get(name, 0.0), seconds)


def parts() -> dict[str, Any]:
    """The suite's parts and slowest items, from what this process saw."""
    chain = [t for nodeid, t in _tests.items() if nodeid.endswith(GROUP_SUFFIX)]
    rest = [t["seconds"] for nodeid, t in _tests.items() if not nodeid.endswith(GROUP_SUFFIX)]
    slowest = sorted(((t["seconds"], nodeid) for nodeid, t in _tests.items()), reverse=True)[:SLOWEST]
    return {
        "parts": {
            "image fixtures": sum(_fixtures.get(name, 0.0) for name in IMAGE_FIXTURES),
            "testbed chain": max(t["stop"] for t in chain) - min(t["start"] for t in chain) if chain else 0.0,
            "the rest": sum(rest),
            "pytest": time.time() - _started,
        },
        "fixtures": dict(sorted(_fixtures.items(), key=lambda item: -item[1])),
        "shown": [name for name in SHOWN if name in _fixtures],
        "slowest": [{"seconds": seconds, "test": nodeid} for seconds, nodeid in slowest],
        "tests": len(_tests),
    }


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if getattr(config, "workeroutput", None) is not None or not _tests:
        return
    found = parts()
    if not (os.environ.get(TIMES_ENV) or found["parts"]["testbed chain"] or found["parts"]["image fixtures"]):
        return  # a run of unit tests alone: nothing to tell apart
    for name in found["shown"]:
        terminalreporter.write_line(f"suite fixture | {name} | {found['fixtures'][name]:.0f} s")
    for name, seconds in found["parts"].items():
        terminalreporter.write_line(f"suite part | {name} | {seconds:.0f} s")
    if os.environ.get(TIMES_ENV):
        Path(os.environ[TIMES_ENV]).write_text(json.dumps(found, indent=1) + "\n")
