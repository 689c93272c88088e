"""`ctrain status`, `ctrain logs [-f]` and `ctrain cancel` against the testbed's real Slurm (seconds each)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import slurm
from ctrain.cli import main
from tests import golden_files

# The testbed fixture points SLURM_CONF at the testbed: a plain client is what `ctrain status` uses.
SLURM = slurm.Slurm()

pytestmark = pytest.mark.integration


def _job(testbed, tmp_dir: Path, body: str, name: str) -> str:
    script = tmp_dir / f"{name}.sbatch"
    script.write_text(f"#!/bin/sh\n#SBATCH --job-name={name}\n#SBATCH --output=logs/%x-%j.out\n{body}\n")
    return testbed.user_slurm.sbatch([str(script)], cwd=tmp_dir)


@pytest.fixture()
def workdir(sbatch_project) -> Path:
    return sbatch_project.path


def _wait_state(job_id: str, states: set[str], timeout: float = 60) -> slurm.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = SLURM.job(job_id)
        if job and job.state in states:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.5)


def test_status_logs_cancel(testbed, workdir: Path) -> None:
    job_id = _job(testbed, workdir, "echo started on $(hostname)\nsleep 120", "statusprobe")
    running = _wait_state(job_id, {"RUNNING"})
    assert running.where in ("node1", "node2") and running.name == "statusprobe"

    result = CliRunner().invoke(main, ["status", job_id])
    assert result.exit_code == 0, result.output
    assert re.search(rf"^{job_id}\s+statusprobe\s+RUNNING\s", result.output, re.MULTILINE), result.output

    path = SLURM.log_path(job_id)
    assert path == workdir / "logs" / f"statusprobe-{job_id}.out"
    deadline = time.monotonic() + 30
    while "started on" not in (text := CliRunner().invoke(main, ["logs", job_id]).output):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    assert f"started on {running.where}" in text

    followed: list[str] = []
    follower = threading.Thread(
        target=lambda: followed.append(str(SLURM.follow(job_id, emit=followed.append, poll=0.5)))
    )
    follower.start()
    result = CliRunner().invoke(main, ["cancel", job_id])
    assert result.exit_code == 0 and f"job {job_id}: cancelled" in result.output
    follower.join(timeout=60)
    assert not follower.is_alive(), "ctrain logs -f did not stop when the job ended"
    assert f"started on {running.where}" in followed and "CANCELLED" in followed[-1]
    result = CliRunner().invoke(main, ["logs", "-f", job_id])  # an ended job: its log, then how it ended
    assert result.exit_code == 1 and f"job {job_id}: CANCELLED" in result.output, result.output

    result = CliRunner().invoke(main, ["status", job_id])
    assert re.search(rf"^{job_id}\s+statusprobe\s+CANCELLED\s", result.output, re.MULTILINE), result.output


def test_signal_goes_to_the_batch_script_only(testbed, workdir: Path) -> None:
    """`ctrain cancel --signal` does what `#SBATCH --signal=B:...` does: the batch script gets it, steps do not."""
    body = ("trap 'echo batch got USR1; kill $step' USR1\n"
            "srun sh -c 'trap \"echo step got USR1\" USR1; while :; do sleep 1; done' & step=$!\n"
            "wait $step; wait $step; echo batch done")  # fmt: skip
    job_id = _job(testbed, workdir, body, "signalprobe")
    _wait_state(job_id, {"RUNNING"})
    time.sleep(3)  # the step has started and set its trap
    result = CliRunner().invoke(main, ["cancel", "--signal", "USR1", job_id])
    assert result.exit_code == 0 and f"job {job_id}: sent SIGUSR1" in result.output
    final = SLURM.wait(job_id, timeout=60)
    log = SLURM.log_path(job_id).read_text()
    assert "batch got USR1" in log and "batch done" in log and "step got USR1" not in log, log
    assert final.state == "COMPLETED"


def test_unknown_and_malformed_jobs(testbed) -> None:
    assert SLURM.status(["999999"])[0].state == "UNKNOWN"
    result = CliRunner().invoke(main, ["logs", "999999"])
    assert result.exit_code == 1 and "no log for job 999999" in result.output
    result = CliRunner().invoke(main, ["cancel", "999999"])  # scancel itself exits 0 and says nothing
    assert result.exit_code == 1 and "job 999999: Slurm does not know it" in result.output, result.output
    result = CliRunner().invoke(main, ["cancel", "12;ls"])
    assert result.exit_code == 2 and "is not a Slurm job id" in result.output


def test_node_shapes_are_what_slurm_conf_declares(testbed) -> None:
    """The sinfo format a GPU job's CPUs and memory are derived from (ctrain.jobs.submit.gpu_resources),
    read from the real sinfo: the testbed's nodes as its slurm.conf declares them."""
    declared = {(int(m[1]), int(m[2])) for m in re.finditer(r"CPUs=(\d+) RealMemory=(\d+)", testbed.slurm_conf.read_text())}
    shapes = SLURM.node_shapes(None)
    assert shapes and {(s.cpus, s.memory_mb) for s in shapes} == declared
    assert all(s.gpus == 0 for s in shapes)


@pytest.mark.parametrize("script", ["pyxis", "pyxis_multinode", "apptainer", "apptainer_multinode"])
def test_scripts_pass_sbatch_test_only(testbed, sbatch_project, script: str) -> None:
    """Slurm accepts every script's #SBATCH header as the job user would submit it (nothing queued)."""
    out = testbed.run_as_user(
        ["sbatch", "--test-only", f"sbatch/{script}.sbatch"], cwd=sbatch_project.path, check=False
    )
    assert out.returncode == 0, out.stderr
    nodes = "node1" if script in ("pyxis", "apptainer") else "node[1-2]"
    assert re.search(
        rf"Job \d+ to start at \S+ using \d+ processors on nodes {re.escape(nodes)} in partition", out.stderr
    ), out.stderr


def test_the_pyxis_options_the_scripts_are_checked_against_are_real_pyxis_options(testbed) -> None:
    """tests/golden/sbatch/pyxis-srun-options.txt, which every --container-* flag of the scripts is
    checked against, is exactly what the pyxis the testbed runs adds to `srun --help`."""
    text = testbed.run_as_user(["srun", "--help"]).stdout
    entries = re.split(r"\n(?=\s{2,6}-)", text)
    real = {}
    for entry in entries:
        match = re.match(r"\s*--([a-z-]+)(?:=(\S+))?", entry)
        if match and "[pyxis]" in entry:
            real[match[1]] = match[2] or "-"
    assert real == golden_files.pyxis_options()
    doctor = CliRunner().invoke(main, ["doctor", "--for", "pyxis-jobs"])
    assert doctor.exit_code == 0, doctor.output
    assert re.search(r"^pyxis\s+ok\s+loaded by srun", doctor.output, re.MULTILINE), doctor.output


def test_submit_queues_the_text_and_keeps_a_copy_beside_the_log(testbed, tmp_path: Path) -> None:
    """submit(): the script text on sbatch's stdin, the submit directory as given, logs/ made first."""
    from ctrain.jobs import submit

    text = "#!/bin/sh\n#SBATCH --job-name=copyprobe\n#SBATCH --output=logs/%x-%j.out\necho ran in $(pwd)\n"
    job = submit.Job(template=tmp_path / "x.sbatch", runtime="apptainer", text=text, project=tmp_path,
                     settings={}, arguments=[], options={"job-name": "copyprobe", "output": "logs/%x-%j.out"})  # fmt: skip
    job_id, log = submit.submit(job)
    assert log == tmp_path / "logs" / f"copyprobe-{job_id}.out"
    assert log.with_suffix(".sbatch").read_text() == text
    assert SLURM.wait(job_id, timeout=60).state == "COMPLETED"
    assert log.read_text().strip() == f"ran in {tmp_path}"


def test_a_job_that_names_no_time_gets_the_partitions_default_and_the_dry_run_says_so(
    testbed, sbatch_project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No script of ctrain's sets --time: Slurm gives the job the partition's DefaultTime (the testbed's
    slurm.conf sets one), and `ctrain submit --dry-run` names it, read from the real scontrol; a time
    above the partition's MaxTime is refused before anything is queued."""
    from ctrain.testbed.plan import PARTITION, PARTITION_DEFAULT_TIME, PARTITION_MAX_TIME

    out = testbed.run_as_user(["sbatch", "--parsable", "--hold", "sbatch/apptainer.sbatch"], cwd=sbatch_project.path)
    job_id = out.stdout.strip().split(";")[0]
    try:
        assert SLURM.job(job_id).time_limit == PARTITION_DEFAULT_TIME
    finally:
        SLURM.cancel(job_id)
    monkeypatch.chdir(sbatch_project.path)
    result = CliRunner().invoke(main, ["submit", "--dry-run", f"--image={tmp_path / 'none.sif'}", "recipes/demo-addition.yaml"])
    assert result.exit_code == 0, result.output
    assert (f"note: time limit {PARTITION_DEFAULT_TIME}: partition {PARTITION}'s DefaultTime (slurm.time or --time "
            f"asks for another, up to its MaxTime {PARTITION_MAX_TIME})") in result.stderr  # fmt: skip
    result = CliRunner().invoke(main, ["submit", "--dry-run", "--time=8-00:00:00", f"--image={tmp_path / 'none.sif'}",
                                       "recipes/demo-addition.yaml"])  # fmt: skip
    assert result.exit_code == 2 and result.stderr.startswith(
        f"error: time limit 8-00:00:00 (slurm.time, --time) is longer than partition {PARTITION}'s MaxTime"), result.stderr
