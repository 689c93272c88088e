"""The testbed as other tests use it (the ``testbed`` fixture): commands and jobs as the job
user, 2 nodes x 2 tasks, job states, signals and requeue."""

from __future__ import annotations

import pwd
import re
import stat
import time
from pathlib import Path

import pytest

from ctrain.errors import CtrainError
from ctrain.testbed import Testbed, host
from ctrain.testbed.plan import CRED_EXPIRE_S

pytestmark = pytest.mark.integration


def job_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n" + body)
    return script


def output(tb: Testbed, job: str) -> str:
    return (tb.shared_dir / f"api-{job}.out").read_text()


def test_commands_run_as_the_job_user_in_the_shared_dir(testbed: Testbed) -> None:
    out = testbed.run_as_user(["sh", "-c", 'echo "$(id -un) $HOME $PWD"']).stdout.split()
    assert out == [testbed.user, f"/home/{testbed.user}", str(testbed.shared_dir)]
    mode = testbed.shared_dir.stat()
    assert mode.st_uid == pwd.getpwnam(testbed.user).pw_uid
    assert stat.S_IMODE(mode.st_mode) == 0o755 and host.unreachable_dirs(testbed.shared_dir) == []
    assert len(testbed.nodes) >= 2


def test_two_nodes_two_tasks_each(testbed: Testbed) -> None:
    out = testbed.run_as_user(["srun", "-N2", "--ntasks-per-node=2", "sh", "-c", 'echo "$(hostname) $SLURM_PROCID"'])
    tasks = sorted(tuple(line.split()) for line in out.stdout.splitlines())
    assert tasks == [("node1", "0"), ("node1", "1"), ("node2", "2"), ("node2", "3")]


def test_submit_passes_env_and_wait_reports_failure(testbed: Testbed, tmp_path: Path) -> None:
    script = job_script(tmp_path, 'echo "greeting=$GREETING arg=$1"\nexit 3\n')
    job = testbed.submit(script, "--output=api-%j.out", args=["first"], env={"GREETING": "hi there"})
    assert testbed.wait(job, timeout=60) == "FAILED"
    assert output(testbed, job).strip() == "greeting=hi there arg=first"


def test_wait_times_out_naming_the_state_and_a_cancelled_job_is_final(testbed: Testbed, tmp_path: Path) -> None:
    job = testbed.submit(job_script(tmp_path, "sleep 60\n"), "--output=api-%j.out")
    with pytest.raises(CtrainError, match=rf"job {job} is still (PENDING|RUNNING) after 1s"):
        testbed.wait(job, timeout=1, poll=0.2)
    testbed.slurm.run(["scancel", job])
    assert testbed.wait(job, timeout=60) == "CANCELLED"


def test_an_impossible_job_is_refused_at_submit_time(testbed: Testbed, tmp_path: Path) -> None:
    with pytest.raises(CtrainError, match="Node count specification invalid"):
        testbed.submit(job_script(tmp_path, "true\n"), f"-N{len(testbed.nodes) + 1}")


def test_signals_reach_the_batch_script(testbed: Testbed, tmp_path: Path) -> None:
    body = "trap 'echo \"got USR1\"; exit 0' USR1\necho started\nfor i in $(seq 600); do sleep 0.1; done\n"
    job = testbed.submit(job_script(tmp_path, body), "--output=api-%j.out", "--signal=B:USR1@30")
    deadline = time.monotonic() + 60
    while "started" not in (output(testbed, job) if (testbed.shared_dir / f"api-{job}.out").exists() else ""):
        assert time.monotonic() < deadline, "job did not start"
        time.sleep(0.2)
    testbed.slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert testbed.wait(job, timeout=60) == "COMPLETED"
    assert output(testbed, job).splitlines() == ["started", "got USR1"]


def test_requeue_runs_the_job_again(testbed: Testbed, tmp_path: Path) -> None:
    body = 'echo "run ${SLURM_RESTART_COUNT:-0}"\n[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0\nsleep 120\n'
    job = testbed.submit(job_script(tmp_path, body), "--output=api-%j.out", "--open-mode=append", "--requeue")
    deadline = time.monotonic() + 60
    while testbed.job_state(job) != "RUNNING":
        assert time.monotonic() < deadline, "job did not start"
        time.sleep(0.2)
    testbed.slurm.run(["scontrol", "requeue", job])
    assert testbed.wait(job, timeout=CRED_EXPIRE_S + 60) == "COMPLETED"
    assert re.findall(r"^run \d+$", output(testbed, job), re.MULTILINE) == ["run 0", "run 1"]
