"""What the batch script and the ranks say to each other (ctrain.protocol), held from both sides.

Python writes each record through the protocol (the trainer's own writers: exits, health, the
heartbeat, the timeline's marks) into a job's files, and the real bash library reads it and decides;
bash writes its records (a node's launcher's end, the run's state, the timeline's marks, the status
lines) and the protocol's parsers, ``ctrain report`` and ``ctrain status`` read them. Slurm's
commands are faked (tests/bashlib.py); everything else is the library as a job runs it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import errors, protocol, slurm
from ctrain.cli import main
from ctrain.protocol import ExitRecord, HeartbeatLine, Mark, NodeDone, RunState, UnfitLine
from ctrain.train import artifacts, exits, goodput, health
from ctrain.train.script import HeartbeatFile
from tests import bashlib
from tests.bashlib import JOB, NODES, RUN_DIR, TIMELINE, calls, library, library_text
from tests.conftest import need

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "ctrain"


@pytest.fixture(scope="module")
def conf(tmp_path_factory) -> Path:
    need(shutil.which("scontrol") is not None, "scontrol (slurm-client)")
    return bashlib.slurm_conf(tmp_path_factory.mktemp("slurm"))


@pytest.fixture
def fake(tmp_path: Path, conf: Path) -> Path:
    """A project whose run is under way: the run's directory with its exit/ and heartbeat/, the run
    running (its state), and .ctrain/ for the files beside it."""
    project = bashlib.fake_slurm(tmp_path / "project")
    run = project / RUN_DIR
    (run / protocol.EXIT_DIR).mkdir(parents=True)
    (run / protocol.HEARTBEAT_DIR).mkdir()
    (run / protocol.STATE_FILE).write_text(RunState(0, "running").line())
    (project / protocol.STATE_DIR).mkdir()
    (project / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\n")
    return project


def marks(project: Path) -> list[Mark]:
    """The timeline's marks, each line parsed by the protocol (none may fail to parse)."""
    path = project / TIMELINE
    lines = path.read_text().splitlines() if path.exists() else []
    parsed = [Mark.parse(line) for line in lines]
    assert None not in parsed, lines
    return parsed  # type: ignore[return-value]


def decision(project: Path) -> tuple[str, str]:
    """The run's `decided` mark: (outcome, cause), which the protocol knows."""
    (decided,) = [m for m in marks(project) if m.event == "decided"]
    outcome, cause = decided.args
    assert outcome in protocol.DECIDED
    assert cause in protocol.DECISION_CAUSES or cause.startswith(protocol.RANK_CAUSE_PREFIX), cause
    return outcome, cause


def state(project: Path) -> RunState | None:
    return RunState.parse((project / RUN_DIR / protocol.STATE_FILE).read_text())


def decide(project: Path, conf: Path, rc: int, event: str = "exited", **env: str) -> str:
    """ctrain_decide on the run's directory, as the batch script calls it after its step; its output."""
    out = library(project, f"CTRAIN_SETTLE=0; ctrain_decide {RUN_DIR} {rc} {event}", conf, **env)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- the job's files: the docs' table is the protocol's, and both sides name the same files ---------


def test_the_docs_table_of_the_jobs_files_is_the_protocols() -> None:
    """docs/architecture.md holds the table ctrain.protocol.JOB_FILES makes (python -m ctrain.protocol)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## The job's files\n", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"(?:^\|.*\|\n)+", section, re.MULTILINE)
    assert tables == [protocol.job_files_table()], (
        "docs/architecture.md's table of the job's files differs from ctrain.protocol.JOB_FILES: "
        "paste in the output of `python -m ctrain.protocol`")  # fmt: skip


def _literal(name: str) -> str:
    """The part of a table name that its writers spell as it is (NODE, N, R, JOBID, HOST, PID vary)."""
    return max(re.split(r"\.\./|JOBID|NODE|HOST|PID|\bN\b|\bR\b|/", name), key=len)


def test_every_file_of_the_table_is_named_by_its_side_and_every_file_of_the_run_has_a_row() -> None:
    bash = library_text()
    python = "\n".join(path.read_text() for path in SRC.rglob("*.py") if path.name != "protocol.py")
    names = [f.name for f in protocol.JOB_FILES]
    # The files only Python names (NCCL's log, the report's JSON): a module uses the protocol's name.
    by_python = {f"{protocol.NCCL_LOG_PREFIX}.HOST.PID": "protocol.NCCL_LOG_PREFIX",
                 f"../{protocol.report_file('RUN')}": "protocol.report_file(",
                 f"../{protocol.HISTORY_FILE}": "protocol.HISTORY_FILE",
                 f"../{protocol.sweep_file('DIGEST')}": "protocol.sweep_file("}  # fmt: skip
    for name in names:
        assert by_python[name] in python if name in by_python else _literal(name) in bash, name
    # What the library names in the run's directory, and beside it: each has a row (a directory: the
    # rows of the files in it).
    runs = set(re.findall(r'\$(?:dir|\{?CTRAIN_RUN_DIR\}?|\{?CTRAIN_PIDS\}?)/([a-z][\w-]*)"', bash))
    runs -= protocol.IMAGE_ENTRY_FILES  # the image program's $dir is a cache entry
    beside = set(re.findall(r"\.ctrain/\$\{?(?:SLURM_JOB_ID|job)\}?\.([a-z]+)\b", bash))
    of_run = set(re.findall(r"\.ctrain/\$\{?CTRAIN_RUN\}?\.([a-z]+)\b", bash))
    assert {"unfit", "lost", "hung", "state", "batch-alive", "claim", "step"} <= runs, runs
    assert {"preflight", "continuation", "run"} <= beside, beside
    assert {"timeline", "retried", "holder", "jobs"} <= of_run, of_run
    rows = {name.rstrip("/") for name in names} | {name.split("/")[0] for name in names if "/" in name.rstrip("/")}
    assert runs <= rows, runs - rows
    assert {f"../JOBID.{word}" for word in beside} <= rows, beside
    assert {f"../RUN.{word}" for word in of_run} <= rows, of_run


def test_the_image_caches_entry_is_the_one_the_librarys_program_makes() -> None:
    program = (bashlib.LIB_DIR / "programs" / "image-prepare.sh").read_text()
    named = set(re.findall(r'\$entry/([\w.-]+)"', program))
    assert named == protocol.IMAGE_ENTRY_FILES | {protocol.IMAGE_ENTRY_ROOTFS}, named
    assert re.findall(r'\$cache/([\w.-]+)"', program) == [protocol.IMAGE_CACHE_LOCK]


# --- the environment: what the library exports is where Python reads --------------------------------


def test_the_library_exports_the_run_directory_and_its_files_where_the_ranks_read_them(fake: Path,
                                                                                      conf: Path) -> None:  # fmt: skip
    """A job's dry run: the tasks get CTRAIN_PIDS (and CTRAIN_RUN_DIR, where the library exports it,
    the same), CTRAIN_HEARTBEATS, CTRAIN_EXITS and CTRAIN_TIMELINE, where the protocol reads them."""
    names = [v.name for v in protocol.VARIABLES if v.name.startswith("CTRAIN_")]
    commands = ('ctrain_main apptainer; echo "@requeue=$CTRAIN_REQUEUE_EXIT"; '
                f"for v in {' '.join(names)}; do [[ ! -v $v ]] || echo \"@$v=${{!v}}\"; done; env | sed 's/^/@env /'")  # fmt: skip
    out = library(fake, commands, conf, CTRAIN_DRY_RUN="1", CTRAIN_RUN_DIR=None, CTRAIN_PIDS=None,
                  CTRAIN_TIMELINE=None, CTRAIN_REQUEUE_EXIT=None, SLURM_NNODES="2", SLURM_TASKS_PER_NODE="1(x2)",
                  SLURM_SUBMIT_DIR=str(fake), CTRAIN_PROJECT_DIR=None, HOME=str(fake),
                  CTRAIN_PREFLIGHT="full")  # as ctrain submit's settings block exports it  # fmt: skip
    assert out.returncode == 0, out.stderr + out.stdout
    exported = dict(line[5:].split("=", 1) for line in out.stdout.splitlines() if line.startswith("@env "))
    run = protocol.run_dir(exported)
    assert run == Path(protocol.run_dir_name(JOB)) and exported[protocol.RUN_DIR_OLD_ENV] == str(run)
    if protocol.RUN_DIR_ENV in exported:  # a library that exports the new name: the same directory
        assert exported[protocol.RUN_DIR_ENV] == exported[protocol.RUN_DIR_OLD_ENV]
    assert protocol.heartbeats_dir(exported) == run / protocol.HEARTBEAT_DIR
    assert protocol.exits_dir(exported) == run / protocol.EXIT_DIR
    assert protocol.timeline_path(exported) == Path(protocol.STATE_DIR) / protocol.timeline_file(JOB)
    srun = out.stdout.split("\n+ srun ", 1)[1].split("\n@", 1)[0]  # the last thing the dry run prints, maybe lines
    given = next(w for w in shlex.split(srun) if w.startswith("--export=")).removeprefix("--export=").split(",")
    wanted = {protocol.RUN_DIR_OLD_ENV, protocol.HEARTBEATS_ENV, protocol.EXITS_ENV, protocol.TIMELINE_ENV,
              protocol.PREFLIGHT_ENV}  # fmt: skip
    assert wanted <= set(given), wanted - set(given)  # the tasks, and so the ranks, get them
    assert int(re.search(r"^@requeue=(\d+)$", out.stdout, re.MULTILINE).group(1)) == protocol.EXIT_REQUEUE
    assert re.search(r"^@CTRAIN_PREFLIGHT=(\w+)$", out.stdout, re.MULTILINE).group(1) == "full"
    assert protocol.PREFLIGHT_LEVELS == health.CHOICES


def test_python_reads_the_run_directory_under_its_new_name_and_its_old_one() -> None:
    assert protocol.run_dir({"CTRAIN_RUN_DIR": ".ctrain/9", "CTRAIN_PIDS": ".ctrain/8"}) == Path(".ctrain/9")
    assert protocol.run_dir({"CTRAIN_PIDS": ".ctrain/8"}) == Path(".ctrain/8")  # a job of an older library
    assert protocol.run_dir({"CTRAIN_RUN_DIR": ""}) is None and protocol.run_dir({}) is None
    assert protocol.restart_count({"SLURM_RESTART_COUNT": "4"}) == 4
    assert protocol.restart_count({"SLURM_RESTART_COUNT": "²"}) == 0 == protocol.restart_count({})


@pytest.mark.parametrize(("run_restarts", "requeues"), [("0", "0"), ("0", "2"), ("1", "0"), ("3", "2")])
def test_rank_0s_marks_count_a_runs_restarts_as_the_library_does(tmp_path: Path, run_restarts: str,
                                                                 requeues: str) -> None:  # fmt: skip
    """A continuation (CTRAIN_RUN_RESTARTS, which ctrain_continue gives it) requeued by Slurm
    (SLURM_RESTART_COUNT): rank 0's timeline marks (goodput.mark) carry the same restart as the batch
    script's (ctrain_mark, ctrain_restarts), so the report puts the continuation's steps in its own run."""
    env = {"CTRAIN_RUN_RESTARTS": run_restarts, "SLURM_RESTART_COUNT": requeues}
    out = subprocess.run(["bash", "-c", f"source {bashlib.LIB} && ctrain_restarts"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], **env}, check=True)  # fmt: skip
    assert protocol.restart_count(env) == int(out.stdout) == int(run_restarts) + int(requeues)


def test_the_rank_checks_find_the_run_directory_under_either_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CTRAIN_RUN_DIR", raising=False)
    monkeypatch.setenv("CTRAIN_PIDS", str(tmp_path / "old"))
    assert health.pids_dir() == tmp_path / "old"
    monkeypatch.setenv("CTRAIN_RUN_DIR", str(tmp_path / "new"))
    assert health.pids_dir() == tmp_path / "new"


# --- exit codes --------------------------------------------------------------------------------------


def test_the_exit_codes_are_the_protocols_on_every_side() -> None:
    codes = {c.code for c in protocol.EXIT_CODES}
    assert {0, 1, 2, 3, 65, 75} <= codes and len(codes) == len(protocol.EXIT_CODES)
    assert errors.CtrainError.exit_code == protocol.EXIT_ERROR
    assert errors.ConfigError.exit_code == protocol.EXIT_CONFIG
    assert errors.ToolNotFound.exit_code == protocol.EXIT_TOOL
    assert errors.NonFiniteTraining.exit_code == protocol.EXIT_NONFINITE == artifacts.NONFINITE_EXIT_CODE
    assert artifacts.PREEMPTED_EXIT_CODE == protocol.EXIT_REQUEUE
    assert exits.classify(None, protocol.EXIT_REQUEUE).cause == "preempted"
    assert exits.classify(KeyboardInterrupt(), 1).code == protocol.EXIT_INTERRUPTED


def test_the_librarys_own_errors_exit_with_the_code_of_a_refused_setting(fake: Path, conf: Path) -> None:
    out = library(fake, "ctrain_settings nosuch", conf)
    assert out.returncode == protocol.EXIT_CONFIG and out.stderr.startswith(protocol.LOG_PREFIX + protocol.ERROR)


def test_the_requeue_code_in_a_launchers_end_asks_bash_for_a_requeue(fake: Path, conf: Path) -> None:
    """Both launchers ended with 75 (the trainer checkpointed at a signal): no node failed, and the job
    is requeued; the run's state and the timeline say so."""
    for node, host in enumerate(NODES):
        (fake / RUN_DIR / protocol.node_done_file(node)).write_text(NodeDone(protocol.EXIT_REQUEUE, host).line())
    assert library(fake, f"ctrain_failed_node {RUN_DIR}", conf).stdout == ""
    out = decide(fake, conf, protocol.EXIT_REQUEUE)
    assert f"ctrain: requeueing job {JOB} (restart 1)" in out
    assert calls(fake, "scontrol requeue") == [f"scontrol requeue {JOB}"]
    assert decision(fake) == ("requeued", "none") and state(fake) == RunState(0, "requeued")


# --- exit records: Python writes, bash decides -------------------------------------------------------


CODES = {"done": protocol.EXIT_OK, "preempted": protocol.EXIT_REQUEUE, "nonfinite": protocol.EXIT_NONFINITE,
         "config": protocol.EXIT_CONFIG, "environment": protocol.EXIT_TOOL, "interrupted": protocol.EXIT_INTERRUPTED}  # fmt: skip


def _code(cause: str) -> int:
    """The exit code a rank that ended for CAUSE returns."""
    return CODES.get(cause, protocol.EXIT_ERROR)


@pytest.mark.parametrize("cause", sorted(exits.CAUSES))
def test_each_causes_record_is_read_by_the_library_as_python_meant_it(cause: str, fake: Path, conf: Path) -> None:
    """A rank's record, written by ctrain.train.exits: the library takes it as the one that ends the
    job exactly when Python says a retry cannot help (and the rank did not end well)."""
    record = exits.Exit(_code(cause), cause, "ValueError: a message with $(touch pwned) `touch pwned` ; \\ \"'")
    path = exits.write(record, fake / RUN_DIR / protocol.EXIT_DIR, 3, host="gpu002")
    assert ExitRecord.parse(path.read_text()) == ExitRecord(record.code, cause, record.retry, "gpu002", record.message)
    out = library(fake, f"ctrain_rank_exit {RUN_DIR}/{protocol.EXIT_DIR}", conf).stdout
    if record.code != 0 and not record.retry:
        assert out == f"3 {record.code} {cause} gpu002 {record.message}\n"
    else:
        assert out == ""
    assert not list(fake.glob("pwned*"))


def test_a_record_that_a_retry_cannot_help_ends_the_job_naming_the_rank(fake: Path, conf: Path) -> None:
    """Rank 3 stopped at a NaN (its record, from exits.record, through the protocol), rank 1 only saw its
    peer go: the job ends, rank-nonfinite, and `ctrain status` shows the failure and the decision."""
    exits.write(exits.classify(RuntimeError("Connection reset by peer"), 1), fake / RUN_DIR / "exit", 1, host="gpu001")
    time.sleep(0.01)  # the records are taken oldest first
    exits.write(exits.classify(errors.NonFiniteTraining("step 5: loss nan"), 1), fake / RUN_DIR / "exit", 3,
                host="gpu002")  # fmt: skip
    (fake / RUN_DIR / protocol.node_done_file(1)).write_text(NodeDone(1, "gpu002").line())
    out = decide(fake, conf, 1)
    assert slurm.events(out) == [
        "failure: rank 3 on gpu002 ended with 65 (nonfinite): step 5: loss nan",
        "not requeueing: a nonfinite failure repeats on a retry; fix it and submit again",
    ]
    assert not calls(fake, "scontrol requeue")
    assert decision(fake) == ("ended", "rank-nonfinite") and state(fake) == RunState(0, "ended")
    _, lines = goodput.report(fake / TIMELINE, JOB)
    assert lines[2].endswith("ended: a rank's own error (nonfinite)"), lines


# --- the unfit file: Python writes (the rank checks), bash decides ------------------------------------


def test_an_unfit_node_written_by_the_rank_checks_is_left_out_of_the_requeue(fake: Path, conf: Path) -> None:
    run = fake / RUN_DIR
    (run / protocol.STATE_FILE).unlink()  # the preflight runs before the step: the run is starting
    health.record_unfit(run, "not a node", "disk", "x")
    health.record_unfit(run, "gpu002", "matmul", "rank 1 (CPU)\nmultiplies $(reboot) slowly")
    lines = (run / protocol.UNFIT_FILE).read_text().splitlines()
    assert [UnfitLine.parse(line) for line in lines] == [
        UnfitLine("not_a_node", "disk", "x"),
        UnfitLine("gpu002", "matmul", "rank 1 (CPU) multiplies $(reboot) slowly"),
    ]
    assert library(fake, f"ctrain_unfit_nodes {RUN_DIR}/{protocol.UNFIT_FILE}", conf).stdout == "gpu002\n"
    out = decide(fake, conf, 1, "unfit")
    assert (
        slurm.events(out)[0] == "failure: preflight: gpu002 is unfit (matmul): rank 1 (CPU) multiplies $(reboot) slowly"
    )
    assert calls(fake, "scontrol update") == [f"scontrol update JobId={JOB} ExcNodeList=gpu002"]
    assert decision(fake) == ("requeued", "preflight")


# --- heartbeats: Python writes, the watchdog reads ---------------------------------------------------


def test_the_watchdog_reads_the_ranks_heartbeats_as_python_writes_them(fake: Path, conf: Path) -> None:
    """Rank 0 beats step 7, then nothing; rank 1 has finished (`done`): after CTRAIN_HANG_TIMEOUT the
    watchdog names rank 0 with the step, host and PID of its line, and only it, and the run is decided
    as a hang."""
    beats = fake / RUN_DIR / protocol.HEARTBEAT_DIR
    HeartbeatFile(beats, 0).beat(7)
    HeartbeatFile(beats, 1).done()
    host, pid = socket.gethostname(), os.getpid()
    assert HeartbeatLine.parse((beats / "rank-0").read_text()) == HeartbeatLine(7, host, pid)
    assert HeartbeatLine.parse((beats / "rank-1").read_text()) == HeartbeatLine(None, host, pid)
    out = library(fake, "ctrain_watchdog", conf, CTRAIN_HEARTBEATS=f"{RUN_DIR}/{protocol.HEARTBEAT_DIR}",
                  CTRAIN_NPROC_PER_NODE="1", CTRAIN_HANG_TIMEOUT="2", CTRAIN_NODE_CHECK="0")  # fmt: skip
    assert out.returncode == 0, out.stderr
    hung = [line for line in out.stdout.splitlines() if line.startswith("ctrain: hang: rank ")]
    assert len(hung) == 1 and hung[0].startswith(f"ctrain: hang: rank 0 on {host} (pid {pid}): last step 7,"), (
        out.stdout
    )
    assert (fake / RUN_DIR / protocol.HUNG_FILE).read_text().split()[0].startswith("0:")
    assert state(fake) == RunState(0, "ending")
    out = decide(fake, conf, 137)
    assert slurm.events(out)[0].startswith("failure: a rank stopped making progress")
    assert decision(fake) == ("requeued", "hang")


# --- a node's launcher's end, and the run's state: bash writes, Python reads --------------------------


def _task() -> str:
    out = subprocess.run(["bash", "-c", 'source "$0" && printf %s "$CTRAIN_TASK"', str(bashlib.LIB)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout


def test_a_nodes_task_writes_its_launchers_end_as_the_protocol_reads_it(fake: Path, conf: Path) -> None:
    """The per-node task (CTRAIN_TASK), run here as a node runs it, around a launcher that fails."""
    env = {"PATH": os.environ["PATH"], "CTRAIN_PIDS": RUN_DIR, "CTRAIN_RUN_DIR": RUN_DIR, "SLURM_NODEID": "1",
           "SLURM_STEP_ID": "5"}  # fmt: skip
    run = subprocess.run(["sh", "-c", _task(), "ctrain-task", sys.executable, "-c", "raise SystemExit(3)"],
                         cwd=fake, env=env, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert run.returncode == 3, run.stdout + run.stderr
    host = os.uname().nodename
    done = NodeDone.parse((fake / RUN_DIR / protocol.node_done_file(1)).read_text())
    assert done == NodeDone(3, host)
    assert int((fake / RUN_DIR / protocol.pid_file(host)).read_text()) > 0
    assert (fake / RUN_DIR / protocol.STEP_FILE).read_text() == "5\n"
    assert library(fake, f"ctrain_failed_node {RUN_DIR}", conf).stdout == f"3 {host}\n"


def _life() -> dict[tuple[str, str], str]:
    out = subprocess.run(["bash", "-c", 'source "$0" && for k in "${!CTRAIN_LIFE[@]}"; do echo "$k ${CTRAIN_LIFE[$k]}"; done',
                          str(bashlib.LIB)], capture_output=True, text=True, check=True)  # fmt: skip
    pairs = (line.split() for line in out.stdout.splitlines())
    return {tuple(key.split(":")): to for key, to in pairs}  # type: ignore[misc]


def test_the_runs_states_are_the_protocols_and_its_state_file_reads_both_ways(fake: Path, conf: Path) -> None:
    life = _life()
    states = {"starting"} | {s for s, _ in life} | set(life.values())
    assert states == set(protocol.STATES)
    assert {s for s in states if not any(f == s for f, _ in life)} == set(protocol.DECIDED)
    (fake / RUN_DIR / protocol.STATE_FILE).unlink()
    out = library(fake, "ctrain_transition launched", conf, SLURM_RESTART_COUNT="4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert state(fake) == RunState(4, "running")  # bash wrote it, the protocol reads it
    for written, restart, read in (
        (RunState(0, "requeued"), "0", "requeued"),
        (RunState(3, "deciding"), "0", "starting"),
    ):
        (fake / RUN_DIR / protocol.STATE_FILE).write_text(written.line())  # Python writes, bash reads
        assert library(fake, "ctrain_state", conf, SLURM_RESTART_COUNT=restart).stdout == f"{read}\n"


# --- the timeline: bash and rank 0 write it, the report reads it --------------------------------------


def _mark_calls(text: str) -> list[tuple[str, list[str]]]:
    """Each `ctrain_mark EVENT ARG...` call in the library's code (not its comments): event, arguments."""
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "ctrain_mark " not in line:
            continue
        for call in re.findall(r"\bctrain_mark ([a-z]\w*(?: [^;&|]*)?)", line):
            words = shlex.split(call, comments=True)
            found.append((words[0], words[1:]))
    return found


def test_the_librarys_marks_are_the_protocols_events_with_their_arguments() -> None:
    found = _mark_calls(library_text())
    assert {event for event, _ in found} == set(protocol.BATCH_EVENTS) == set(goodput.BATCH_EVENTS)
    for event, args in found:
        assert len(args) == len(protocol.BATCH_EVENTS[event]), (event, args)
    assert set(goodput.CAUSES) == set(protocol.DECISION_CAUSES)


def test_the_timeline_bash_and_rank_0_write_together_is_read_by_the_protocol_and_ctrain_report(
        fake: Path, conf: Path, monkeypatch) -> None:  # fmt: skip
    """The batch script's marks (ctrain_mark) and the trainer's (goodput.mark) in one file, as a run
    writes them; `ctrain report JOB` in the project reads it."""
    timeline = fake / TIMELINE
    monkeypatch.setenv(protocol.TIMELINE_ENV, str(timeline))
    monkeypatch.setenv(protocol.RESTART_ENV, "2")
    env = {"SLURM_RESTART_COUNT": "2"}
    assert library(fake, f"ctrain_mark start {int(time.time()) - 30} 2 4; ctrain_mark preflight 0.42 0; "
                   "ctrain_mark launched", conf, **env).returncode == 0  # fmt: skip
    goodput.mark("process")
    goodput.mark("checked", "0.31")
    goodput.mark("data")
    goodput.mark("train", 0)
    goodput.mark("step", 10, "1000.0", "0.41000")
    goodput.mark("save", 10, "0.500")
    goodput.mark("end", 10)
    assert library(fake, "ctrain_mark exited 0; ctrain_transition exited; ctrain_transition finished; "
                   "ctrain_mark decided finished none", conf, **env).returncode == 0  # fmt: skip
    parsed = marks(fake)
    assert [m.event for m in parsed] == ["start", "preflight", "launched", "process", "checked", "data", "train",
                                         "step", "save", "end", "exited", "decided"]  # fmt: skip
    assert {m.restart for m in parsed} == {2}
    assert [m.when for m in parsed] == sorted(m.when for m in parsed)
    assert parsed[0].args[1:] == ("2", "4") and parsed[-1].args == ("finished", "none")
    (fake / "ctrain.yaml").write_text("report:\n  gpu_hour_price: 2.0\n")
    monkeypatch.chdir(fake)
    result = CliRunner().invoke(main, ["report", JOB, "--json"])
    assert result.exit_code == 0, result.output
    assert '"skipped_lines"' not in result.output and '"outcome": "finished"' in result.output
    assert (fake / protocol.STATE_DIR / protocol.report_file(JOB)).exists()


def test_the_timeline_line_round_trips_and_refuses_what_no_ctrain_writes() -> None:
    mark = Mark(1_800_000_000.5, 3, "step", ("5", "12.5", "-"))
    assert mark.line() == "1800000000.500 3 step 5 12.5 -\n" and Mark.parse(mark.line()) == mark
    for line in ("", "x 0 start", "1 ² start", "1 0 nonsense", "nan 0 launched", "1e308 0 launched", "1 0"):
        assert Mark.parse(line) is None, line


# --- the status lines: bash prints them, `ctrain status` reads them ---------------------------------


def _failure_sites() -> list[str]:
    """The fixed start of every `ctrain: failure:` line the library can print (up to its first variable)."""
    sites = re.findall(r'echo "(ctrain: failure: [^"$]*)', library_text())
    assert len(sites) >= 6, sites
    return sorted(set(sites))


def _scenarios() -> dict[str, tuple[int, dict[str, str], str]]:
    """What a step leaves (files in the run's directory, as each writer writes them) -> rc, the cause decided."""
    return {
        "rank": (1, {"exit/rank-3": ExitRecord(65, "nonfinite", False, "gpu002", "step 5: loss nan").line()},
                 "rank-nonfinite"),
        "hang": (137, {"hung": "0:700\n"}, "hang"),
        "rank-failed": (1, {protocol.node_done_file(1): NodeDone(1, "gpu002").line()}, "rank-failed"),
        "step-failed": (137, {}, "step-failed"),
        "unfit": (1, {"unfit": UnfitLine("gpu002", "disk", "TMPDIR /tmp has 16 MiB free").line()}, "preflight"),
        "lost": (137, {"lost": "gpu002\n"}, "node-lost"),
    }  # fmt: skip


def test_every_failure_line_the_library_prints_is_one_ctrain_status_shows(tmp_path: Path, conf: Path) -> None:
    """Each way a run ends badly, decided by the real library: its one failure line and the decision
    after it are what `ctrain status` (slurm.events) shows, and every `ctrain: failure:` line the
    library has is among them (a new one needs a case here)."""
    seen = []
    for name, (rc, files, cause) in _scenarios().items():
        project = bashlib.fake_slurm(tmp_path / name)
        run = project / RUN_DIR
        (run / "exit").mkdir(parents=True)
        (project / protocol.STATE_DIR).mkdir()
        (project / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\n")
        if name != "unfit":
            (run / protocol.STATE_FILE).write_text(RunState(0, "running").line())
        for relative, text in files.items():
            (run / relative).write_text(text)
        out = decide(project, conf, rc, "unfit" if name == "unfit" else "exited")
        shown = slurm.events(out)
        assert len(shown) == 2 and shown[0].startswith(protocol.FAILURE), (name, out)
        assert re.match(r"(not )?requeueing", shown[1]), (name, out)
        assert decision(project)[1] == cause, name
        seen.append(protocol.LOG_PREFIX + shown[0])
    missing = [site for site in _failure_sites() if not any(line.startswith(site) for line in seen)]
    assert not missing, f"failure lines of the library no case here prints: {missing}"


def test_the_status_parser_takes_only_the_librarys_lines() -> None:
    log = ("0: ctrain: failure: a rank's own text, under srun's label\n"
           "ctrain: failure: node lost: gpu002 (its launcher never ended)\n"
           "ctrain: requeueing job 7 (restart 1) without gpu002 (ExcNodeList)\n"
           "ctrain: step exited with 0\n")  # fmt: skip
    assert (
        protocol.status_events(log)
        == slurm.events(log)
        == [
            "failure: node lost: gpu002 (its launcher never ended)",
            "requeueing job 7 (restart 1) without gpu002 (ExcNodeList)",
        ]
    )
    # An older library's hang line is still read.
    assert protocol.status_events("ctrain: the step was ended because a rank stopped making progress\n") == [
        "the step was ended because a rank stopped making progress"
    ]


@pytest.mark.parametrize(("gpus", "tasks"), [(8, "1(x2)"), (0, "4(x2)"), (0, "2,1"), (2, "3(x2)")])
def test_the_processes_per_node_python_checks_a_recipe_for_are_the_ones_the_library_starts(
        gpus: int, tasks: str, fake: Path, conf: Path) -> None:  # fmt: skip
    """ctrain_allocation on a 2-node allocation and protocol.world_size give the same count."""
    commands = 'ctrain_settings apptainer; ctrain_allocation; echo "@nproc=$CTRAIN_NPROC_PER_NODE"'
    out = library(fake, commands, conf, CTRAIN_DRY_RUN="1", SLURM_NNODES="2", SLURM_TASKS_PER_NODE=tasks,
                  SLURM_GPUS_ON_NODE=str(gpus), HOME=str(fake))  # fmt: skip
    assert out.returncode == 0, out.stderr
    nproc = int(re.search(r"^@nproc=(\d+)$", out.stdout, re.MULTILINE).group(1))
    first_node_tasks = int(re.match(r"\d+", tasks).group(0))
    assert nproc == protocol.processes_per_node(gpus, first_node_tasks)
    assert protocol.world_size(2, gpus, first_node_tasks) == 2 * nproc


@pytest.mark.parametrize(("launcher", "own"), [("deepspeed", False), ("deepspeed", True), ("torchrun", False),
                                               ("accelerate", False)])  # fmt: skip
def test_what_the_launcher_adds_to_a_recipe_is_what_python_checks_the_recipe_with(
        launcher: str, own: bool, fake: Path, conf: Path) -> None:  # fmt: skip
    """ctrain_launcher's words after the recipe's overrides are protocol.launcher_overrides."""
    arguments = "-- train.py --lr 1" if own else "recipes/r.yaml training.max_steps=5"
    commands = (f"ctrain_settings apptainer {arguments}; ctrain_allocation; ctrain_launcher; "
                'printf "@%s\\n" "${CTRAIN_LAUNCH[@]}"')  # fmt: skip
    out = library(fake, commands, conf, CTRAIN_DRY_RUN="1", SLURM_NNODES="2", SLURM_TASKS_PER_NODE="1(x2)",
                  SLURM_GPUS_ON_NODE="8", HOME=str(fake), CTRAIN_LAUNCHER=launcher,
                  CTRAIN_DEEPSPEED_CONFIG="configs/deepspeed/zero3.json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    words = [line[1:] for line in out.stdout.splitlines() if line.startswith("@")]
    last = "--lr" if own else "training.max_steps=5"
    added = words[len(words) - 1 - words[::-1].index(last) + (1 if own else 0) + 1:]
    assert added == protocol.launcher_overrides(launcher, "configs/deepspeed/zero3.json", own_command=own)
