"""Sweeps as one job array (ctrain.jobs.sweep, the library's ctrain_sweep_task): the sets of values, the
table ctrain submit writes and each task's line as the real library reads it, hostile values arriving as
data, and the dry run's task table."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.errors import ConfigError
from ctrain.jobs import sweep
from tests.bashlib import LIB

HOSTILE = ["$(touch CANARY)", "`touch CANARY`", "a b", "'quoted'", '"double"', "x;touch CANARY", "{lr}"]


def _task_sees(project: Path, table: str, task: int, *arguments: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real library's settings for task TASK of a sweep whose table is TABLE: its overrides (O...),
    its command (C...) and its CTRAIN_SWEEP_* variables (S...), NUL-separated."""
    path = project / sweep.table_path(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    snippet = (f'source {LIB} && ctrain_settings apptainer "$@" && '
               'for o in "${CTRAIN_OVERRIDES[@]}"; do printf "O%s\\0" "$o"; done && '
               'for o in "${CTRAIN_COMMAND[@]}"; do printf "C%s\\0" "$o"; done && '
               'for v in "${!CTRAIN_SWEEP_@}"; do printf "S%s=%s\\0" "$v" "${!v}"; done')  # fmt: skip
    environ = {"PATH": os.environ["PATH"], "HOME": str(project), "SLURM_SUBMIT_DIR": str(project),
               "SLURM_JOB_ID": "77", "CTRAIN_SWEEP": sweep.table_path(table), **env}  # fmt: skip
    if task >= 0:
        environ["SLURM_ARRAY_TASK_ID"] = str(task)
    return subprocess.run(["bash", "-c", snippet, "ctrain", *arguments], env=environ, cwd=project,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _parts(out: str, kind: str) -> list[str]:
    return [item[1:] for item in out.split("\0") if item.startswith(kind)]


def test_a_grid_is_every_combination_the_first_flag_slowest() -> None:
    sets = sweep.grid(("training.learning_rate=1e-4,3e-4", "seed=1,2,3"))
    assert [tuple(s.values()) for s in sets] == [("1e-4", "1"), ("1e-4", "2"), ("1e-4", "3"),
                                                 ("3e-4", "1"), ("3e-4", "2"), ("3e-4", "3")]  # fmt: skip
    assert sweep.array_spec(len(sets), 2) == "0-5%2" and sweep.array_spec(1, None) == "0"


@pytest.mark.parametrize(("specs", "said"), [
    (("lr",), "must look like KEY=VALUE"),
    (("=1,2",), "must look like KEY=VALUE"),
    (("$(reboot)=1",), "must look like KEY=VALUE"),
    (("lr=1,,2",), "has an empty value"),
    (("lr=1", "lr=2"), "names lr twice"),
    (("lr=1\nseed=2",), "contains a control character"),
])  # fmt: skip
def test_a_sweep_flag_that_is_not_a_grid_is_one_line_naming_it(specs: tuple[str, ...], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        sweep.grid(specs)


def test_a_sweep_file_has_a_set_a_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "sets.txt"
    path.write_text("# hand-picked\nlr=1e-4 rank=8\n\nlr=3e-4 rank=16  # the big one\n")
    assert sweep.from_file(path) == [{"lr": "1e-4", "rank": "8"}, {"lr": "3e-4", "rank": "16"}]
    path.write_text("lr=1 lr=2\n")
    with pytest.raises(ConfigError, match=r"sets.txt:1: a key is given twice"):
        sweep.from_file(path)
    path.write_bytes(b"lr=1\n" * (sweep.MAX_FILE_BYTES // 5 + 1))
    with pytest.raises(ConfigError, match="is over 1 MiB"):
        sweep.from_file(path)
    with pytest.raises(ConfigError, match="no task"):
        sweep.tasks([], command=None, output_base=None)
    with pytest.raises(ConfigError, match="over the 1000"):
        sweep.tasks([{"lr": str(i)} for i in range(1001)], command=None, output_base=None)


def test_keys_that_would_be_one_variable_are_refused() -> None:
    with pytest.raises(ConfigError, match="lr and LR are one variable"):
        sweep.tasks([{"lr": "1", "LR": "2"}], command=["train.py"], output_base=None)


def test_each_task_of_a_recipe_gets_its_overrides_and_its_own_output_directory(tmp_path: Path) -> None:
    """The library reads task K's line of the table Python wrote: the recipe's own overrides first, then
    the task's values and its output directory, named by its values (names made unique)."""
    made = sweep.tasks([{"training.learning_rate": "1e-4"}, {"training.learning_rate": "3e-4"},
                        {"training.learning_rate": "3e-4 "}], command=None, output_base="outputs/demo")  # fmt: skip
    assert [t.name for t in made] == ["learning_rate-1e-4", "learning_rate-3e-4", "learning_rate-3e-4_2"]
    table = sweep.table_text(made)
    for task in made:
        out = _task_sees(tmp_path, table, task.index, "recipes/demo.yaml", "training.max_steps=10")
        assert out.returncode == 0, out.stderr
        assert _parts(out.stdout, "O") == ["training.max_steps=10", *task.words]
        assert task.words[-1] == f"training.output_dir=outputs/demo/{task.name}"
        seen = dict(item.split("=", 1) for item in _parts(out.stdout, "S"))
        assert seen["CTRAIN_SWEEP_NAME"] == task.name and seen["CTRAIN_SWEEP_TASK"] == str(task.index)
        assert seen["CTRAIN_SWEEP_TRAINING_LEARNING_RATE"] == task.values["training.learning_rate"]


def test_hostile_values_reach_the_task_as_data_and_nothing_runs(tmp_path: Path) -> None:
    """Values with $(...), backticks, quotes, spaces and ';' reach a command's words ({key}) and its
    CTRAIN_SWEEP_* variables byte for byte, and no canary file is made."""
    made = sweep.tasks([{"lr": value} for value in HOSTILE], command=["train.py", "--lr={lr}", "{lr}"],
                       output_base=None)  # fmt: skip
    table = sweep.table_text(made)
    for task, value in zip(made, HOSTILE):
        out = _task_sees(tmp_path, table, task.index, "--", "train.py", "--lr={lr}", "{lr}")
        assert out.returncode == 0, out.stderr
        assert _parts(out.stdout, "C") == ["train.py", f"--lr={value}", value]
        assert f"CTRAIN_SWEEP_LR={value}" in _parts(out.stdout, "S")
    assert not list(tmp_path.rglob("CANARY")), "a value ran as shell text"


@pytest.mark.parametrize(("line", "task", "said"), [
    ("t0\targ:x=1\n", -1, "this job is not a task of a job array"),
    ("t0\targ:x=1\n", 3, "has no task 3"),
    ("t0\tenv:PATH=/evil\n", 0, "sets 'PATH': a sweep sets CTRAIN_SWEEP_\\* only"),
    ("t0\tenv:CTRAIN_SWEEP_NAME=x\n", 0, "sets 'CTRAIN_SWEEP_NAME'"),
    ("t0\trun:reboot\n", 0, "neither arg: nor env:"),
    ("$(reboot)\targ:x=1\n", 0, "has no name"),
])  # fmt: skip
def test_a_task_whose_line_is_not_ctrains_ends_with_one_line(tmp_path: Path, line: str, task: int, said: str) -> None:
    """A table edited by hand, or a sweep's script run outside an array, is refused by the library
    before anything starts, with one line: nothing of the table is exported but CTRAIN_SWEEP_*."""
    out = _task_sees(tmp_path, line, task, "recipes/demo.yaml")
    assert out.returncode != 0
    assert re.search(said, out.stderr), out.stderr


def test_a_table_over_its_bound_is_refused_by_the_task(tmp_path: Path) -> None:
    bound = re.search(r'\(\(\$\(stat -c %s "\$table"\) <= (\d+)\)\)', (LIB.parent / "settings.sh").read_text())
    assert bound and int(bound.group(1)) == sweep.MAX_FILE_BYTES  # the library's bound is the sweep file's
    out = _task_sees(tmp_path, "t0\targ:x=1\n" * 150_000, 0, "recipes/demo.yaml")
    assert out.returncode != 0 and "is over 1 MiB" in out.stderr, out.stderr


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "proj"
    assert CliRunner().invoke(main, ["init", str(path)]).exit_code == 0
    monkeypatch.chdir(path)
    return path


def test_the_dry_run_shows_the_task_table_and_one_array_and_writes_nothing(project: Path) -> None:
    result = CliRunner().invoke(main, ["submit", "--dry-run", "recipes/demo-addition.yaml", "training.max_steps=20",
                                       "--sweep", "training.learning_rate=1e-3,3e-3", "--sweep", "seed=1,2",
                                       "--max-parallel", "2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "#SBATCH --array=0-3%2\n" in result.output
    table = next(line for line in result.output.splitlines() if line.startswith("export CTRAIN_SWEEP="))
    assert table.startswith("export CTRAIN_SWEEP=.ctrain/sweeps/")
    assert "# sweep: 4 task(s), one job array" in result.output
    assert ("#   task 3: learning_rate-3e-3_seed-2: training.learning_rate=3e-3 seed=2 "
            "training.output_dir=outputs/demo-addition/learning_rate-3e-3_seed-2") in result.output
    assert not (project / ".ctrain").exists(), "a dry run writes no table"


def test_a_value_the_recipe_refuses_is_named_with_its_task_before_anything_is_queued(project: Path) -> None:
    result = CliRunner().invoke(main, ["submit", "--dry-run", "recipes/demo-addition.yaml",
                                       "--sweep", "training.learning_rate=1e-3,fast"])  # fmt: skip
    assert result.exit_code == 2
    assert result.output.startswith("error: sweep task 1 (learning_rate-fast): "), result.output
    assert not (project / ".ctrain").exists()


def test_the_written_script_comes_with_its_table_where_the_tasks_read_it(project: Path) -> None:
    (project / "images").mkdir(exist_ok=True)
    (project / "images" / "ctrain-latest.sif").write_bytes(b"#!/usr/bin/env run-singularity\n\0SIF_MAGIC0\x01" + bytes(64))
    result = CliRunner().invoke(main, ["submit", "--write-script", "job.sbatch", "recipes/demo-addition.yaml",
                                       "--sweep", "training.learning_rate=1e-3,3e-3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = (project / "job.sbatch").read_text()
    relative = next(line for line in text.splitlines() if line.startswith("export CTRAIN_SWEEP=")).split("=", 1)[1]
    lines = (project / relative).read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["learning_rate-1e-3", "learning_rate-3e-3"]


@pytest.mark.parametrize(("args", "said"), [
    (["--max-parallel", "2"], "error: --max-parallel is for a sweep's tasks"),
    (["--sweep", "lr=1", "--sweep-file", "x.txt"], "error: give --sweep (a grid) or --sweep-file"),
])  # fmt: skip
def test_sweep_flags_without_a_sweep_are_one_line(project: Path, args: list[str], said: str) -> None:
    result = CliRunner().invoke(main, ["submit", "--dry-run", "recipes/demo-addition.yaml", *args])
    assert result.exit_code == 2 and result.output.startswith(said), result.output


def test_an_array_in_sbatch_args_is_refused_for_the_sweep_that_does_it_right(project: Path) -> None:
    config = yaml.safe_load((project / "ctrain.yaml").read_text()) or {}
    config.setdefault("slurm", {})["sbatch_args"] = ["--array=0-3"]
    (project / "ctrain.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(main, ["submit", "--dry-run", "recipes/demo-addition.yaml"])
    assert result.exit_code == 2 and "a sweep is `ctrain submit RECIPE --sweep KEY=V1,V2`" in result.output, \
        result.output  # fmt: skip


def test_a_sweeps_tasks_are_one_wandb_group_each_task_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's W&B settings for a task: grouped by the sweep's table (the same for every task and
    its continuations), its run id kept in its output directory and resumed with its checkpoint."""
    from ctrain.train import trainer

    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CTRAIN_SWEEP", ".ctrain/sweeps/0123456789abcdef.tsv")
    trainer.one_logged_run(["wandb"], tmp_path, resume=None)
    first = os.environ["WANDB_RUN_ID"]
    assert os.environ["WANDB_RUN_GROUP"] == "0123456789abcdef" and os.environ["WANDB_RESUME"] == "allow"
    for name in ("WANDB_RUN_ID", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(name)
    trainer.one_logged_run(["wandb"], tmp_path, resume=str(tmp_path / "checkpoint-25"))
    assert os.environ["WANDB_RUN_ID"] == first  # resumed: the same run
    monkeypatch.delenv("WANDB_RUN_ID")
    (tmp_path / "wandb-run-id").write_text("$(reboot)\n")  # not an id: a new run, not this text
    trainer.one_logged_run(["wandb"], tmp_path, resume=str(tmp_path / "checkpoint-25"))
    assert re.fullmatch(r"[0-9a-f]{16}", os.environ["WANDB_RUN_ID"])
