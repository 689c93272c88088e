"""Fixtures for the sbatch scripts on the testbed: a user's project directory on the shared
filesystem and jobs submitted as the job user (the testbed runs Apptainer, and pyxis with enroot)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ctrain.slurm import Slurm

REPO = Path(__file__).resolve().parents[2]



@dataclass
class Project:
    """A user's ctrain project on the shared filesystem, as the job user sees it."""

    path: Path
    testbed: object

    def sbatch(self, *args: str, env: dict[str, str] | None = None, script_text: str | None = None) -> str:
        """``sbatch --parsable ARGS`` as the job user from the project directory; the job id."""
        return Slurm(self.testbed.user_runner(env)).sbatch(args, cwd=self.path, script=script_text)

    def log(self, job_id: str) -> str:
        found = list((self.path / "logs").glob(f"*-{job_id}.out"))
        return found[0].read_text(errors="replace") if found else ""

    def wait_for_log(self, job_id: str, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until the job's log matches ``pattern`` (while it runs); the match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log(job_id), re.MULTILINE)
            if match:
                return match
            if self.testbed.job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            time.sleep(2)
        raise AssertionError(f"job {job_id}: no {pattern!r} in its log:\n{self.log(job_id)[-4000:]}")

    def own(self, *paths: Path) -> None:
        user = pwd.getpwnam(self.testbed.user)
        for path in paths:
            for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
                os.chown(item, user.pw_uid, user.pw_gid)


@pytest.fixture(scope="session")
def sbatch_project(testbed) -> Project:
    """The project directory a user submits from: sbatch/, recipes/, configs/ and examples/ of this checkout."""
    path = Path(testbed.shared_dir) / "sbatch-project"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()
    for name in ("sbatch", "recipes", "configs", "examples"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, path / name)
    (path / "logs").mkdir()
    project = Project(path, testbed)
    project.own(path)
    return project


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture's teardown knows whether the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def leaves_testbed_clean(request, sbatch_project: Project):
    """The testbed as the test found it, pass or fail: the test's jobs cancelled, every node back in
    service. A job a failed test leaves RUNNING holds a node, and the next test would fail on it
    instead of on its own fault. A failed test also gets the logs of its jobs and the slurmds."""
    project = sbatch_project
    testbed = project.testbed
    logs = project.path / "logs"
    before = {p.name for p in logs.glob("*.out")}
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for path in sorted(logs.glob("*.out")):
            if path.name not in before:
                print(f"--- {path.name} (last 6000 characters)\n{path.read_text(errors='replace')[-6000:]}")
        for path in sorted(testbed.layout.log_dir.glob("slurmd-*.log")):
            print(f"--- {path.name} (last 30 lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
    queued = testbed.slurm.queued_ids()
    if queued:
        testbed.slurm.run(["scancel", *queued], check=False)
    for node in testbed.status().nodes:
        testbed.reconnect_node(node.name)  # a node the test cut off the network and did not reconnect
        testbed.thaw_node(node.name)  # or froze and did not thaw
        if not node.running:  # a node the test killed and did not bring back
            testbed.start_node(node.name)
    deadline = time.monotonic() + 120
    while True:
        queued, states = testbed.slurm.queued_ids(), testbed.slurm.node_states()
        if not queued and set(states.values()) == {"idle"}:
            break
        assert time.monotonic() < deadline, f"the testbed is not idle 120 s after the test: jobs {queued}, {states}"
        for name, state in states.items():
            if state.startswith(("down", "drain", "fail")):
                testbed.slurm.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
        time.sleep(0.5)
