"""A new user's first mistakes, each answered by one first line that says what to do (exact text):
the recipe given as a directory or misspelt, a GPU count the cluster cannot give (before what the
recipe would make of it), a flag's value named as the flag typed, a partition that is not there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import slurm
from ctrain.cli import main
from ctrain.config import load_config
from ctrain.errors import ConfigError
from ctrain.jobs import submit
from tests.unit.test_slurm import Sinfo


@pytest.fixture
def laptop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A new project on a laptop: bash on PATH (the rendered script is checked with bash -n), no Slurm."""
    project = tmp_path / "proj"
    assert CliRunner().invoke(main, ["init", str(project)]).exit_code == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.chdir(project)
    return project


def first_line(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2, result.output
    return result.stderr.splitlines()[0]


def test_a_directory_as_the_recipe_is_named_as_one_with_a_file_to_name(laptop: Path) -> None:
    first = sorted(p.name for p in (laptop / "recipes").iterdir() if p.suffix == ".yaml")[0]
    assert first_line("submit", "--dry-run", "recipes") == (
        f"error: the recipe recipes is a directory: name a file in it (such as recipes/{first})")


def test_a_misspelt_recipe_gets_the_closest_file(laptop: Path) -> None:
    assert first_line("submit", "--dry-run", "recipes/demo-additon.yaml") == (
        "error: the recipe recipes/demo-additon.yaml does not exist (did you mean recipes/demo-addition.yaml? "
        f"paths are relative to the project directory {laptop})")


def test_a_flag_out_of_range_is_named_as_typed(laptop: Path) -> None:
    assert first_line("submit", "--dry-run", "--nodes", "0", "recipes/demo-addition.yaml") == (
        "error: --nodes must be at least 1, got 0")


def test_the_same_value_in_ctrain_yaml_is_named_by_its_key(laptop: Path) -> None:
    config = laptop / "ctrain.yaml"
    config.write_text("slurm:\n  nodes: 0\n")
    line = first_line("submit", "--dry-run", "recipes/demo-addition.yaml")
    assert "slurm.nodes must be at least 1, got 0" in line and "--nodes" not in line


def test_more_gpus_than_a_node_has_is_the_first_line_before_the_batch_size(tmp_path: Path) -> None:
    """9,999 GPUs per node would also leave the recipe's global batch indivisible: the GPU count,
    which the user typed, is the line that comes first."""
    (tmp_path / "recipes").mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "recipes" / "demo-addition.yaml", tmp_path / "recipes")
    (tmp_path / "ctrain.yaml").write_text("slurm:\n  image: images/c.sif\n")  # not built yet: a dry run's warning
    job = submit.prepare(load_config(tmp_path / "ctrain.yaml"), recipe="recipes/demo-addition.yaml", gpus_per_node=9999)
    with pytest.raises(ConfigError) as caught:
        submit.check(job, slurm.Slurm(Sinfo("gpu:8\n")), dry_run=True)
    assert str(caught.value) == "9999 GPUs per node requested, but the nodes of this cluster have at most 8"


def test_preflight_dry_run_shows_the_job_with_its_account_and_queues_nothing(laptop: Path) -> None:
    """`ctrain preflight --dry-run` as `submit --dry-run`: the script (its #SBATCH account, the node
    checks at full length, no requeue), the notes, and nothing run or queued (no Slurm here)."""
    result = CliRunner().invoke(main, ["preflight", "--dry-run", "--nodes", "2", "--account", "lab42"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --account=lab42\n" in result.stdout and "#SBATCH --nodes=2\n" in result.stdout
    assert "export CTRAIN_PREFLIGHT=full\n" in result.stdout and "export CTRAIN_MAX_REQUEUES=0\n" in result.stdout
    assert "note: time limit 00:10:00 (slurm.time)" in result.stderr
    assert not (laptop / "logs").exists()


def test_a_recipe_in_a_project_below_is_not_submitted_from_its_parent(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """From the directory above a project (no ctrain.yaml here or above) the parent would become the
    project: the first line names the project instead, and --config from there works."""
    assert CliRunner().invoke(main, ["init", str(tmp_path / "proj")]).exit_code == 0
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("CTRAIN_CONFIG", raising=False)
    assert first_line("submit", "--dry-run", "proj/recipes/demo-addition.yaml") == (
        "error: proj/recipes/demo-addition.yaml is in the project proj/ (its ctrain.yaml), and there is no ctrain.yaml "
        "here or above: run from the project (cd proj), or give ctrain --config proj/ctrain.yaml")
    result = CliRunner().invoke(main, ["--config", "proj/ctrain.yaml", "submit", "--dry-run",
                                       "proj/recipes/demo-addition.yaml"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "logs").exists() and not (tmp_path / "outputs").exists()
