"""The job's timeline and the account `ctrain report` makes of it (ctrain.train.goodput)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.errors import ConfigError
from ctrain.jobs.library import assemble
from ctrain.train import goodput
from tests.unit.test_settings import within

REPO = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0

# A job preempted once (Slurm's TERM at step 40, checkpointed there), then a run that lost 15 steps
# to a killed rank (its last checkpoint was step 60), then a run that finished at step 100.
TIMELINE = f"""\
{T0 + 10} 0 start {T0:.0f} 2 4
{T0 + 14} 0 launched
{T0 + 20} 0 process
{T0 + 25} 0 data
{T0 + 30} 0 train 0
{T0 + 40} 0 step 20 1000.0 0.41000
{T0 + 50} 0 step 40 1000.0 0.43000
{T0 + 52} 0 save 40 2.000
{T0 + 53} 0 exited 75
{T0 + 54} 0 decided left TERM
{T0 + 100} 1 start {T0 + 60:.0f} 2 4
{T0 + 102} 1 launched
{T0 + 108} 1 process
{T0 + 110} 1 data
{T0 + 112} 1 train 40
{T0 + 122} 1 step 60 900.0 -
{T0 + 124} 1 save 60 2.000
{T0 + 132} 1 step 75 900.0 -
{T0 + 134} 1 exited 1
{T0 + 140} 1 decided requeued rank-failed
{T0 + 160} 2 start {T0 + 150:.0f} 2 4
{T0 + 162} 2 launched
{T0 + 168} 2 process
{T0 + 170} 2 data
{T0 + 172} 2 train 60
{T0 + 192} 2 step 100 1100.0 -
{T0 + 200} 2 eval 3.000
{T0 + 201} 2 end 100
{T0 + 205} 2 exited 0
{T0 + 206} 2 decided finished none
not a line
{T0 + 207} 2 nonsense
"""


def test_the_account_splits_the_wall_time_and_names_the_work_lost_and_why(tmp_path: Path) -> None:
    path = tmp_path / "7.timeline"
    path.write_text(TIMELINE)
    result, lines = goodput.report(path, "7", gpu_hour_price=2.0)
    assert result["skipped_lines"] == 2
    assert result["wall_seconds"] == 206.0  # from the first submission to the last decision
    first, second, third = result["runs"]
    assert first["seconds"]["queue"] == 10.0 and first["seconds"]["start_up"] == 10.0
    assert first["seconds"]["prepare"] == 10.0
    # Training 30 -> 53 (the step's end): 23 s, of which 2 s saving and 1 s stopping after the save
    # of the step the TERM asked for, which the next run resumed from: nothing lost.
    assert first["seconds"]["saves"] == 2.0 and first["seconds"]["training"] == 20.0
    assert first["lost_steps"] == 0 and first["seconds"]["lost"] == 0.0 and first["seconds"]["end"] == 2.0
    assert (first["outcome"], first["cause"]) == ("left", "TERM")
    # The second run trained from step 40 to 75 and its successor resumed from 60: 15 steps lost,
    # the time from the save of step 60 (t=124) to the step's end (t=134).
    assert second["seconds"]["queue"] == 40.0
    assert second["lost_steps"] == 15 and second["seconds"]["lost"] == 10.0
    assert second["seconds"]["training"] == 22 - 2 - 10
    assert second["cause"] == "rank-failed" and second["reached_step"] == 75
    assert third["seconds"]["evals"] == 3.0 and third["reached_step"] == 100
    assert third["seconds"]["training"] == 29 - 3  # train 172 -> end 201, less the evaluation
    assert third["seconds"]["end"] == 5.0  # the final model saved (end) to the decision
    assert first["tokens_per_second"] == 1000.0 and first["mfu"] == 0.42 and second["mfu"] is None
    total = result["seconds"]
    assert total["training"] == 20 + 10 + 26 and result["goodput"] == round(56 / 206, 4)
    # 2 nodes x 4 GPUs over the three runs' allocations (44 + 40 + 46 s).
    assert result["gpu_hours"] == round(130 * 8 / 3600, 3) and result["cost"] == round(130 * 8 / 3600 * 2, 2)
    assert lines[0] == "goodput: job 7: 3 run(s), 3m26s from submission to the end; training that counted 56.0 s (27.2%)"
    assert re.search(r"^goodput: run 1: q+s+p+T+c*x+d* +steps 40-75, lost 15 step\(s\) \(10\.0 s\), 900 tok/s; "
                     r"requeued: a rank failed$", lines[3]), lines[3]  # fmt: skip
    assert lines[2].endswith("left: Slurm's TERM (preemption, requeue or scancel)")
    assert lines[-1].startswith("goodput: 0.289 GPU-hours, cost 0.58; chart: q=queue s=start-up")


def test_a_run_still_going_is_accounted_up_to_now(tmp_path: Path) -> None:
    path = tmp_path / "8.timeline"
    path.write_text("\n".join(TIMELINE.splitlines()[:6]) + "\n")
    result, lines = goodput.report(path, "8", now=T0 + 45)
    (run,) = result["runs"]
    assert run["outcome"] is None and result["wall_seconds"] == 45.0
    assert run["seconds"]["training"] == 10.0  # train 30 -> the last logged step at 40
    assert lines[2].endswith("; running")


@pytest.mark.parametrize("text, error", [
    (None, "does not exist: the job was not submitted from this project"),
    ("", "the timeline has no run in it"),
    ("x" * (goodput.MAX_BYTES + 1), "more than a timeline can be"),
])  # fmt: skip
def test_what_cannot_be_accounted_says_why(tmp_path: Path, text: str | None, error: str) -> None:
    path = tmp_path / "9.timeline"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        goodput.report(path, "9")


def test_ranks_mark_only_where_the_job_says_and_never_fail_for_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(goodput.TIMELINE_ENV, raising=False)
    goodput.mark("process")  # outside a job: nothing, no error
    path = tmp_path / "t"
    monkeypatch.setenv(goodput.TIMELINE_ENV, str(path))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    goodput.mark("step", 5, "12.5", "-")
    assert re.fullmatch(r"\d+\.\d{3} 3 step 5 12\.5 -\n", path.read_text())
    monkeypatch.setenv(goodput.TIMELINE_ENV, str(tmp_path / "missing" / "t"))
    goodput.mark("process")  # cannot be written: the training goes on


def test_the_librarys_events_are_the_ones_the_report_reads() -> None:
    """The batch script's ctrain_mark calls and BATCH_EVENTS name the same events."""
    library = assemble(REPO / "sbatch" / "lib" / "ctrain.sh")
    marked = set(re.findall(r"\bctrain_mark (\w+)", library)) - {"EVENT"}
    assert marked == set(goodput.BATCH_EVENTS)
    assert "CTRAIN_TIMELINE=.ctrain/$CTRAIN_RUN.timeline" in library


def test_ctrain_report_prints_the_account_and_writes_it_as_json(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "ctrain.yaml").write_text("report:\n  gpu_hour_price: 2.0\n")
    (tmp_path / ".ctrain").mkdir()
    (tmp_path / ".ctrain" / "7.timeline").write_text(TIMELINE)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["report", "7"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("goodput: job 7: 3 run(s)")
    assert "cost 0.58" in result.output
    written = json.loads((tmp_path / ".ctrain" / "7.goodput.json").read_text())
    assert written["goodput"] == round(56 / 206, 4) and len(written["runs"]) == 3
    as_json = CliRunner().invoke(main, ["report", "7", "--json"])
    assert json.loads(as_json.output) == written
    for bad, said in (("7;rm -rf /", "is not a Slurm job id"), ("8", "8.timeline does not exist")):
        result = CliRunner().invoke(main, ["report", bad])
        assert result.exit_code != 0 and said in result.output and "Traceback" not in result.output


def test_a_timeline_with_only_the_trainers_marks_starts_at_its_first_event(tmp_path: Path) -> None:
    """No batch script's marks (`ctrain train` with CTRAIN_TIMELINE set by hand), reported an instant
    after the last event: the run starts at its first event, and the chart stays one bar (before,
    a wall of almost nothing drew billions of letters and the rank ran out of memory)."""
    path = tmp_path / "1.timeline"
    path.write_text(f"{T0} 0 process\n{T0 + 2} 0 data\n{T0 + 3} 0 train 0\n{T0 + 9} 0 step 12 100.0 -\n"
                    f"{T0 + 10} 0 end 12\n")  # fmt: skip
    result, lines = goodput.report(path, "1", now=T0 + 10.001)
    (run,) = result["runs"]
    assert result["wall_seconds"] == 10.0 and run["seconds"]["prepare"] == 3.0 and run["seconds"]["training"] == 7.0
    bar = re.match(r"goodput: run 0: (\S+) ", lines[2]).group(1)
    assert set(bar) <= set("pT") and len(bar) <= 48, lines[2]


@pytest.mark.parametrize("text", [
    f"{T0} 0 start {T0 - 5:.0f} 1e308 1e308\n{T0 + 9} 0 decided done\n",  # nodes x GPUs x seconds: inf
    f"-1e308 0 start 0 1 1\n{T0} 0 launched\n1e308 0 decided done\n",  # from -1e308 to 1e308: inf seconds
    f"{T0} 0 start {T0:.0f} 1 1\n{T0 + 1} ² train 0\n{T0 + 9} 0 decided done\n",  # "²".isdigit(), int("²") fails
    f"{T0} 0 start {T0:.0f} 1 1\n{T0 + 1} {'9' * 5000} train 0\n{T0 + 9} 0 decided done\n",  # past int()'s digits
], ids=["inf-gpu-seconds", "inf-seconds", "superscript-restart", "5000-digit-restart"])  # fmt: skip
def test_numbers_no_job_writes_are_left_out_never_a_crash(tmp_path: Path, text: str) -> None:
    path = tmp_path / "7.timeline"
    path.write_text(text)
    result, lines = goodput.report(path, "7")
    assert len(lines) == 4 and result["runs"][0]["nodes"] in (0, 1)
    json.dumps(result, allow_nan=False)  # finite throughout


def test_a_timeline_that_is_a_device_or_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    """--timeline /dev/zero would fill memory (st_size is 0), a FIFO block the report for good."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (Path("/dev/null"), fifo):
        with within(5), pytest.raises(ConfigError, match="is not a regular file"):
            goodput.report(path, "7")
    result = CliRunner().invoke(main, ["report", "7", "--timeline", str(fifo)])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "not a regular file" in result.output


def test_a_timelines_words_reach_the_terminal_without_its_escape_sequences(tmp_path: Path, monkeypatch) -> None:
    """A cause written into the timeline (a shared file any rank can write) carrying a terminal's escape
    sequence or a carriage return is printed with them as \\xNN: the report cannot repaint the screen."""
    (tmp_path / ".ctrain").mkdir()
    hostile = TIMELINE.replace("decided finished none", "decided finished \x1b]0;owned\x07\x1b[2J")
    (tmp_path / ".ctrain" / "7.timeline").write_text(hostile)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["report", "7"])
    assert result.exit_code == 0, result.output
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", result.output)
    assert "finished: \\x1b]0;owned\\x07\\x1b[2J" in result.output
