"""`ctrain status/logs/cancel --cluster NAME` from "a laptop": over a real OpenSSH server on the
testbed's login host, to the testbed's real Slurm (tests/plugins/remote.py)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ctrain import remote, slurm
from ctrain.cli import main
from tests.plugins.image import free_port
from tests.plugins.remote import LoginHost

pytestmark = pytest.mark.integration


@pytest.fixture()
def clusters(login_host: LoginHost, sbatch_project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clusters file with the testbed as `tb` (the default) and broken variants of it."""
    path = tmp_path / "clusters.yaml"
    project_dir = str(sbatch_project.path)
    profiles = {
        "default": "tb",
        "clusters": {
            "tb": login_host.profile(project_dir=project_dir),
            "wrongkey": login_host.profile(identity_file=str(login_host.directory / "other_key")),
            "nosshd": login_host.profile(port=free_port(login_host.host)),
            "nohost": login_host.profile(host="no-such-login.invalid"),
        },
    }
    path.write_text(yaml.safe_dump(profiles))
    monkeypatch.setenv(remote.PROFILES_ENV, str(path))
    yield path
    for name in profiles["clusters"]:
        remote.Ssh(remote.resolve(name, path)).close()


def _job(testbed, workdir: Path, body: str, name: str) -> str:
    script = workdir / f"{name}.sbatch"
    script.write_text(f"#!/bin/sh\n#SBATCH --job-name={name}\n#SBATCH --output=logs/%x-%j.out\n{body}\n")
    return testbed.user_slurm.sbatch([str(script)], cwd=workdir)


def _ctrain(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output, time.monotonic() - start


def test_status_logs_and_cancel_over_ssh(testbed, sbatch_project, clusters: Path) -> None:
    job_id = _job(testbed, sbatch_project.path, "echo started on $(hostname)\nsleep 120", "sshprobe")
    code, out, first = _ctrain("status", "--cluster", "tb", job_id)  # opens the shared connection
    assert code == 0, out
    deadline = time.monotonic() + 60
    while not re.search(rf"^{job_id}\s+sshprobe\s+RUNNING\s", out, re.MULTILINE):
        assert time.monotonic() < deadline, out
        time.sleep(0.5)
        code, out, _ = _ctrain("status", job_id)  # the default cluster: tb
    times = [_ctrain("status", "--cluster", "tb", job_id)[2] for _ in range(5)]
    print(f"remote | ctrain status --cluster tb JOB: first {first:.2f} s, then {min(times):.2f}-{max(times):.2f} s")
    assert max(times) < 2.0, times

    deadline = time.monotonic() + 30
    while "started on" not in (text := _ctrain("logs", "--cluster", "tb", job_id)[1]):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    assert re.search(r"started on node\d", text), text

    followed: list[str] = []
    client = slurm.Slurm(remote.Ssh(remote.resolve("tb")))
    follower = threading.Thread(target=lambda: followed.append(str(client.follow(job_id, emit=followed.append,
                                                                                poll=0.5))))  # fmt: skip
    follower.start()
    code, out, _ = _ctrain("cancel", "--cluster", "tb", job_id)
    assert code == 0 and f"job {job_id}: cancelled" in out, out
    follower.join(timeout=60)
    assert not follower.is_alive(), "following over ssh did not stop when the job ended"
    assert any(line.startswith("started on node") for line in followed) and "CANCELLED" in followed[-1], followed
    code, out, _ = _ctrain("status", "--cluster", "tb", job_id)
    assert re.search(rf"^{job_id}\s+sshprobe\s+CANCELLED\s", out, re.MULTILINE), out


def test_log_of_a_job_slurm_forgot_is_found_in_the_remote_project(sbatch_project, clusters: Path) -> None:
    """A finished job Slurm no longer knows: its log is looked for in PROJECT_DIR/logs on the cluster."""
    log = sbatch_project.path / "logs" / "old-999998.out"
    log.write_text("an old run\n")
    try:
        code, out, _ = _ctrain("logs", "--cluster", "tb", "999998")
        assert code == 0 and out == "an old run\n", out
    finally:
        log.unlink()
    code, out, _ = _ctrain("logs", "--cluster", "tb", "999997")
    assert code == 1 and "no log for job 999997" in out, out


@pytest.mark.parametrize(
    ("cluster", "said"),
    [
        ("wrongkey", r"refused the login for ctrain: ssh tried \S+other_key; put the public key"),
        ("nosshd", r"refused the connection \(no sshd on that port\)"),
        ("nohost", r"host 'no-such-login.invalid' is unknown"),
        ("nope", r"no cluster named 'nope' in \S+clusters.yaml \(clusters: nohost, nosshd, tb, wrongkey\)"),
    ],
)
def test_what_goes_wrong_reaching_a_cluster_is_said_in_one_line(clusters: Path, cluster: str, said: str) -> None:
    code, out, seconds = _ctrain("status", "--cluster", cluster)
    assert code != 0 and "Traceback" not in out, out
    assert re.search(r"^error: (cluster \S+: )?(\S+ )?" + said, out), out
    assert len(out.strip().splitlines()) == 1, out
    assert seconds < 15, seconds  # never a prompt, never a hang
