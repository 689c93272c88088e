"""Faults delivered the way a cluster delivers them, to 2-node Apptainer jobs on the testbed (one
training process per node).

- Slurm's TERM (``scontrol requeue``, as preemption and ``scancel`` send it), twice in one job:
  each time a complete checkpoint at the step the ranks were at, no Bus error (the image stays
  readable), and the requeued run resumes from that step.
- A rank that stops making progress (SIGSTOP): the job's watchdog names it and ends the step
  within the configured budget.
- A rank SIGKILLed on a live node: the step ends in seconds and the job is retried once, not twice.
- A node cut off the network, or frozen (its processes stopped), no connection closed either way: the
  watchdog's silence check asks every node, names the silent one lost and ends the step in about a minute.
- A node lost under a plain DDP loop of the user's own (``-- examples/ddp_loop.py``, no ctrain import):
  its step ends within a minute, as a recipe's does.
- A NaN loss (a failure no retry changes): the ranks' own exit records say so and the job ends at
  the first run, with the rank's error line in the log and in ``ctrain status``.
- A node lost (``Testbed.kill_node``: its slurmd and every process on it SIGKILLed): the batch
  script ends the step within a minute instead of srun waiting for Slurm to declare the node dead,
  and does not requeue the job onto it; a requeue with a node excluded runs on another.
- The batch host lost (node1, also the rendezvous node): the batch script dies with it; the
  sentinel on node2 decides in its place, within a minute, and ends the job. The same when node1
  dies slowly, its processes killed one by one in random order (``kill_node(over=...)``), after
  slurmctld was restarted mid-job (which decides nothing).
- The training step's srun killed alone on the batch host: named, retried once.
- The first two nodes of a 3-node job lost at once (the batch host and the first sentinel's
  node): the sentinel on the last node decides.

Each test prints ``reliability | ...`` lines with the figures docs/reliability.md records.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ctrain import protocol
from ctrain.cli import main
from ctrain.testbed import host
from ctrain.testbed.plan import CRED_EXPIRE_S
from tests.plugins.slurm import Project

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("leaves_testbed_clean")]

DEMO = "recipes/demo-addition.yaml"
JOB_TIMEOUT = 900
HANG_BUDGET = 20  # CTRAIN_HANG_TIMEOUT for the hang test, seconds (the default is 600)
NODE_CHECK = 30  # CTRAIN_NODE_CHECK's default: the silence after which every node is asked
# One training process per node: every fault here is a node's or a launcher's, and on 2 shared cores
# each process's start (the training stack's import) is most of what these jobs cost.
PER_NODE = 1
RANKS = 2 * PER_NODE
LAST = RANKS - 1  # the last rank, on node2: the one stopped or killed


def report(what: str, value: str) -> None:
    print(f"reliability | {what} | {value}")


def wait_until(what: str, condition, timeout: float, every: float = 0.2, detail=lambda: "") -> float:
    """Poll ``condition`` until it holds; the monotonic time at which it was seen to hold. ``detail()``
    goes into the message when it does not."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what} {detail()}"
        time.sleep(every)
    return time.monotonic()


def restarts(project: Project, job_id: str) -> int:
    record = project.testbed.slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
    return int(re.search(r"\bRestarts=(\d+)", record).group(1))


def batch_lines(project: Project, job_id: str) -> str:
    """What a failed assertion on a job's runs shows: the batch script's own lines of every run (not the
    ranks', which fill a log's tail with one traceback), then Slurm's record of the job."""
    own = [line for line in project.log(job_id).splitlines() if line.startswith("ctrain: ")]
    record = project.testbed.slurm.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    return "\n".join([*own[-200:], record])


def submit(project: Project, image: Path, name: str, *overrides: str, env: dict[str, str] | None = None) -> str:
    return project.sbatch(f"--ntasks-per-node={PER_NODE}", f"--job-name={name}", "sbatch/apptainer_multinode.sbatch",
                          DEMO, *overrides, f"training.output_dir=/outputs/{name}",
                          env={"IMAGE": str(image), **(env or {})})  # fmt: skip


class Runs:
    """The runs of one job that a test ends with a fault each: the next one let start once Slurm has
    requeued the job (as soon as the old run's credential has expired), then waited for until it trains."""

    def __init__(self, project: Project, job_id: str) -> None:
        self.project, self.job_id = project, job_id
        self.seen: frozenset[int] = frozenset()  # the earlier runs' ranks

    def start(self, restart: int, past: int) -> dict[int, tuple[int, str, int]]:
        """Let the job's ``restart``-th run start; its ranks' heartbeats once all are past step ``past``."""
        if restart:
            wait_until("Slurm's requeue", lambda: restarts(self.project, self.job_id) == restart, 120, every=1)
            self.project.testbed.slurm.run(["scontrol", "update", f"JobId={self.job_id}",
                                            f"StartTime=now+{CRED_EXPIRE_S + 2}"], check=False)  # fmt: skip
        beats = training(self.project, self.job_id, past=past, earlier=self.seen)
        self.seen |= {pid for _, _, pid in beats.values()}
        return beats


SILENCE_CHECK = 10  # CTRAIN_NODE_CHECK in the CI tier's fault job: its steps are well under a second


def test_faults_in_turn_each_checkpoint_resume_or_end_the_run(sbatch_project: Project, cpu_sif: Path) -> None:
    """One 2-node Apptainer job, a fault in each of its four runs, each answered as its own test does:
    1. Slurm's TERM (``scontrol requeue``, as preemption sends it): a complete checkpoint of the step
       the ranks were at, and Slurm's requeue;
    2. the time-limit warning (USR1 to the batch shell, as ``--signal=B:USR1@N`` sends it): a complete
       checkpoint of the warned step, and the batch script's requeue; that checkpoint is then damaged
       (its weights cut short, as an interrupted copy or a failing disk leaves them);
    3. the damaged checkpoint moved aside and the run resumed from the TERM's; a rank SIGKILLed on a
       live node: the step ends, the job is retried once;
    4. node2 cut off the network (no connection closed, every process running): the watchdog's silence
       check asks every node after CTRAIN_NODE_CHECK seconds, names node2 lost, and, no node being
       spare, ends the job instead of requeueing it onto node2.
    ``ctrain report`` then tells the four runs and their causes. The full tier also runs each fault as a
    job of its own (e.g. ``test_slurm_term_twice_checkpoints_at_the_signalled_step_and_resumes``)."""
    project = sbatch_project
    testbed = project.testbed
    name, steps = "faults", 5000
    output = f"/outputs/{name}"
    job_id = submit(project, cpu_sif, name, f"training.max_steps={steps}", "training.logging_steps=5",
                    "training.save_steps=100000", env={"CTRAIN_NODE_CHECK": str(SILENCE_CHECK)})  # fmt: skip
    run = Runs(project, job_id).start

    def checkpoints() -> list[int]:
        return [int(n) for n in re.findall(rf"checkpoint {output}/checkpoint-(\d+) complete", project.log(job_id))]

    run(0, past=10)
    sent = time.monotonic()
    testbed.slurm.run(["scontrol", "requeue", job_id])
    report("faults job: TERM: to checkpoint complete",
           f"{wait_until('the TERM checkpoint', lambda: len(checkpoints()) == 1, 120) - sent:.1f} s")  # fmt: skip
    term = checkpoints()[0]

    run(1, past=term + 5)
    sent = time.monotonic()
    testbed.slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
    report("faults job: USR1 warning: to checkpoint complete",
           f"{wait_until('the warned checkpoint', lambda: len(checkpoints()) == 2, 120) - sent:.1f} s")  # fmt: skip
    warned = checkpoints()[1]
    weights = project.path / "outputs" / name / f"checkpoint-{warned}" / "model.safetensors"
    with weights.open("r+b") as handle:  # cut short before the next run looks at it
        handle.truncate(weights.stat().st_size // 2)

    beats = run(2, past=term + 5)
    _, node, pid = beats[LAST]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    ended = wait_until("the step's end", lambda: project.log(job_id).count("step exited with") == 3, 60)
    report(f"faults job: SIGKILL of rank {LAST} on {node}: to the step's end", f"{ended - killed:.1f} s")

    run(3, past=term + 5)
    try:
        testbed.cut_node("node2")
        cut = time.monotonic()
        silent = wait_until("the silence check", lambda: "does not answer, asked twice (frozen" in project.log(job_id),
                            SILENCE_CHECK + 60)  # fmt: skip
        decided = wait_until("the decision", lambda: project.log(job_id).count("not requeueing") == 1, 60)
        report("faults job: node2 cut off: to every node asked and node2 silent", f"{silent - cut:.1f} s")
        report("faults job: node2 cut off: to the batch script's decision", f"{decided - cut:.1f} s")
    finally:
        testbed.reconnect_node("node2")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert state in ("FAILED", "NODE_FAIL"), f"job {job_id} ended {state}:\n{log[-6000:]}"
    runs = log.split("ctrain: job ")[1:]
    assert len(runs) == 4, batch_lines(project, job_id)
    assert "Bus error" not in log  # the image stayed readable through every fault
    pattern = rf"step (\d+)/{steps}, loss"

    term_run, warned_run, rank_run, silent_run = runs
    assert f"preemption (SIGTERM): saving a complete checkpoint at step {term}" in term_run
    assert "after SIGTERM" in term_run and "Slurm decides whether the job runs again" in term_run
    assert max(int(n) for n in re.findall(pattern, term_run)) <= term

    assert f"resuming from {output}/checkpoint-{term} " in warned_run
    assert min(int(n) for n in re.findall(pattern, warned_run)) > term
    assert f"preemption (SIGUSR1): saving a complete checkpoint at step {warned}" in warned_run
    assert "after SIGUSR1" in warned_run and f"ctrain: requeueing job {job_id}" in warned_run
    assert warned > term

    damaged = [line for line in rank_run.splitlines() if " is damaged (" in line]
    assert len(damaged) == 1, rank_run[-6000:]  # from rank 0 alone
    assert f"{output}/checkpoint-{warned} is damaged (model.safetensors: " in damaged[0]
    assert damaged[0].endswith(f"moved it to checkpoint-{warned}.damaged-size and falling back to checkpoint-{term}")
    assert f"resuming from {output}/checkpoint-{term} " in rank_run
    assert (project.path / "outputs" / name / f"checkpoint-{warned}.damaged-size").is_dir()
    assert "ctrain: failure: a rank failed on a live node: " in rank_run and "node lost" not in rank_run
    assert f"ctrain: requeueing job {job_id} once (restart 3)" in rank_run

    assert f"resuming from {output}/checkpoint-{term} " in silent_run
    assert re.search(r"^ctrain: no finished step for (\d+)s, and node2 does not answer, asked twice "
                     r"\(frozen, or cut off the network\): ending the step$", silent_run, re.MULTILINE), silent_run[-6000:]  # fmt: skip
    assert "ctrain: hang:" not in log
    not_requeued(silent_run, "node2")
    assert restarts(project, job_id) == 3
    assert silent - cut <= SILENCE_CHECK + 40, silent - cut  # the check's time, a poll and two 10 s probes

    told = CliRunner().invoke(main, ["report", job_id, "--json", "--timeline",
                                     str(project.path / ".ctrain" / f"{job_id}.timeline")])  # fmt: skip
    assert told.exit_code == 0, told.output
    account = json.loads(told.output)
    assert [r["cause"] for r in account["runs"]] == ["TERM", "USR1", "rank-failed", "node-lost"], account["runs"]
    # Nothing lost to the TERM; the warned run's steps after the TERM's checkpoint, lost with its damaged one.
    assert [r["lost_steps"] for r in account["runs"]][:2] == [0, warned - term], account["runs"]


@pytest.mark.full
def test_slurm_term_twice_checkpoints_at_the_signalled_step_and_resumes(sbatch_project: Project,
                                                                        cpu_sif: Path) -> None:  # fmt: skip
    """`scontrol requeue` mid-run, and again in the requeued run: each TERM ends in a complete checkpoint
    of the current step (not the last periodic one: there is none), and each run resumes from it.
    Full tier alone (TERM twice in one job, and its goodput); CI tier:
    test_faults_in_turn_each_checkpoint_resume_or_end_the_run (a TERM, a warning, and the report)."""
    project = sbatch_project
    steps = 120
    job_id = submit(project, cpu_sif, "term", f"training.max_steps={steps}", "training.logging_steps=5",
                    "training.save_steps=1000")  # fmt: skip
    pattern = rf"step (\d+)/{steps}, loss"
    for restart in (0, 1):
        # Mid-run: this run has logged a step (the first run at least 10, so it has trained since its start).
        def trained(restart: int = restart) -> bool:
            runs = project.log(job_id).split("ctrain: job ")
            return len(runs) == restart + 2 and any(int(n) >= 10 for n in re.findall(pattern, runs[-1]))

        wait_until(f"run {restart} to train", trained, JOB_TIMEOUT, every=0.5)
        sent = time.monotonic()
        project.testbed.slurm.run(["scontrol", "requeue", job_id])
        runs = restart + 1  # runs that have started so far; each TERM so far ended one
        saved = wait_until(
            "the checkpoint", lambda runs=runs: len(re.findall(r"checkpoint /outputs/term/checkpoint-\d+ complete",
                                                     project.log(job_id))) == runs, 120)  # fmt: skip
        ended = wait_until(
            "the step's end", lambda runs=runs: project.log(job_id).count("step exited with") == runs, 120
        )
        wait_until("Slurm's requeue", lambda runs=runs: restarts(project, job_id) == runs, 120, every=1)
        # Slurm holds a requeued job back; it may start once the old job's credential has expired.
        project.testbed.slurm.run(
            ["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{CRED_EXPIRE_S + 2}"], check=False
        )  # it may have started already: the testbed's credentials live 10 s
        resumed = wait_until("the first resumed step", lambda runs=runs: re.search(
            pattern, project.log(job_id).split("resuming from")[-1] if project.log(job_id).count("resuming from")
            == runs else ""), JOB_TIMEOUT)  # fmt: skip
        report(f"TERM {restart + 1}: to checkpoint complete", f"{saved - sent:.1f} s")
        report(f"TERM {restart + 1}: to the step's end", f"{ended - sent:.1f} s")
        report(f"TERM {restart + 1}: to the first resumed step", f"{resumed - sent:.1f} s")
    state = project.testbed.wait(job_id, timeout=JOB_TIMEOUT)
    log = project.log(job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{log[-6000:]}"
    runs = log.split("ctrain: job ")[1:]
    assert len(runs) == 3, batch_lines(project, job_id)
    # Each run starts from the image unpacked on the nodes' disk, the requeued ones without unpacking again.
    assert re.search(r"ctrain-image /\S+/ctrain-images-\d+/[0-9a-f]{16} apptainer exec ", runs[0]), runs[0][:3000]
    for run in runs[1:]:
        assert re.search(r"^ctrain: node\d: the image is cached in ", run, re.MULTILINE), run[:3000]
        assert " unpacked " not in run
    assert "Bus error" not in log  # the image stayed readable through both TERMs
    for number, (run, after) in enumerate(itertools.pairwise(runs), 1):
        stopped = int(re.search(r"preemption \(SIGTERM\): saving a complete checkpoint at step (\d+)", run).group(1))
        trained = [int(n) for n in re.findall(pattern, run)]
        assert f"checkpoint /outputs/term/checkpoint-{stopped} complete" in run
        assert "after SIGTERM" in run and "Slurm decides whether the job runs again" in run
        assert f"resuming from /outputs/term/checkpoint-{stopped} " in after
        resumed = [int(n) for n in re.findall(pattern, after)]
        # Nothing trained before the TERM is lost: the stop step is the newest step of that run.
        assert max(trained) <= stopped < min(resumed), (trained, stopped, resumed)
        report(f"TERM {number}: checkpoint at the signalled step, steps lost", f"{stopped}, 0")
    assert "saved the final model and tokenizer to /outputs/term/final" in runs[2]
    # The job's account of its time (ctrain report): three runs, two left on Slurm's TERM with
    # nothing lost (each checkpointed the step it was told to stop at), the third finished; rank 0
    # logged the same account at the end.
    told = CliRunner().invoke(main, ["report", job_id, "--json", "--timeline",
                                     str(project.path / ".ctrain" / f"{job_id}.timeline")])  # fmt: skip
    assert told.exit_code == 0, told.output
    account = json.loads(told.output)
    assert [(r["outcome"], r["cause"], r["lost_steps"]) for r in account["runs"]] == [
        ("left", "TERM", 0), ("left", "TERM", 0), ("finished", "none", 0)]  # fmt: skip
    assert [r["resumed_step"] for r in account["runs"]][1:] == [r["reached_step"] for r in account["runs"]][:2]
    assert 0 < account["goodput"] < 1 and account["seconds"]["training"] > 0 and account["seconds"]["queue"] > 0
    report("goodput of the job preempted twice (training that counted / wall)", f"{100 * account['goodput']:.1f}%")
    assert re.search(rf"goodput: job {job_id}: 3 run\(s\), ", runs[2]), runs[2][-3000:]


def test_stopped_rank_is_caught_within_the_budget(sbatch_project: Project, cpu_sif: Path) -> None:
    """SIGSTOP one worker of a 2-node job: the watchdog names that rank and its node, says it is
    stopped, and ends the step after CTRAIN_HANG_TIMEOUT seconds without progress; the job gets its
    one retry (cancelled here once requeued: the retry itself is the killed-rank test's)."""
    project = sbatch_project
    job_id = submit(project, cpu_sif, "hang", "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000", env={"CTRAIN_HANG_TIMEOUT": str(HANG_BUDGET)})  # fmt: skip
    beat = project.path / ".ctrain" / job_id / "heartbeat" / f"rank-{LAST}"

    def beating_past_step_5() -> bool:
        return beat.is_file() and int(beat.read_text().split()[0] or 0) >= 5

    wait_until(f"rank {LAST}'s heartbeat", beating_past_step_5, JOB_TIMEOUT, every=0.5)
    _, host, pid = beat.read_text().split()
    os.kill(int(pid), signal.SIGSTOP)
    stopped = time.monotonic()
    caught = wait_until("the watchdog", lambda: "ctrain: hang: " in project.log(job_id), 120)
    ended = wait_until("the requeue", lambda: restarts(project, job_id) == 1, 120, every=0.5)
    project.testbed.slurm.run(["scancel", job_id], check=False)
    log = project.log(job_id)
    line = re.search(rf"^ctrain: hang: rank {LAST} on {host} \(pid {pid}\): last step (\d+), no progress for (\d+)s, "
                     r"process state (\S+)$", log, re.MULTILINE)  # fmt: skip
    assert line, log[-6000:]
    assert line.group(3).startswith("T"), line.group(0)  # stopped, and said so
    assert f"ctrain: hang: not running (stopped, stuck in the kernel, or gone): rank {LAST} on {host}\n" in log
    assert int(line.group(2)) > HANG_BUDGET
    assert "ctrain: failure: a rank stopped making progress (the 'hang:' lines above)" in log
    assert f"ctrain: requeueing job {job_id} once (restart 1)" in log
    # The rank's last heartbeat came just before the stop: detection takes the budget, plus at most
    # a poll (budget / 10) and the time to ask the nodes for their processes' states.
    assert HANG_BUDGET - 2 <= caught - stopped <= HANG_BUDGET + 15, caught - stopped
    report(f"SIGSTOP of rank {LAST}: to the hang report",
           f"{caught - stopped:.1f} s (CTRAIN_HANG_TIMEOUT={HANG_BUDGET})")  # fmt: skip
    report(f"SIGSTOP of rank {LAST}: to the requeue", f"{ended - stopped:.1f} s")


def heartbeats(project: Project, job_id: str) -> dict[int, tuple[int, str, int]]:
    """Each rank's last heartbeat: rank -> (step, host, pid)."""
    beats = {}
    for path in (project.path / ".ctrain" / job_id / "heartbeat").glob("rank-*"):
        fields = path.read_text().split()
        if len(fields) == 3:
            beats[int(path.name.removeprefix("rank-"))] = (int(fields[0] or 0), fields[1], int(fields[2]))
    return beats


def training(project: Project, job_id: str, past: int = 5, earlier: frozenset[int] = frozenset()
             ) -> dict[int, tuple[int, str, int]]:  # fmt: skip
    """Wait until all ranks of this run have finished step ``past``; their heartbeats. ``earlier``:
    the PIDs of an earlier run of the job, whose heartbeats a retry finds until its batch script
    clears them (that happens after the retry has logged its start)."""

    def ready() -> bool:
        beats = heartbeats(project, job_id)
        return (len(beats) == RANKS and min(step for step, _, _ in beats.values()) >= past
                and not {pid for _, _, pid in beats.values()} & earlier)  # fmt: skip

    wait_until(f"{RANKS} ranks past step {past}", ready, JOB_TIMEOUT, every=0.5,
               detail=lambda: str(heartbeats(project, job_id)))  # fmt: skip
    return heartbeats(project, job_id)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def not_requeued(log: str, lost: str, needs: int = 2) -> None:
    """The job lost ``lost`` on a testbed with no node to spare: one failure line, and the decision
    not to requeue, naming the node(s) to wait for."""
    assert log.count("ctrain: failure:") == 1, log[-6000:]
    assert (f"not requeueing: partition debug has 1 node(s) in service besides {lost}, the job needs {needs}; "
            f"submit it again once ") in log, log[-6000:]  # fmt: skip


def alive(pid: int) -> bool:
    info = host.proc_info(pid)
    return info is not None and info.state not in ("Z", "X")


@pytest.mark.full
def test_killed_rank_on_a_live_node_is_retried_once(sbatch_project: Project, cpu_sif: Path) -> None:
    """SIGKILL one worker (its node stays up), in the first run and again in the retry: the step ends
    within seconds, the log says a rank failed on a live node, the job is requeued once, then not again.
    Full tier alone; CI tier: test_faults_in_turn_each_checkpoint_resume_or_end_the_run (a rank killed, retried
    once) and test_a_failed_rank_is_retried_once_per_job (not twice)."""
    project = sbatch_project
    job_id = submit(project, cpu_sif, "rank", "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000")  # fmt: skip
    earlier: frozenset[int] = frozenset()
    for restart in (0, 1):
        if restart:
            requeued = wait_until("the requeue", lambda: restarts(project, job_id) == 1, 120, every=0.5)
            report(f"SIGKILL of rank {LAST} (run 1): to the requeue", f"{requeued - killed:.1f} s")
            project.testbed.slurm.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{CRED_EXPIRE_S + 2}"],
                                  check=False)  # fmt: skip
            wait_until("the retry to start", lambda: project.log(job_id).count("ctrain: job ") == 2, JOB_TIMEOUT)
        beats = training(project, job_id, earlier=earlier)
        _, node, pid = beats[LAST]
        others = [p for _, _, p in beats.values() if p != pid]
        earlier = frozenset(p for _, _, p in beats.values())
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        gone = wait_until("the other ranks to end", lambda: not any(alive(p) for p in others), 60)
        ended = wait_until("the step's end", lambda: project.log(job_id).count("step exited with") == restart + 1, 60)
        report(f"SIGKILL of rank {LAST} on {node} (run {restart + 1}): to the last rank gone", f"{gone - killed:.1f} s")
        report(f"SIGKILL of rank {LAST} on {node} (run {restart + 1}): to the step's end", f"{ended - killed:.1f} s")
        assert ended - killed <= 60
    state = project.testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert state == "FAILED", f"job {job_id} ended {state}:\n{log[-6000:]}"
    first, second = log.split("ctrain: job ")[1:]
    for run in (first, second):
        assert "ctrain: failure: a rank failed on a live node: " in run, run[-4000:]
        assert "node lost" not in run
    assert f"ctrain: requeueing job {job_id} once (restart 1)" in first
    assert "not requeueing: the job was already retried once after a failed or hung rank" in second
    assert restarts(project, job_id) == 1
    assert not (project.path / ".ctrain" / f"{job_id}.retried").exists()
    status = CliRunner().invoke(main, ["status", job_id])  # the same story, without reading the log
    assert re.search(rf"^{job_id}\s+\S+\s+FAILED\s", status.output, re.MULTILINE), status.output
    assert f"job {job_id}: failure: a rank failed on a live node: " in status.output, status.output
    assert f"job {job_id}: not requeueing: the job was already retried once" in status.output, status.output


def test_a_nan_loss_ends_the_job_at_once_with_the_ranks_own_error(sbatch_project: Project, cpu_sif: Path) -> None:
    """torchrun reports the NaN stop (exit 65) as exit 1, like a killed worker; the ranks' records say
    `nonfinite`, so the job ends after its first run instead of queueing a retry that diverges again."""
    project = sbatch_project
    started = time.monotonic()
    job_id = submit(project, cpu_sif, "nan", "training.max_steps=40", "training.save_steps=5",
                    "training.logging_steps=100", "training.learning_rate=1e30")  # fmt: skip
    state = project.testbed.wait(job_id, timeout=JOB_TIMEOUT)
    ended = time.monotonic()
    log = project.log(job_id)
    assert state == "FAILED", f"job {job_id} ended {state}:\n{log[-6000:]}"
    assert log.count("ctrain: job ") == 1 and restarts(project, job_id) == 0, log[-4000:]
    pattern = r"^ctrain: failure: rank (\d) on (node\d) ended with 65 \(nonfinite\): step 5: \w+ -?(?:nan|inf)\b"
    failure = re.search(pattern, log, re.MULTILINE)
    assert failure, log[-4000:]
    assert "ctrain: not requeueing: a nonfinite failure repeats on a retry" in log
    assert "a rank failed on a live node" not in log and "requeueing job" not in log
    assert not (project.path / ".ctrain" / f"{job_id}.retried").exists()
    status = CliRunner().invoke(main, ["status", job_id])
    assert f"job {job_id}: failure: rank {failure[1]} on {failure[2]} ended with 65 (nonfinite)" in status.output, (
        status.output)  # fmt: skip
    assert f"job {job_id}: not requeueing: a nonfinite failure" in status.output, status.output
    report("NaN loss at step 5 (2 nodes): submit to the job's end, no retry", f"{ended - started:.1f} s")


@pytest.mark.full
def test_lost_node_ends_the_step_within_a_minute(sbatch_project: Project, cpu_sif: Path) -> None:
    """Kill node2 as a power cut would (its slurmd and every process on it): the batch script on node1
    ends the step within 60 s (srun would wait for Slurm to declare node2 dead), names node2 as lost,
    and, the testbed having no other node, ends the job saying so instead of requeueing it onto node2.
    Full tier alone; CI tier: test_through_pyxis_faults_behave_as_under_apptainer (node2 killed under the same
    batch script)."""
    project = sbatch_project
    testbed = project.testbed
    job_id = submit(project, cpu_sif, "lost", "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000")  # fmt: skip
    beats = training(project, job_id)
    survivors = [pid for _, node, pid in beats.values() if node == "node1"]
    launcher = int((project.path / ".ctrain" / job_id / "node1.pid").read_text())
    assert len(survivors) == PER_NODE, beats
    try:
        count = testbed.kill_node("node2")
        killed = time.monotonic()
        gone = wait_until("node1's launcher and ranks to end", lambda: not any(map(alive, [*survivors, launcher])), 60)
        guarded = wait_until("the guard", lambda: "does not answer: ending the step" in project.log(job_id), 90)
        ended = wait_until("the step's end", lambda: "step exited with" in project.log(job_id), 90)
        decided = wait_until("the decision", lambda: "not requeueing" in project.log(job_id), 30)
        report("node2 killed: processes killed", str(count))
        report("node2 killed: to node1's launcher and ranks gone", f"{gone - killed:.1f} s")
        report("node2 killed: to the batch script ending the step", f"{guarded - killed:.1f} s")
        report("node2 killed: to the step's end", f"{ended - killed:.1f} s")
        report("node2 killed: to the batch script's decision", f"{decided - killed:.1f} s")
    finally:
        testbed.start_node("node2")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert ended - killed <= 60, log[-6000:]
    assert "ctrain: failure: node lost: node2 (its launcher never ended and its slurmd does not answer)" in log
    not_requeued(log, "node2")
    assert state in ("FAILED", "NODE_FAIL"), f"job {job_id} ended {state}:\n{log[-6000:]}"
    assert restarts(project, job_id) == 0


# How a node goes silent without failing anything, and how the testbed undoes it.
SILENT = {"cut off the network": ("cut_node", "reconnect_node"), "frozen": ("freeze_node", "thaw_node")}


@pytest.mark.full
@pytest.mark.parametrize("fault", SILENT)
def test_a_silent_node_ends_the_step_within_a_minute(sbatch_project: Project, cpu_sif: Path, fault: str) -> None:
    """node2 cut off the network (``Testbed.cut_node``: its link down, its processes running) or frozen
    (``Testbed.freeze_node``: every process on it, slurmd included, SIGSTOPped), no connection closed
    either way: no launcher fails and every rank just waits in its collective, which would last until
    torch.distributed's 30 min timeout, or the hang watchdog's 600 s. The watchdog's silence check sees
    it instead: CTRAIN_NODE_CHECK (30 s) after the last finished step every node is asked, node2 does
    not answer, twice, and the step ends as for a killed node, in about a minute, with node2 named lost.
    Full tier alone (both ways, at the default CTRAIN_NODE_CHECK); CI tier:
    test_faults_in_turn_each_checkpoint_resume_or_end_the_run (node2 cut off)."""
    project = sbatch_project
    testbed = project.testbed
    inject, undo = (getattr(testbed, name) for name in SILENT[fault])
    name = fault.split()[0]
    job_id = submit(project, cpu_sif, name, "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000")  # fmt: skip
    beats = training(project, job_id)
    survivors = [pid for _, node, pid in beats.values() if node == "node1"]
    assert len(survivors) == PER_NODE, beats
    try:
        inject("node2")
        silenced = time.monotonic()
        silent = wait_until("the silence check", lambda: "does not answer, asked twice (frozen" in project.log(job_id),
                            NODE_CHECK + 60)  # fmt: skip
        ended = wait_until("the step's end", lambda: "step exited with" in project.log(job_id), 60)
        decided = wait_until("the decision", lambda: "not requeueing" in project.log(job_id), 30)
        gone = wait_until("node1's ranks to end", lambda: not any(map(alive, survivors)), 30)
        report(f"node2 {fault}: to every node asked and node2 silent", f"{silent - silenced:.1f} s")
        report(f"node2 {fault}: to the step's end", f"{ended - silenced:.1f} s")
        report(f"node2 {fault}: to the batch script's decision", f"{decided - silenced:.1f} s")
        report(f"node2 {fault}: to node1's ranks gone", f"{gone - silenced:.1f} s")
    finally:
        undo("node2")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert re.search(r"^ctrain: no finished step for (\d+)s, and node2 does not answer, asked twice "
                     r"\(frozen, or cut off the network\): ending the step$", log, re.MULTILINE), log[-6000:]  # fmt: skip
    assert "ctrain: failure: node lost: node2 (" in log
    assert "ctrain: hang:" not in log  # a silent node, not a hang: it is named, and left out of a requeue
    not_requeued(log, "node2")
    assert state in ("FAILED", "NODE_FAIL"), f"job {job_id} ended {state}:\n{log[-6000:]}"
    # The last heartbeat came at most a step before the fault: the silence takes the check's time, plus
    # a poll (a tenth of it) and two probes (10 s each).
    assert NODE_CHECK - 2 <= silent - silenced <= NODE_CHECK + 30, silent - silenced
    assert ended - silenced <= 65, log[-6000:]


@pytest.mark.full
def test_a_lost_node_ends_a_plain_ddp_loop_of_your_own_within_a_minute(sbatch_project: Project,
                                                                      cpu_sif: Path) -> None:  # fmt: skip
    """examples/ddp_loop.py imports nothing of ctrain and writes no heartbeat: node2's loss is still
    seen by the batch script (node1's launcher fails, node2 does not answer) and the step ends.
    Full tier alone; CI tier: test_through_pyxis_faults_behave_as_under_apptainer (the guard, which reads no
    heartbeat, ends a killed node's step)."""
    project = sbatch_project
    testbed = project.testbed
    job_id = project.sbatch(f"--ntasks-per-node={PER_NODE}", "--job-name=ddp", "sbatch/apptainer_multinode.sbatch",
                            "--", "examples/ddp_loop.py", "--steps", "1000000", "--step_seconds", "0.05",
                            env={"IMAGE": str(cpu_sif)})  # fmt: skip
    project.wait_for_log(job_id, r"^0: step 40/1000000 loss [0-9.]+ on 2 processes$", timeout=JOB_TIMEOUT)
    try:
        testbed.kill_node("node2")
        killed = time.monotonic()
        ended = wait_until("the step's end", lambda: "step exited with" in project.log(job_id), 90)
        report("node2 killed under a plain DDP loop (-- SCRIPT): to the step's end", f"{ended - killed:.1f} s")
    finally:
        testbed.start_node("node2")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert "your command: examples/ddp_loop.py --steps 1000000 --step_seconds 0.05 (rendezvous " in log
    assert ended - killed <= 60, log[-6000:]
    assert "ctrain: failure: node lost: node2 (its launcher never ended and its slurmd does not answer)" in log
    assert state in ("FAILED", "NODE_FAIL"), f"job {job_id} ended {state}:\n{log[-6000:]}"


@pytest.mark.full
def test_lost_batch_host_is_decided_from_another_node(sbatch_project: Project, cpu_sif: Path) -> None:
    """Kill node1, the batch host and rendezvous node: the batch script dies with it, so the sentinel
    on node2 sees its heartbeat stop, confirms node1 does not answer, and decides within 60 s what the
    batch script would have (no other node: not requeued), then ends the job instead of leaving it
    RUNNING with no trainer until Slurm declares node1 dead, or requeued and waiting for node1.
    Full tier alone; CI tier: test_the_sentinel_decides_a_job_slurm_ended_before_its_batch_script_decided (the
    sentinel's decision, Slurm's commands faked)."""
    project = sbatch_project
    testbed = project.testbed
    job_id = submit(project, cpu_sif, "batchhost", "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000")  # fmt: skip
    beats = training(project, job_id)
    survivors = [pid for _, node, pid in beats.values() if node == "node2"]
    assert len(survivors) == PER_NODE and testbed.slurm.job(job_id).where == "node[1-2]", beats
    try:
        count = testbed.kill_node("node1")
        killed = time.monotonic()
        gone = wait_until("node2's ranks to end", lambda: not any(map(alive, survivors)), 60,
                          detail=lambda: f"{[host.proc_info(pid) for pid in survivors]}\n{project.log(job_id)[-3000:]}")
        lost = wait_until("the sentinel", lambda: "node lost: node1 (the batch host" in project.log(job_id), 90)
        decided = wait_until("the decision", lambda: "not requeueing" in project.log(job_id), 30)
        ended = wait_until("the job's end", lambda: testbed.job_state(job_id) != "RUNNING", 60, every=0.5)
        report("node1 (batch host) killed: processes killed", str(count))
        report("node1 (batch host) killed: to node2's ranks gone", f"{gone - killed:.1f} s")
        report("node1 (batch host) killed: to the sentinel naming it", f"{lost - killed:.1f} s")
        report("node1 (batch host) killed: to the decision", f"{decided - killed:.1f} s")
        report("node1 (batch host) killed: to the job leaving RUNNING", f"{ended - killed:.1f} s")
    finally:
        testbed.start_node("node1")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert decided - killed <= 60, log[-6000:]
    # Which sign came first: Slurm ending the sentinel's step (its srun ran on node1) or the heartbeat's grace.
    assert re.search(r"ctrain: failure: node lost: node1 \(the batch host: (Slurm ended the sentinel's step, whose "
                     r"srun ran there,|no heartbeat for 10s) and its slurmd does not answer; seen from node2\)",
                     log), log[-6000:]  # fmt: skip
    not_requeued(log, "node1")
    assert f"ctrain: ending job {job_id} (scancel): its batch script was lost with node1" in log
    assert state == "CANCELLED", f"job {job_id} ended {state}:\n{log[-6000:]}"
    assert restarts(project, job_id) == 0
    assert not (project.path / ".ctrain" / job_id).exists()
    status = CliRunner().invoke(main, ["status", job_id])
    assert f"job {job_id}: failure: node lost: node1 (the batch host" in status.output, status.output
    assert f"job {job_id}: not requeueing: partition debug has 1 node(s)" in status.output, status.output


@pytest.mark.full
def test_batch_host_dying_slowly_is_decided_whatever_dies_first(sbatch_project: Project, cpu_sif: Path) -> None:
    """node1 (the batch host) dies over 2 s, its processes SIGKILLed one by one in random order,
    slurmd among them (an out-of-memory cascade looks like this): srun, the guard, the heartbeat and
    the batch script go in any order, and slurmd may report the batch script's death first (Slurm
    then ends the job with nothing decided). Whichever way, within 60 s the job has left RUNNING,
    one failure line names node1, and the decision is the documented one (no other node: not
    requeued), never PENDING for the dead node. Before that, slurmctld is restarted mid-job (5 s
    without a controller): the run trains on and nothing is decided.
    Full tier alone; CI tier: test_a_probe_killed_under_it_names_the_dying_batch_host_not_the_node_it_asked
    (Slurm's commands faked)."""
    project = sbatch_project
    testbed = project.testbed
    job_id = submit(project, cpu_sif, "slowdeath", "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000")  # fmt: skip
    beats = training(project, job_id)
    restarted = time.monotonic()
    testbed.restart_controller(down=5)
    back = time.monotonic()
    training(project, job_id, past=max(step for step, _, _ in beats.values()) + 20)
    trains = time.monotonic()
    report("slurmctld restarted mid-job (5 s down): to the controller answering", f"{back - restarted:.1f} s")
    report("slurmctld restarted mid-job (5 s down): to 20 more steps on every rank", f"{trains - restarted:.1f} s")
    assert "ctrain: failure" not in project.log(job_id) and testbed.job_state(job_id) == "RUNNING"
    assert restarts(project, job_id) == 0
    try:
        count = testbed.kill_node("node1", over=2.0, seed=int(job_id))
        killed = time.monotonic()
        ended = wait_until("the job's end", lambda: testbed.job_state(job_id) != "RUNNING", 60, every=0.5)
        decided = wait_until("the decision", lambda: "not requeueing" in project.log(job_id), 60)
        report("node1 (batch host) dying over 2 s: processes killed", str(count))
        report("node1 (batch host) dying over 2 s: to the job leaving RUNNING", f"{ended - killed:.1f} s")
        report("node1 (batch host) dying over 2 s: to the decision", f"{decided - killed:.1f} s")
    finally:
        testbed.start_node("node1")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert ended - killed <= 60 and decided - killed <= 60, log[-6000:]
    assert re.search(r"^ctrain: failure: node lost: node1 \((its launcher never ended|the batch host: [^)]+) and its "
                     r"slurmd does not answer", log, re.MULTILINE), log[-6000:]  # fmt: skip
    not_requeued(log, "node1")
    assert state in ("FAILED", "CANCELLED"), f"job {job_id} ended {state}:\n{log[-6000:]}"
    assert restarts(project, job_id) == 0


@pytest.mark.full  # a 3-node testbed for one test: about a minute more
def test_the_first_two_nodes_lost_together_are_decided_by_the_last_nodes_sentinel(sbatch_project: Project,
                                                                                   cpu_sif: Path) -> None:  # fmt: skip
    """A 3-node job (a 3-node testbed for this test only) loses node1, the batch host, and node2,
    which runs the first sentinel, at once (one switch, one power feed): the sentinel on node3
    names both within 60 s and, with no other node to run on, ends the job.
    Full tier alone; CI tier: test_the_last_nodes_sentinel_decides_when_the_first_two_nodes_are_lost (Slurm's
    commands faked)."""
    project = sbatch_project
    testbed = project.testbed
    testbed.down()
    testbed.up(3)
    try:
        job_id = project.sbatch("--nodes=3", f"--ntasks-per-node={PER_NODE}", "--job-name=twolost",
                                "sbatch/apptainer_multinode.sbatch", DEMO, "training.max_steps=5000",
                                "training.logging_steps=5", "training.save_steps=100000",
                                "training.output_dir=/outputs/twolost", "training.global_batch_size=48",
                                env={"IMAGE": str(cpu_sif)})  # fmt: skip
        wait_until("3 ranks past step 5", lambda: len(beats := heartbeats(project, job_id)) == 3
                   and min(step for step, _, _ in beats.values()) >= 5, JOB_TIMEOUT, every=0.5)  # fmt: skip
        assert testbed.slurm.job(job_id).where == "node[1-3]"
        try:
            testbed.kill_node("node1")
            testbed.kill_node("node2")
            killed = time.monotonic()
            decided = wait_until("the decision", lambda: "not requeueing" in project.log(job_id), 60)
            ended = wait_until("the job's end", lambda: testbed.job_state(job_id) != "RUNNING", 30, every=0.5)
            report("node1 (batch host) and node2 (first sentinel) killed at once, 3 nodes: to the decision",
                   f"{decided - killed:.1f} s")  # fmt: skip
            report("node1 and node2 killed at once, 3 nodes: to the job leaving RUNNING", f"{ended - killed:.1f} s")
        finally:
            testbed.start_node("node1")
            testbed.start_node("node2")
        state = testbed.wait(job_id, timeout=120)
        log = project.log(job_id)
        assert re.search(r"^ctrain: failure: node lost: node1 node2 \(the batch host and node2: [^)]+ and their slurmds "
                         r"do not answer; seen from node3\)$", log, re.MULTILINE), log[-6000:]  # fmt: skip
        not_requeued(log, "node[1-2]", needs=3)
        assert state == "CANCELLED", f"job {job_id} ended {state}:\n{log[-6000:]}"
    finally:
        testbed.down()
        testbed.up(2)


RECOVERY_BUDGET = 90  # seconds from a lost node to the run training again on healthy nodes

# The faults a run recovers from on a 3-node testbed: (the node, how it is lost, how it comes back, the
# continuation's nodes). The batch host's loss is decided by the sentinel on node2; the silent node's
# after CTRAIN_NODE_CHECK seconds without a step (its default, 30 s), when it does not answer.
RECOVERED = {
    "node2 killed": ("node2", "kill_node", "start_node", "node[1,3]"),
    "node1 killed (the batch host)": ("node1", "kill_node", "start_node", "node[2-3]"),
    "node2 cut off the network": ("node2", "cut_node", "reconnect_node", "node[1,3]"),
    "requeue-baseline": ("node2", "kill_node", "start_node", "node[1,3]"),
}


@pytest.mark.full  # a 3-node testbed for each: about a minute more
@pytest.mark.parametrize("fault", RECOVERED)
def test_a_lost_nodes_run_trains_again_on_the_healthy_nodes_within_90_s(sbatch_project: Project, cpu_sif: Path,
                                                                        fault: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """3 nodes, a 2-node job on node1 and node2, a checkpoint every 25 steps; a node lost with Slurm's
    default SlurmdTimeout (300 s), so Slurm holds the job on it for minutes. The run goes on as a new
    job, its continuation, on the other two nodes: its first step within RECOVERY_BUDGET seconds of the
    kill (a silent node: CTRAIN_NODE_CHECK more), resumed from the last complete checkpoint, to the end;
    the old job, run again by Slurm, finds the run held and does not train; ``ctrain status`` of the
    first job follows the run to the continuation, and ``ctrain report`` of either tells one run, the
    lost node its cause. The requeue-baseline (CTRAIN_CONTINUE=0) is the requeue as it was, measured in
    the same session.
    Full tier alone; CI tier: test_a_lost_node_continues_the_run_as_a_new_job_without_it and
    test_a_run_is_held_by_one_job_the_continuation_takes_it_and_the_old_job_is_refused (Slurm's commands faked)."""
    project = sbatch_project
    testbed = project.testbed
    node, lose, restore, healthy = RECOVERED[fault]
    continuing = fault != "requeue-baseline"
    budget = RECOVERY_BUDGET + (NODE_CHECK if lose == "cut_node" else 0)
    testbed.down()
    testbed.up(3)
    try:
        name, steps, every = re.sub(r"[^a-z0-9]+", "-", fault).strip("-"), 400, 25
        output = f"/outputs/{name}"
        try:
            job_id = submit(project, cpu_sif, name, f"training.max_steps={steps}", "training.logging_steps=5",
                            f"training.save_steps={every}", env={"CTRAIN_CONTINUE": "1" if continuing else "0"})  # fmt: skip
            beats = training(project, job_id, past=3 * every + 5)
            assert testbed.slurm.job(job_id).where == "node[1-2]"
            getattr(testbed, lose)(node)
            lost = time.monotonic()
            at_loss = min(step for step, _, _ in beats.values())
            complete = [int(n) for n in re.findall(rf"checkpoint {output}/checkpoint-(\d+) complete", project.log(job_id))]
            decided = wait_until("the decision", lambda: "ctrain: requeueing" in project.log(job_id), budget)
            log = project.log(job_id)
            later = protocol.continued_as(log) if continuing else job_id
            assert later is not None, batch_lines(project, job_id)
            if not continuing:
                wait_until("Slurm's requeue", lambda: restarts(project, job_id) == 1, 600, every=1)
            before = {pid for _, _, pid in beats.values()}  # the lost run's ranks, whose heartbeats a requeue finds

            def again() -> bool:
                now = heartbeats(project, later)
                return (len(now) == RANKS and not {pid for _, _, pid in now.values()} & before
                        and min(step for step, _, _ in now.values()) > max(complete))  # fmt: skip

            first = wait_until("the run training again", again, 600, every=0.5)
            how = "a continuation" if continuing else "the requeue (CTRAIN_CONTINUE=0)"
            report(f"3 nodes, a 2-node job, {fault}, {how}: to the decision", f"{decided - lost:.1f} s")
            report(f"3 nodes, a 2-node job, {fault}, {how}: to the run's first step again", f"{first - lost:.1f} s")
            assert testbed.slurm.job(later).where == healthy
            state = testbed.wait(later, timeout=600)
        finally:
            getattr(testbed, restore)(node)
        later_log = project.log(later)
        assert state == "COMPLETED", f"job {later} ended {state}:\n{batch_lines(project, later)}"
        resumed = re.findall(rf"resuming from {output}/checkpoint-(\d+) ", later_log)
        assert resumed and int(resumed[-1]) == max(complete), (resumed, complete)  # lost: the steps since it
        report(f"3 nodes, a 2-node job, {fault}: steps lost (those since the last complete checkpoint)",
               str(at_loss - max(complete)))  # fmt: skip
        if not continuing:
            assert first - lost > RECOVERY_BUDGET  # what the continuation is for: Slurm held the job on node2
            return
        assert first - lost <= budget, batch_lines(project, later)
        assert f"(restart 1 of run {job_id}) without {node}: a continuation" in log
        assert f"ctrain: job {later} '{name}' restart 1 (run {job_id}, continuing job {job_id})" in later_log
        assert restarts(project, job_id) == 0
        assert (project.path / ".ctrain" / f"{job_id}.holder").read_text().strip() == later
        monkeypatch.chdir(project.path)  # where `ctrain status` and `report` are run: the project
        status = CliRunner().invoke(main, ["status", job_id])
        assert re.search(rf"^\s*{later}\b.*COMPLETED", status.output, re.MULTILINE), status.output
        assert f"job {job_id}: requeueing as job {later} (restart 1 of run {job_id})" in status.output, status.output
        for asked in (job_id, later):
            told = CliRunner().invoke(main, ["report", asked, "--json"], catch_exceptions=False)
            assert told.exit_code == 0, told.output
            account = json.loads(told.output)
            assert [r["cause"] for r in account["runs"]] == ["node-lost", "none"], account["runs"]
            assert account["runs"][1]["reached_step"] == steps and account["runs"][0]["reached_step"] < steps
        # Slurm does not requeue the old job after the node failure; a job of the same run that starts all
        # the same (the old job's script submitted again, as run R) finds the run held and trains nothing.
        testbed.wait(job_id, timeout=120)
        record = testbed.slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
        assert " Requeue=0 " in record and " Restarts=0 " in record, record
        stray = submit(project, cpu_sif, name, f"training.max_steps={steps}", env={"CTRAIN_RUN": job_id})
        assert testbed.wait(stray, timeout=300) == "COMPLETED"
        refused = project.log(stray)
        assert f"ctrain: not running: run {job_id} is held by {later} " in refused, refused[-3000:]
        assert "step exited" not in refused and "ctrain: preflight" not in refused
    finally:
        testbed.down()
        testbed.up(2)


@pytest.mark.full
def test_the_steps_srun_killed_alone_is_named_and_retried_once(sbatch_project: Project, cpu_sif: Path) -> None:
    """SIGKILL of the training step's srun on the batch host, nothing else: the batch script sees the
    step end with 137 while every launcher still runs and no rank recorded anything. It waits
    CTRAIN_SETTLE, finds every node answering, says so in one failure line and retries once.
    Full tier alone; CI tier: test_a_step_that_failed_with_no_cause_on_live_nodes_is_retried_once (Slurm's
    commands faked)."""
    project = sbatch_project
    testbed = project.testbed
    job_id = submit(project, cpu_sif, "srunkill", "training.max_steps=5000", "training.logging_steps=5",
                    "training.save_steps=100000")  # fmt: skip
    training(project, job_id)
    node1 = next(n for n in testbed.nodes if n.name == "node1")
    sruns = [pid for pid in host.netns_pids(node1.netns)
             if (info := host.proc_info(pid)) and info.cmdline.startswith("srun --label ")]  # fmt: skip
    # srun forks a helper of its own: the step's srun is the one whose parent is the batch script.
    sruns = [pid for pid in sruns if _parent(pid) not in sruns]
    assert len(sruns) == 1, [host.proc_info(pid) for pid in host.netns_pids(node1.netns)]
    os.kill(sruns[0], signal.SIGKILL)
    killed = time.monotonic()
    requeued = wait_until("the requeue", lambda: restarts(project, job_id) == 1, 60, every=0.5)
    report("the step's srun SIGKILLed on the batch host: to the retry's requeue", f"{requeued - killed:.1f} s")
    testbed.slurm.run(["scancel", job_id])
    testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert "ctrain: step exited with 137\n" in log
    assert log.count("ctrain: failure:") == 1, log[-6000:]
    assert ("ctrain: failure: the training step ended with 137 and no node or rank said why (its srun or launchers "
            "were killed, e.g. out of memory); every node answers") in log  # fmt: skip
    assert f"ctrain: requeueing job {job_id} once (restart 1)" in log


def test_requeue_without_a_lost_node_runs_on_another(sbatch_project: Project) -> None:
    """The lost-node requeue against the real Slurm: a 1-node job that declares its own node lost is
    requeued with that node in ExcNodeList (set after the requeue, which TERMs the batch shell, while
    the job is pending again), and its second run starts on the other node."""
    project = sbatch_project
    script = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --job-name=exclude
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
source "$SLURM_SUBMIT_DIR/sbatch/lib/ctrain.sh" || exit 2
CTRAIN_NNODES=1 CTRAIN_MAX_REQUEUES=10
echo "run ${SLURM_RESTART_COUNT:-0} on $SLURMD_NODENAME"
[[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]] || ctrain_requeue_without "$SLURMD_NODENAME"
"""
    job_id = project.sbatch(script_text=script)
    wait_until("the requeue", lambda: restarts(project, job_id) == 1, 60, every=0.5)
    project.testbed.slurm.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{CRED_EXPIRE_S + 2}"], check=False)
    state = project.testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    runs = re.findall(r"^run (\d) on (\S+)$", log, re.MULTILINE)
    assert state == "COMPLETED" and len(runs) == 2, log
    (_, first), (_, second) = runs
    assert second != first, log
    assert f"ctrain: requeueing job {job_id} (restart 1) without {first} (ExcNodeList)" in log
    record = project.testbed.slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
    assert f"ExcNodeList={first} " in record, record


# Through pyxis, a fault in each run of one job. The CI tier runs the TERM and the lost node (each run
# through pyxis unpacks the image again, about 45 s); the full tier all four.
PYXIS_FAULTS = [
    pytest.param(("term", "node"), id="term-node"),
    pytest.param(("term", "rank", "warn", "node"), id="all", marks=pytest.mark.full),
]


@pytest.mark.parametrize("faults", PYXIS_FAULTS)
def test_through_pyxis_faults_behave_as_under_apptainer(sbatch_project: Project, cpu_sqsh: Path,
                                                        faults: tuple[str, ...]) -> None:  # fmt: skip
    """One job of `ctrain submit --runtime pyxis` (real pyxis and enroot), a fault in each run: Slurm's
    TERM reaches the ranks in their containers, which checkpoint the signalled step; a SIGKILLed rank
    is retried once; the time-limit warning (USR1 to the batch shell) checkpoints and requeues; a lost
    node is named and, with no node to spare, ends the job. Each run resumes from the last checkpoint;
    each starts from the squashfs, which pyxis unpacks on every node at every start. The case with all
    four faults is in the full tier alone; CI tier: test_through_pyxis_faults_behave_as_under_apptainer
    (TERM, then a lost node) and test_faults_in_turn_each_checkpoint_resume_or_end_the_run (each fault
    under Apptainer)."""
    project = sbatch_project
    testbed = project.testbed
    steps = 400
    script = project.path / "logs" / f"pyxis-faults-{time.monotonic_ns()}.sbatch"
    result = CliRunner().invoke(main, [
        "submit", "--runtime=pyxis", f"--image={cpu_sqsh}", "--nodes=2", f"--ntasks-per-node={PER_NODE}",
        "--job-name=pyxis-faults", f"--write-script={script}", DEMO, f"training.max_steps={steps}",
        "training.logging_steps=5", "training.save_steps=100000", "training.output_dir=/outputs/pyxis-faults"])  # fmt: skip
    assert result.exit_code == 0, result.output
    project.own(script)
    job_id = project.sbatch(str(script))
    checkpoints = 0
    starts = Runs(project, job_id)

    def saved() -> bool:
        return project.log(job_id).count("checkpoint /outputs/pyxis-faults/checkpoint-") == checkpoints

    for restart, fault in enumerate(faults):
        beats = starts.start(restart, past=3)
        sent = time.monotonic()
        if fault == "term":
            testbed.slurm.run(["scontrol", "requeue", job_id])
            checkpoints += 1
            report("pyxis: TERM: to checkpoint complete", f"{wait_until('the checkpoint', saved, 120) - sent:.1f} s")
        elif fault == "warn":
            testbed.slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
            checkpoints += 1
            report("pyxis: USR1 warning: to checkpoint complete", f"{wait_until('the checkpoint', saved, 120) - sent:.1f} s")
        elif fault == "rank":
            _, node, pid = beats[LAST]
            os.kill(pid, signal.SIGKILL)  # enroot keeps the host's PID namespace: the heartbeat's PID is the rank's
            ended = wait_until("the step's end", lambda n=restart + 1: project.log(job_id).count("step exited with") == n,
                               60)  # fmt: skip
            report(f"pyxis: SIGKILL of rank {LAST} on {node}: to the step's end", f"{ended - sent:.1f} s")
        else:
            try:
                testbed.kill_node("node2")
                decided = wait_until("the decision", lambda: "not requeueing" in project.log(job_id).split(
                    "ctrain: job ")[-1], 90)  # fmt: skip
                report("pyxis: node2 killed: to the batch script's decision", f"{decided - sent:.1f} s")
            finally:
                testbed.start_node("node2")
    state = testbed.wait(job_id, timeout=120)
    log = project.log(job_id)
    assert state in ("FAILED", "NODE_FAIL"), f"job {job_id} ended {state}:\n{log[-6000:]}"
    runs = log.split("ctrain: job ")[1:]
    assert len(runs) == len(faults), batch_lines(project, job_id)
    assert all(f"ctrain: pyxis image {cpu_sqsh}, torchrun" in run for run in runs), log[-6000:]
    pattern = rf"step (\d+)/{steps}, loss"
    last_checkpoint = None
    for run, after, fault in zip(runs, [*runs[1:], None], faults):
        if last_checkpoint is not None:
            assert f"resuming from /outputs/pyxis-faults/checkpoint-{last_checkpoint} " in run, run[:4000]
        if fault in ("term", "warn"):
            signalled = "SIGTERM" if fault == "term" else "SIGUSR1"
            stopped = int(re.search(rf"preemption \({signalled}\): saving a complete checkpoint at step (\d+)",
                                    run).group(1))  # fmt: skip
            assert f"checkpoint /outputs/pyxis-faults/checkpoint-{stopped} complete" in run
            assert max(int(n) for n in re.findall(pattern, run)) <= stopped
            assert last_checkpoint is None or stopped > last_checkpoint
            last_checkpoint = stopped
        elif fault == "rank":
            assert "ctrain: failure: a rank failed on a live node: " in run, run[-4000:]
            assert re.search(rf"ctrain: requeueing job {job_id} once \(restart \d\)", run), run[-4000:]
        else:
            assert "ctrain: failure: node lost: node2 (its launcher never ended and its slurmd does not answer)" in run
            not_requeued(run, "node2")
    assert not re.search(r"slurmstepd-node\d: error: pyxis", log), log[-6000:]


def _hostnames(project: Project, nodes: str) -> list[str]:
    return project.testbed.slurm.run(["scontrol", "show", "hostnames", nodes]).stdout.split()


def _tasks(project: Project, array: str) -> dict[int, dict[str, str]]:
    """The array's tasks as Slurm's record has them: index -> JobId, JobState, NodeList, ... (array ids
    of one-task continuations included, by their ArrayTaskId, the newest job last)."""
    out = project.testbed.slurm.run(["scontrol", "show", "job", "-o", array], check=False).stdout
    found: dict[int, dict[str, str]] = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("ArrayTaskId", "").isdigit():
            found[int(fields["ArrayTaskId"])] = fields
    return found


@pytest.mark.full  # a 3-node testbed and four 2-node trainings, one after another: some five minutes
def test_a_sweep_survives_a_lost_node_task_by_task_and_its_results_rank_every_task(
    sbatch_project: Project, cpu_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """`ctrain submit --sweep` (run as the job user, as on a login node): four learning rates of the demo,
    one job array of 2-node tasks, --max-parallel 2 (two run at once: a testbed node holds two 1-process
    jobs). Node2 is killed under the first task past its first checkpoint: each task on node2 goes on as a
    one-task array of its own index on the healthy nodes, resumed from its checkpoint, and the other tasks
    are not touched; every task finishes in its own output directory, `ctrain
    results ARRAY` ranks the four, the best marked, its plot has a curve per task, `ctrain jobs` lists the
    sweep, and `ctrain pull` over the testbed's sshd brings every task's results to a laptop project.
    Full tier alone; CI tier: test_a_sweeps_task_continues_as_a_one_task_array_of_its_index_and_names_its_run
    and test_each_task_of_a_recipe_gets_its_overrides_and_its_own_output_directory (the library, Slurm faked)."""
    from tests.plugins.remote import user_ctrain

    project = sbatch_project
    testbed = project.testbed
    testbed.down()
    testbed.up(3)
    rates = ["1e-3", "3e-3", "1e-2", "3e-2"]
    try:
        launcher = user_ctrain(Path(testbed.shared_dir) / "ctrain-for-the-user")
        command = [str(launcher), "submit", f"--image={cpu_sif}", "--nodes=2", f"--ntasks-per-node={PER_NODE}",
                   "--job-name=sweep", "--max-parallel", "2", DEMO, "training.max_steps=80", "training.logging_steps=5",
                   "training.save_steps=25", "--sweep", f"training.learning_rate={','.join(rates)}"]  # fmt: skip
        runner = testbed.user_runner()
        submitted = subprocess.run(runner.argv(command), cwd=project.path, capture_output=True, text=True,
                                   timeout=300, check=False)  # fmt: skip
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        array = submitted.stdout.split()[0]
        assert f"submitted sweep {array}: 4 task(s), one job array" in submitted.stderr, submitted.stderr
        record = testbed.slurm.run(["scontrol", "show", "job", "-o", array]).stdout
        assert "ArrayTaskThrottle=2" in record, record
        wait_until("task 0 running", lambda: _tasks(project, array).get(0, {}).get("JobState") == "RUNNING", 300)
        first = _tasks(project, array)[0]["JobId"]
        assert _tasks(project, array)[0]["NodeList"] == "node[1-2]"
        training(project, first, past=30)
        try:
            running = {k: t for k, t in _tasks(project, array).items() if t.get("JobState") == "RUNNING"}
            testbed.kill_node("node2")
            lost = time.monotonic()
            # Every task on node2 goes on as a one-task array of its own index; the others are not touched.
            hit = {k for k, t in running.items() if "node2" in _hostnames(project, t["NodeList"])}
            assert 0 in hit, running
            wait_until("task 0's continuation", lambda: protocol.continued_as(project.log(first)) is not None, 120)
            later = protocol.continued_as(project.log(first))
            assert list(_tasks(project, later)) == [0], _tasks(project, later)  # a one-task array of the same index
            training(project, later, past=30)
            report("a sweep's 2-node task, node2 killed: to its first step again", f"{time.monotonic() - lost:.1f} s")
            assert testbed.slurm.job(later).where == "node[1,3]"
        finally:
            testbed.start_node("node2")
        assert re.search(r"resuming from \S+/learning_rate-1e-3/checkpoint-25 ", project.log(later)), \
            project.log(later)[-3000:]  # fmt: skip
        ends = {}
        for index in range(4):  # each task to its end, through its continuation where it had one
            wait_until(f"task {index}", lambda: index in _tasks(project, array), 3 * JOB_TIMEOUT, every=2)
            job = _tasks(project, array)[index]["JobId"]
            assert testbed.wait(job, timeout=JOB_TIMEOUT) in ("COMPLETED", "FAILED", "NODE_FAIL"), job
            chain_of = [job]
            while (after := protocol.continued_as(project.log(chain_of[-1]))) is not None:
                chain_of.append(after)
            ends[index] = testbed.wait(chain_of[-1], timeout=JOB_TIMEOUT)
            assert ends[index] == "COMPLETED", batch_lines(project, chain_of[-1])
            assert (len(chain_of) > 1) == (index in hit), (index, chain_of, hit)  # only the tasks on node2 went on
            assert restarts(project, job) == 0
        for rate in rates:
            final = project.path / "outputs" / "demo-addition" / f"learning_rate-{rate}" / "final"
            assert json.loads((final / "ctrain-complete.json").read_text())["step"] == 80, rate
    finally:
        testbed.down()
        testbed.up(2)
    monkeypatch.chdir(project.path)
    told = CliRunner().invoke(main, ["results", array, "--json"], catch_exceptions=False)
    assert told.exit_code == 0, told.output
    runs = json.loads(told.output)["runs"]
    assert sorted(r["job"] for r in runs) == [f"{array}_{i}" for i in range(4)]
    assert all("loss" in r["metrics"] and r["metrics"]["step"] == 80 for r in runs), runs
    assert runs[0]["best"] and runs[0]["metrics"]["loss"] == min(r["metrics"]["loss"] for r in runs)
    assert next(r for r in runs if r["job"] == f"{array}_0")["run"] == first  # the run across its two jobs
    account = json.loads(CliRunner().invoke(main, ["report", first, "--json"], catch_exceptions=False).output)
    assert [r["cause"] for r in account["runs"]] == ["node-lost", "none"], account["runs"]
    assert account["runs"][0]["reached_step"] < 80 and account["runs"][1]["reached_step"] == 80, account["runs"]
    assert account["runs"][1]["resumed_step"] == 25, account["runs"]  # the continuation's steps are its own run's
    listed = CliRunner().invoke(main, ["jobs", "--json"], catch_exceptions=False)
    assert any(row["ran"].endswith("(sweep: 4 tasks)") for row in json.loads(listed.output)), listed.output
    plotted = CliRunner().invoke(main, ["results", array, "--plot", str(tmp_path / "sweep.html")])
    assert plotted.exit_code == 0 and "of 4 run(s)" in plotted.output, plotted.output
    page = (tmp_path / "sweep.html").read_text()
    assert all(f'id="train-{array}_{index}"' in page for index in range(4)), "a curve per task"

    # From a laptop: the sweep's results over the login host's sshd, ranked there the same.
    from ctrain import remote

    login_host = request.getfixturevalue("login_host")
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"clusters": {"tb": login_host.profile(project_dir=str(project.path),
                                                                              ctrain=str(launcher))}}))  # fmt: skip
    monkeypatch.setenv(remote.PROFILES_ENV, str(clusters))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    (laptop / "ctrain.yaml").write_text("{}\n")
    monkeypatch.chdir(laptop)
    try:
        pulled = CliRunner().invoke(main, ["pull", array, "--cluster", "tb"], catch_exceptions=False)
        assert pulled.exit_code == 0 and f"pulled job {array} from tb" in pulled.output, pulled.output
        home = json.loads(CliRunner().invoke(main, ["results", array, "--json"], catch_exceptions=False).output)
        assert [(r["job"], r["metrics"]["loss"]) for r in home["runs"]] == [(r["job"], r["metrics"]["loss"]) for r in runs]
        assert all(Path(r["output"]).is_relative_to(laptop) for r in home["runs"]), home["runs"]
    finally:
        remote.Ssh(remote.resolve("tb", clusters)).close()
