"""One run across job ids (sbatch/lib/chain.sh, ctrain.jobs.chain): the continuation a lost node's job
submits, the hand-over of the run, and the one holder; the real library on Slurm's commands faked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ctrain import protocol
from ctrain.jobs import chain
from tests.bashlib import JOB, LIB, calls, fake_slurm, library, slurm_conf


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    directory = fake_slurm(tmp_path / "project")
    (directory / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\ngpu004 idle\n")
    (directory / ".ctrain").mkdir()
    return directory


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    return slurm_conf(tmp_path / "conf")


def holder(fake: Path) -> str:
    return (fake / ".ctrain" / protocol.holder_file(JOB)).read_text().strip()


def test_a_lost_node_continues_the_run_as_a_new_job_without_it(fake: Path, conf: Path) -> None:
    """The new job: this job's script read back from Slurm, without the lost node, as many nodes, with
    the run's identity and none of this job's SLURM_* variables; the run handed over to it; this job
    kept from running again; and the line ctrain status, logs and cancel follow the run by."""
    (fake / "sbatch-id").write_text("5151\n")
    commands = "CTRAIN_ARGUMENTS=(recipes/sft.yaml 'training.run_name=a b') && ctrain_requeue_without --continue gpu002"
    out = library(fake, commands + " && echo requeued=1", conf, CTRAIN_CONTINUE="1",
                  SLURM_RESTART_COUNT="2", SLURM_JOB_NAME="sft", SLURM_SUBMIT_DIR=str(fake))  # fmt: skip
    assert "requeued=1" in out.stdout, out.stdout + out.stderr
    assert protocol.continued_as(out.stdout) == "5151", out.stdout
    assert "ctrain: requeueing as job 5151 (restart 3 of run 4242) without gpu002: a continuation" in out.stdout
    (submitted,) = calls(fake, "sbatch")
    assert submitted == (f"sbatch --parsable --exclude=gpu002 --nodes=2 --chdir={fake} --job-name=sft "
                         f"{fake}/.ctrain/{JOB}.continuation recipes/sft.yaml training.run_name=a b")  # fmt: skip
    assert (fake / "sbatch-args").read_text().splitlines()[-2:] == ["recipes/sft.yaml", "training.run_name=a b"]
    given = (fake / "sbatch-env").read_text().splitlines()
    assert {"CTRAIN_RUN=4242", "CTRAIN_CONTINUES=4242", "CTRAIN_RUN_RESTARTS=3"} <= set(given), given
    assert [line for line in given if line.startswith("SLURM_")] == [f"SLURM_CONF={conf}"], given
    assert calls(fake, "scontrol write batch_script") == [f"scontrol write batch_script {JOB} {fake}/.ctrain/{JOB}.continuation"]
    assert not (fake / ".ctrain" / protocol.continuation_file(JOB)).exists()
    assert holder(fake) == f"after {JOB}"
    assert (fake / ".ctrain" / protocol.jobs_file(JOB)).read_text() == "5151\n"
    assert chain.run_of(fake / ".ctrain", "5151") == JOB
    assert calls(fake, "scontrol update") == [f"scontrol update JobId={JOB} Requeue=0"]
    assert calls(fake, "scontrol requeue") == [] and calls(fake, "scancel") == []


def test_a_refused_continuation_falls_back_to_the_requeue_and_keeps_the_run(fake: Path, conf: Path) -> None:
    """sbatch refused (a QOS limit, a full queue, a site that forbids it from a job): one line, and the
    requeue as before, the run still this job's."""
    out = library(fake, "ctrain_requeue_without --continue gpu002", conf, CTRAIN_CONTINUE="1")
    assert ("ctrain: no continuation: sbatch refused it (sbatch: error: QOSMaxSubmitJobPerUserLimit); the job is "
            "requeued instead") in out.stdout, out.stdout  # fmt: skip
    assert f"ctrain: requeueing job {JOB} (restart 1) without gpu002 (ExcNodeList)" in out.stdout
    assert calls(fake, "scontrol requeue") == [f"scontrol requeue {JOB}"]
    assert holder(fake) == JOB
    assert not (fake / ".ctrain" / protocol.continuation_file(JOB)).exists()


def test_continue_off_requeues_without_asking_sbatch(fake: Path, conf: Path) -> None:
    (fake / "sbatch-id").write_text("5151\n")
    out = library(fake, "ctrain_requeue_without --continue gpu002", conf, CTRAIN_CONTINUE="0")
    assert calls(fake, "sbatch") == [] and calls(fake, "scontrol requeue") == [f"scontrol requeue {JOB}"], out.stdout


def test_a_lost_batch_host_s_job_is_cancelled_once_the_continuation_holds_the_run(fake: Path, conf: Path) -> None:
    """A sentinel decides for a lost batch host: Slurm would keep the job RUNNING, and its healthy nodes
    from the continuation, until it declares the host dead."""
    (fake / "sbatch-id").write_text("5151\n")
    out = library(fake, "ctrain_requeue_without --continue gpu001", conf, CTRAIN_CONTINUE="1")
    assert "ctrain: ending job 4242 (scancel): its batch script was lost with gpu001" in out.stdout, out.stdout
    assert calls(fake, "scancel") == [f"scancel {JOB}"]


def test_continuations_count_toward_the_requeue_cap(fake: Path, conf: Path) -> None:
    (fake / "sbatch-id").write_text("5151\n")
    out = library(fake, "ctrain_requeue_without --continue gpu002", conf, CTRAIN_CONTINUE="1",
                  CTRAIN_RUN_RESTARTS="9", SLURM_RESTART_COUNT="1")  # fmt: skip
    assert "ctrain: not requeueing: already restarted 10 times (CTRAIN_MAX_REQUEUES=10)" in out.stdout, out.stdout
    assert calls(fake, "sbatch") == []


def hold(fake: Path, conf: Path, job: str, continues: str = "") -> subprocess.CompletedProcess[str]:
    return library(fake, "ctrain_hold && echo held", conf, SLURM_JOB_ID=job, CTRAIN_CONTINUES=continues)


def test_a_run_is_held_by_one_job_the_continuation_takes_it_and_the_old_job_is_refused(fake: Path,
                                                                                        conf: Path) -> None:  # fmt: skip
    assert hold(fake, conf, JOB).stdout == "held\n"
    assert hold(fake, conf, JOB).stdout == "held\n"  # the same job, requeued
    assert hold(fake, conf, "7000").stdout.startswith(f"ctrain: not running: run {JOB} is held by {JOB} ")
    (fake / ".ctrain" / protocol.holder_file(JOB)).write_text(f"after {JOB}\n")  # ctrain_continue's hand-over
    old = hold(fake, conf, JOB)  # the old job, requeued by Slurm after its node failed
    assert f"run {JOB} is held by after {JOB} " in old.stdout and "held\n" not in old.stdout
    assert hold(fake, conf, "5151", continues="5000").stdout.startswith("ctrain: not running")  # not its predecessor
    assert hold(fake, conf, "5151", continues=JOB).stdout == "held\n"
    assert holder(fake) == "5151"
    assert hold(fake, conf, JOB).stdout.startswith(f"ctrain: not running: run {JOB} is held by 5151 ")


def test_of_two_jobs_starting_a_run_together_exactly_one_holds_it(tmp_path: Path, conf: Path) -> None:
    """Both start at once, 20 times over: the holder file is created by one (noclobber), the other finds it."""
    for attempt in range(20):
        project = fake_slurm(tmp_path / f"p{attempt}")
        env = {"CTRAIN_PROJECT_DIR": str(project), "CTRAIN_RUN": JOB, "PATH": f"{project / 'bin'}:/usr/bin:/bin"}
        both = [subprocess.Popen(["bash", "-c", 'source "$0"; ctrain_hold && echo held', str(LIB)], cwd=project,
                                 env={**env, "SLURM_JOB_ID": job, "CTRAIN_CONTINUES": ""}, stdout=subprocess.PIPE,
                                 text=True) for job in (JOB, "4243")]  # fmt: skip
        answers = [process.communicate(timeout=60)[0] for process in both]
        assert sorted(answer == "held\n" for answer in answers) == [False, True], answers
        assert (project / ".ctrain" / protocol.holder_file(JOB)).read_text().strip() in (JOB, "4243")


@pytest.mark.parametrize("variable,value", [("CTRAIN_RUN", "1;reboot"), ("CTRAIN_CONTINUES", "$(id)"),
                                            ("CTRAIN_RUN_RESTARTS", "a[$(id)]")])  # fmt: skip
def test_a_run_identity_that_is_not_a_number_is_refused(fake: Path, conf: Path, variable: str, value: str) -> None:
    out = library(fake, "ctrain_run_identity; echo went-on", conf, **{variable: value})
    assert out.returncode == 2 and "went-on" not in out.stdout
    assert out.stderr.startswith(f"ctrain: error: {variable} is '{value}'; "), out.stderr


class Logs:
    """The one thing ctrain.jobs.chain asks of a Slurm client, a job's log: made-up logs by job id."""

    def __init__(self, logs: dict[str, str]) -> None:
        self.logs = logs

    def read_log(self, job_id: str, *, search: object) -> str:
        from ctrain.errors import CtrainError

        if job_id not in self.logs:
            raise CtrainError(f"no log for job {job_id}")
        return self.logs[job_id]


def test_a_run_is_followed_from_job_to_job_by_each_logs_continuation_line() -> None:
    line = "ctrain: requeueing as job {} (restart {} of run 10) without node2: a continuation\n"
    logs = Logs({"10": "x\n" + line.format(11, 1), "11": "2: ctrain: requeueing as job 99 (restart 9 of run 10)\n"
                 + line.format(12, 2), "12": "finished\n", "13": line.format(13, 1)})  # fmt: skip
    assert chain.jobs_from(logs, "10", []) == ["10", "11", "12"]  # type: ignore[arg-type]
    assert chain.jobs_from(logs, "12", []) == ["12"]  # type: ignore[arg-type]
    assert chain.jobs_from(logs, "13", []) == ["13"]  # type: ignore[arg-type]  # names itself: no loop
    assert chain.jobs_from(logs, "404", []) == ["404"]  # type: ignore[arg-type]


def test_the_run_of_a_continuation_is_read_bounded_and_checked(tmp_path: Path) -> None:
    (tmp_path / protocol.run_file("11")).write_text("10\n")
    (tmp_path / protocol.run_file("12")).write_text("../../etc\n")
    (tmp_path / protocol.run_file("13")).write_text("1" * 5000)
    assert [chain.run_of(tmp_path, job) for job in ("11", "12", "13", "14")] == ["10", "12", "13", "14"]


def test_a_cancel_while_the_continuation_is_submitted_cancels_it_too(fake: Path, conf: Path) -> None:
    """`ctrain cancel` of the old job while it submits its continuation (TERM to the batch shell): the
    continuation is cancelled at once, the run handed back, and nothing is requeued."""
    (fake / "sbatch-id").write_text("5151\n")
    commands = 'echo $$ >"$FAKE/term-pid"; ctrain_requeue_without --continue gpu002; echo "returned $?"'
    out = library(fake, commands, conf, CTRAIN_CONTINUE="1")
    assert ("ctrain: not requeueing: the job was cancelled (TERM) while its continuation, job 5151, was submitted: "
            "job 5151 is cancelled too") in out.stdout, out.stdout + out.stderr  # fmt: skip
    assert out.stdout.endswith("returned 1\n"), out.stdout
    assert calls(fake, "scancel") == ["scancel 5151"] and calls(fake, "scontrol requeue") == []
    assert holder(fake) == JOB


def test_after_slurms_term_a_lost_node_gets_no_continuation(fake: Path, conf: Path) -> None:
    """scancel (or preemption) came before the decision: Slurm decides; a continuation would bring back
    a run its user cancelled."""
    (fake / "sbatch-id").write_text("5151\n")
    out = library(fake, "CTRAIN_SIGNAL=TERM; ctrain_requeue_without --continue gpu002; echo returned $?", conf,
                  CTRAIN_CONTINUE="1")  # fmt: skip
    assert "ctrain: no continuation: Slurm's TERM came" in out.stdout and out.stdout.endswith("returned 1\n")
    assert calls(fake, "sbatch") == [] and calls(fake, "scontrol requeue") == []


def test_a_continuation_that_loses_a_node_too_continues_the_run_without_both(fake: Path, conf: Path) -> None:
    """Two faults in a row: the continuation (job 5151, gpu002 excluded) loses gpu003; the next one
    leaves out both, goes on with the same run at restart 2, and is handed the run by 5151."""
    (fake / "sbatch-id").write_text("6161\n")
    (fake / "excluded").write_text("gpu002\n")
    (fake / ".ctrain" / protocol.holder_file(JOB)).write_text("5151\n")
    out = library(fake, "ctrain_requeue_without --continue gpu003", conf, CTRAIN_CONTINUE="1", SLURM_JOB_ID="5151",
                  CTRAIN_CONTINUES=JOB, CTRAIN_RUN_RESTARTS="1", SLURM_JOB_NODELIST="gpu[001,003]")  # fmt: skip
    assert "ctrain: requeueing as job 6161 (restart 2 of run 4242) without gpu[002-003]: a continuation" in out.stdout
    assert "--exclude=gpu[002-003]" in calls(fake, "sbatch")[0].split()
    given = set((fake / "sbatch-env").read_text().splitlines())
    assert {"CTRAIN_RUN=4242", "CTRAIN_CONTINUES=5151", "CTRAIN_RUN_RESTARTS=2"} <= given, given
    assert holder(fake) == "after 5151"
    assert calls(fake, "scontrol update") == ["scontrol update JobId=5151 Requeue=0"]


class Run:
    """The job side of a Slurm client, made up: one run of three jobs (10, continued as 11, then 12),
    their logs and states; what was cancelled, and what follow printed."""

    LINE = "ctrain: requeueing as job {} (restart {} of run 10) without node2: a continuation\n"

    def __init__(self) -> None:
        self.logs = {"10": "a\n" + self.LINE.format(11, 1), "11": "b\n" + self.LINE.format(12, 2), "12": "c\n"}
        self.states = {"10": "FAILED", "11": "FAILED", "12": "RUNNING"}
        self.cancelled: list[str] = []

    def read_log(self, job_id: str, *, search: object) -> str:
        return self.logs[job_id]

    def job(self, job_id: str) -> object:
        from ctrain import slurm

        return slurm.Job(job_id, "sft", self.states[job_id])

    def cancel(self, job_id: str, *, signal: str | None = None) -> None:
        self.cancelled.append(job_id)

    def follow(self, job_id: str, *, emit: object, search: object) -> object:
        for line in self.logs[job_id].splitlines():
            emit(line)  # type: ignore[operator]
        return self.job(job_id)


def test_cancel_and_logs_follow_a_run_from_any_of_its_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ctrain.cli import main
    from ctrain.jobs import cli

    run = Run()
    monkeypatch.setattr(cli, "_client", lambda name: (run, [], None))
    cancelled = CliRunner().invoke(main, ["cancel", "10"])
    assert cancelled.exit_code == 0, cancelled.output
    assert run.cancelled == ["10", "12"]  # 11 has ended
    assert "job 12 (the run of job 10, continued): cancelled" in cancelled.output
    run.states["12"] = "COMPLETED"
    followed = CliRunner().invoke(main, ["logs", "-f", "10"])
    assert followed.exit_code == 0, followed.output
    lines = followed.output.splitlines()
    assert [lines[0], lines[2], lines[3], lines[5], lines[6]] == ["a", "job 10: the run goes on as job 11", "b",
                                                                  "job 11: the run goes on as job 12", "c"], lines
    assert lines[-1] == "job 12: COMPLETED"


def test_a_sweeps_task_continues_as_a_one_task_array_of_its_index_and_names_its_run(fake: Path,
                                                                                   conf: Path) -> None:  # fmt: skip
    """A task of a sweep (job 4242, task 2 of array 4240) that lost a node goes on as `--array=2` of the
    same script, so the continuation reads the same line of the sweep's table; as the task starts its
    run, .ctrain/4240_2.run names the run, which `ctrain results 4240` reads for that task."""
    (fake / "sbatch-id").write_text("5151\n")
    started = library(fake, "ctrain_hold && echo held", conf, SLURM_ARRAY_JOB_ID="4240", SLURM_ARRAY_TASK_ID="2",
                      CTRAIN_RUN=JOB, CTRAIN_PROJECT_DIR=str(fake))  # fmt: skip
    assert "held" in started.stdout, started.stdout + started.stderr
    assert chain.run_of(fake / ".ctrain", "4240_2") == JOB
    commands = "CTRAIN_ARGUMENTS=(recipes/sft.yaml) && ctrain_requeue_without --continue gpu002"
    out = library(fake, commands + " && echo requeued=1", conf, CTRAIN_CONTINUE="1", SLURM_JOB_NAME="sft",
                  SLURM_SUBMIT_DIR=str(fake), SLURM_ARRAY_JOB_ID="4240", SLURM_ARRAY_TASK_ID="2")  # fmt: skip
    assert "requeued=1" in out.stdout, out.stdout + out.stderr
    (submitted,) = calls(fake, "sbatch")
    assert " --job-name=sft --array=2 " in submitted, submitted
    given = (fake / "sbatch-env").read_text().splitlines()
    assert not [line for line in given if line.startswith("SLURM_ARRAY")], given  # the new array's own
