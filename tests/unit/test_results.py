"""Results you can compare (``ctrain results``, ``ctrain.jobs.results``): each run's metrics from its
output directory and its account from its timeline, ranked by one metric, the best marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import protocol
from ctrain.cli import main
from ctrain.jobs import history, results


def run(project: Path, job: str, lr: str, losses: list[float], eval_loss: float | None, rate: float) -> None:
    """A finished run of the demo recipe as its output directory and timeline hold it."""
    output = project / "outputs" / f"lr-{lr}"
    output.mkdir(parents=True)
    lines = [{"run": job, "step": 10 * (i + 1), "loss": loss, "throughput/tokens_per_second": rate}
             for i, loss in enumerate(losses)]  # fmt: skip
    if eval_loss is not None:
        lines.append({"run": job, "step": 10 * len(losses), "eval_loss": eval_loss, "eval_accuracy": 1 - eval_loss})
    (output / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    history.record(project, job, "sweep", ["recipes/demo-addition.yaml", f"training.learning_rate={lr}"], output)
    (project / protocol.STATE_DIR / protocol.timeline_file(job)).write_text(
        "100.0 0 start 90.0 2 0\n101.0 0 launched\n190.0 0 exited 0\n190.5 0 decided finished none\n")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "ctrain.yaml").write_text("report:\n  gpu_hour_price: 2.0\n")
    monkeypatch.chdir(tmp_path)
    run(tmp_path, "11", "1e-3", [2.0, 0.9], 0.8, 1000.0)
    run(tmp_path, "12", "1e-4", [2.0, 1.5], 1.2, 2000.0)
    run(tmp_path, "13", "1e-2", [2.0, 0.4], 0.3, 3000.0)
    return tmp_path


def test_runs_are_ranked_by_eval_loss_the_best_marked(project: Path) -> None:
    out = CliRunner().invoke(main, ["results", "11", "12", "13"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split()[:5] == ["JOB", "RAN", "STEP", "LOSS", "EVAL_LOSS"]
    assert [line.split()[1] if line.startswith("*") else line.split()[0] for line in lines[1:4]] == ["13", "11", "12"]
    assert lines[1].startswith("*") and not lines[2].startswith("*")
    assert "0.4" in lines[1].split() and "0.3" in lines[1].split() and "3,000" in lines[1].split()
    assert "sorted by eval_loss (least first); * the best" in out.output


def test_an_accuracy_ranks_most_first_and_json_carries_every_number(project: Path) -> None:
    told = json.loads(CliRunner().invoke(main, ["results", "11", "12", "13", "--sort", "eval_accuracy", "--json"]).output)
    assert told["sorted_by"] == "eval_accuracy"
    assert [(r["job"], r["best"]) for r in told["runs"]] == [("13", True), ("11", False), ("12", False)]
    best = told["runs"][0]
    assert best["metrics"]["loss"] == 0.4 and best["metrics"]["step"] == 20
    assert best["account"]["node_hours"] > 0 and "goodput" in best["account"]


def test_a_metric_no_run_has_and_a_job_not_in_the_history_are_one_error_line(project: Path) -> None:
    out = CliRunner().invoke(main, ["results", "11", "--sort", "bleu"])
    assert out.exit_code != 0 and "error: --sort bleu: no run has it; these do: eval_accuracy, eval_loss" in out.output
    out = CliRunner().invoke(main, ["results", "99"])
    assert out.exit_code != 0 and "error: job 99: not in this project's history" in out.output
    out = CliRunner().invoke(main, ["results", "1;rm"])
    assert out.exit_code != 0 and "is not a Slurm job id" in out.output


def test_hostile_metrics_files_are_read_bounded_and_only_their_numbers_count(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"loss": "nan"}\n{"loss": NaN}\n{"loss": true}\n[1]\n'
                                            '{"loss": 0.5}\n{"loss": 0.1, "eval_x": {"deep": [[[1]]]}}\n{"eval_loss": Infinity}\n')
    (tmp_path / "eval.json").write_text('{"accuracy": 0.9, "name": "x", "nested": {"a": 1}}')
    assert results.read_metrics(tmp_path) == {"loss": 0.5, "eval/accuracy": 0.9}
    assert results.read_metrics(tmp_path / "missing") == {}


def test_a_sweep_is_a_row_per_task_each_from_its_own_output_and_run(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A sweep recorded as one job array: `ctrain results ARRAY` ranks its tasks, each by its own output
    directory and by its run's timeline (.ctrain/ARRAY_TASK.run names the task's run); ARRAY_TASK is one."""
    (tmp_path / "ctrain.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    tasks = []
    for index, (lr, eval_loss) in enumerate([("1e-3", 0.8), ("1e-2", 0.3), ("1e-4", 1.2)]):
        output = tmp_path / "outputs" / "demo" / f"learning_rate-{lr}"
        output.mkdir(parents=True)
        (output / "metrics.jsonl").write_text(json.dumps({"step": 20, "loss": 1.0, "eval_loss": eval_loss}) + "\n")
        tasks.append({"task": index, "name": output.name, "values": {"training.learning_rate": lr},
                      "output": str(output)})  # fmt: skip
    history.record(tmp_path, "40", "demo", ["recipes/demo.yaml"], sweep=tasks)
    state = tmp_path / protocol.STATE_DIR
    (state / protocol.run_file("40_1")).write_text("43\n")
    (state / protocol.timeline_file("43")).write_text("100.0 0 start 90.0 1 0\n101.0 0 launched\n190.0 0 exited 0\n")
    told = json.loads(CliRunner().invoke(main, ["results", "40", "--json"]).output)
    assert [(r["job"], r["ran"], r["best"]) for r in told["runs"]] == [
        ("40_1", "training.learning_rate=1e-2", True), ("40_0", "training.learning_rate=1e-3", False),
        ("40_2", "training.learning_rate=1e-4", False)]  # fmt: skip
    assert told["runs"][0]["run"] == "43" and told["runs"][0]["account"]["node_hours"] > 0
    assert told["runs"][1]["account"] == {}  # no run of its own yet
    one = json.loads(CliRunner().invoke(main, ["results", "40_2", "--json"]).output)
    assert [r["job"] for r in one["runs"]] == ["40_2"]
    from ctrain.jobs import cli
    from tests.unit.test_history import Cluster

    monkeypatch.setattr(cli, "_client", lambda name: (Cluster(), [], None))
    listed = json.loads(CliRunner().invoke(main, ["jobs", "--json"]).output)
    assert listed[0]["ran"] == "recipes/demo.yaml (sweep: 3 tasks)"
