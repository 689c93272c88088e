"""A project's jobs (``ctrain jobs``, ``ctrain.jobs.history``): the record ``ctrain submit`` appends,
read back bounded and hostile-proof, listed newest first with what Slurm and the project's files say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import protocol, slurm
from ctrain.cli import main
from ctrain.errors import CtrainError
from ctrain.jobs import history


def test_a_record_is_one_json_line_read_back_in_order(tmp_path: Path) -> None:
    history.record(tmp_path, "7", "sft", ["recipes/sft.yaml", "training.learning_rate=1e-4"])
    history.record(tmp_path, "9", "mine", ["--", "train.py", "--lr", "$(id)"])
    entries, skipped = history.read(tmp_path)
    assert [(e.job, e.name, e.what) for e in entries] == [
        ("7", "sft", "recipes/sft.yaml training.learning_rate=1e-4"), ("9", "mine", "-- train.py --lr $(id)")]
    assert skipped == 0 and entries[0].submitted > 0


def test_lines_that_are_not_records_are_skipped_and_counted() -> None:
    deep = {"job": "5", "arguments": [[[[[["x"]]]]]]}
    data = b"\n".join([b'{"job": "1", "name": "a", "submitted": 1.5, "arguments": []}', b"not json", b"[1, 2]",
                       b'{"job": "1; rm -rf ~"}', b'{"job": "2", "arguments": "a string"}', json.dumps(deep).encode(),
                       b'{"job": "3", "name": "' + b"n" * 500 + b'"}', b"\xff\xfe", b""])  # fmt: skip
    entries, skipped = history.parse(data)
    assert [e.job for e in entries] == ["1", "3"] and skipped == 6
    assert entries[0].what == "(the script's defaults)" and len(entries[1].name) == 64


def test_only_the_end_of_a_huge_history_is_read(tmp_path: Path) -> None:
    path = tmp_path / protocol.STATE_DIR / protocol.HISTORY_FILE
    path.parent.mkdir()
    line = json.dumps({"job": "1", "name": "x" * 100, "submitted": 1, "arguments": []}) + "\n"
    path.write_text(line * (history.HISTORY_LIMIT // len(line) + 500) + line.replace('"1"', '"2"'))
    entries, skipped = history.read(tmp_path)
    assert entries[-1].job == "2" and skipped == 0  # the cut first line is dropped, not counted
    assert len(entries) < history.HISTORY_LIMIT // len(line) + 1


def test_the_last_loss_is_the_logs_last_step_line() -> None:
    log = "0: [rank 0] step 5/10, loss 2.5000\nnoise loss 9\n0: [rank 0] step 10/10, loss 0.0312, lr 1e-4\n"
    assert history.last_loss(log) == "0.0312" and history.last_loss("nothing\n") == "-"


class Cluster:
    """The job side of a Slurm client, made up: job 7 finished long ago (forgotten, no accounting),
    job 9 continued as 10 after a lost node and running."""

    def __init__(self) -> None:
        self.logs = {"7": "step 100/100, loss 0.5\n",
                     "9": "ctrain: requeueing as job 10 (restart 1 of run 9) without node2: a continuation\n",
                     "10": "step 40/100, loss 1.25\n"}  # fmt: skip
        self.states = {"10": "RUNNING"}

    def read_log(self, job_id: str, *, search: object) -> str:
        if job_id not in self.logs:
            raise CtrainError(f"no log for job {job_id}")
        return self.logs[job_id]

    def status(self, ids: list[str]) -> list[slurm.Job]:
        return [slurm.Job(i, "", self.states.get(i, "UNKNOWN")) for i in ids]

    def sacct(self, ids: list[str]) -> None:
        return None


def test_ctrain_jobs_lists_the_projects_jobs_newest_first_a_continued_run_as_one_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from ctrain.jobs import cli

    (tmp_path / "ctrain.yaml").write_text("slurm: {}\n")
    history.record(tmp_path, "7", "sft", ["recipes/sft.yaml"])
    history.record(tmp_path, "9", "lora", ["recipes/lora.yaml", "lora.r=8"])
    (tmp_path / protocol.STATE_DIR / protocol.timeline_file("7")).write_text(
        "100.0 0 start 90.0 2 0\n100.5 0 launched\n160.0 0 exited 75\n160.5 0 decided requeued USR1\n"
        "170.0 1 start 165.0 2 0\n171.0 1 launched\n230.0 1 exited 0\n230.5 1 decided finished none\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_client", lambda name: (Cluster(), [], None))
    out = CliRunner().invoke(main, ["jobs"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split() == ["JOB", "NAME", "RAN", "STATE", "SUBMITTED", "WALL", "RESTARTS", "LAST", "LOSS"]
    assert lines[1].startswith("9 -> 10  lora  recipes/lora.yaml lora.r=8  RUNNING"), lines
    assert lines[1].split()[-3:] == ["-", "-", "1.25"]
    assert lines[2].startswith("7") and " UNKNOWN " in lines[2] and lines[2].split()[-3:] == ["2m20s", "1", "0.5"]
    assert "this cluster keeps no accounting (sacct)" in out.output
    listed = json.loads(CliRunner().invoke(main, ["jobs", "--json", "-n", "1"]).output)
    assert [row["job"] for row in listed] == ["9 -> 10"]


def test_submit_records_the_job_in_the_projects_history(tmp_path: Path) -> None:
    """What ``ctrain submit`` queues is what the history lists: its id, name and arguments."""
    from ctrain.jobs.job import Job
    from ctrain.jobs.submit import submit

    class Queue:
        def sbatch(self, args: list[str], *, cwd: Path, script: str) -> str:
            return "42"

        def log_path(self, job_id: str, *, search: object) -> Path:
            return tmp_path / "logs" / f"sft-{job_id}.out"

    job = Job(tmp_path / "sbatch" / "apptainer.sbatch", "apptainer", "#!/bin/bash\n", tmp_path, {},
              ["recipes/sft.yaml", "training.max_steps=5"], {"job-name": "sft", "output": "logs/%x-%j.out"})  # fmt: skip
    assert submit(job, Queue())[0] == "42"  # type: ignore[arg-type]
    entries, _ = history.read(tmp_path)
    assert [(e.job, e.name, e.what) for e in entries] == [("42", "sft", "recipes/sft.yaml training.max_steps=5")]
