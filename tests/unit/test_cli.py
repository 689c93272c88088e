"""The command line: every command's help reads, errors are one line, doctor reports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ctrain import doctor
from ctrain.cli import main
from tests.conftest import STRICT, need, need_root


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in sorted(group.commands.items()):
        path = (*prefix, name)
        found.append(path)
        if isinstance(command, click.Group):
            found.extend(_commands(command, path))
    return found


@pytest.mark.parametrize("path", [(), *_commands(main)], ids=lambda p: " ".join(p) or "ctrain")
def test_every_help_reads(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: ctrain" in result.output
    summary = result.output.split("\n\n")[1].strip()
    assert len(summary) > 15, f"help for {' '.join(path)} has no description"


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("ctrain, version ")


def test_bad_config_is_one_clear_error(tmp_path) -> None:
    config = tmp_path / "ctrain.yaml"
    config.write_text("image:\n  flavour: tpu\n")
    result = CliRunner().invoke(main, ["--config", str(config), "doctor"], standalone_mode=True)
    # doctor does not read the config; a command that does must fail cleanly.
    assert result.exit_code == 0
    from ctrain.cli import project

    @main.command("_probe", hidden=True)
    @click.pass_context
    def _probe(ctx: click.Context) -> None:
        project(ctx)

    try:
        result = CliRunner().invoke(main, ["--config", str(config), "_probe"])
    finally:
        main.commands.pop("_probe")
    assert result.exit_code == 2
    assert "error:" in result.output and "'image.flavour' is 'tpu'; valid values: gpu, cpu" in result.output
    assert "Traceback" not in result.output


def test_doctor_unknown_workflow() -> None:
    result = CliRunner().invoke(main, ["doctor", "--for", "nope"])
    assert result.exit_code == 2  # input to fix (README: exit codes)
    assert "unknown workflow 'nope'; valid:" in result.output


def test_doctor_fails_for_missing_workflow_and_passes_for_present(monkeypatch) -> None:
    present = doctor.Check("x", True, "here")
    absent = doctor.Check("x", False, "gone")
    monkeypatch.setattr(doctor, "CHECKS", {**{k: (lambda: absent) for k in doctor.CHECKS}, "buildah": lambda: present})
    result = CliRunner().invoke(main, ["doctor", "--for", "build"])
    assert result.exit_code == 0, result.output
    assert "build *" in result.output
    result = CliRunner().invoke(main, ["doctor", "--for", "build", "--for", "sif"])
    assert result.exit_code == 1
    assert "MISSING" in result.output and "needs apptainer" in result.output


def test_doctor_real_checks_on_this_machine() -> None:
    """doctor agrees with this machine: a tool is found exactly when PATH (or the venv) has it, at that
    path; a Python package exactly when it can be imported, with its installed version. On the suite's
    machine (scripts/setup.sh: CI, strict mode) the image, conversion, push, training and cluster
    workflows are ready, and with no NVIDIA driver the GPU one is not."""
    import importlib.metadata
    import importlib.util

    results = doctor.run_checks()
    venv = os.path.dirname(sys.executable)
    for name in ("apptainer", "buildah", "skopeo", "umoci", "mksquashfs", "enroot", "rsync", "ssh", "sbatch", "srun",
                 "pcluster", "nvidia-smi"):  # fmt: skip
        found = shutil.which(name) or shutil.which(name, path=venv)
        if found:
            assert results[name].ok and found in results[name].detail, (name, results[name])
        elif results[name].ok:  # found under another name of the same tool (apptainer's singularity)
            assert os.access(results[name].detail.rsplit("(", 1)[-1].rstrip(")"), os.X_OK), results[name]
    for module in ("torch", "transformers", "trl", "datasets", "accelerate", "deepspeed"):
        installed = importlib.util.find_spec(module) is not None
        assert results[module].ok == installed, results[module]
        if installed:
            assert results[module].detail == importlib.metadata.version(module), results[module]
    if not shutil.which("nvidia-smi"):
        assert not results["gpus"].ok and "nvidia-smi not found" in results["gpus"].detail
        assert doctor.workflow_status(results, "gpu") == ["nvidia-smi", "gpus"]
    if STRICT:
        for workflow in ("build", "sif", "sqsh", "push", "train", "cluster"):
            assert doctor.workflow_status(results, workflow) == [], (workflow, results)
        text, ready = doctor.report(["build", "sif", "sqsh", "push", "train", "cluster"])
        assert ready, text
        for name in ("apptainer", "sbatch", "slurm controller", "gpus", "pcluster"):
            assert name in text


def test_doctor_sqsh_needs_enroot_or_the_whole_writer_toolset(monkeypatch) -> None:
    def only(*names: str) -> dict:
        return {k: (lambda k=k: doctor.Check(k, k in names, "")) for k in doctor.CHECKS}

    monkeypatch.setattr(doctor, "CHECKS", only("mksquashfs", "skopeo"))
    text, ready = doctor.report(["sqsh"])
    assert not ready and "needs enroot or mksquashfs+skopeo+umoci" in text
    monkeypatch.setattr(doctor, "CHECKS", only("mksquashfs", "skopeo", "umoci"))
    assert doctor.report(["sqsh"])[1]
    monkeypatch.setattr(doctor, "CHECKS", only("enroot"))
    assert doctor.report(["sqsh"])[1]


def test_the_roots_own_errors_are_one_error_line_too() -> None:
    """click's `Error:` with usage above it, for the root's options, becomes ctrain's one `error:` line."""
    for args, said in ((["--bogus"], "error: No such option '--bogus'. (see ctrain --help)"),
                       (["--config", "/nonexistent.yaml", "status"], "error: Invalid value for '--config'")):  # fmt: skip
        result = subprocess.run([sys.executable, "-m", "ctrain", *args], capture_output=True, text=True, check=False)
        assert result.returncode == 2 and result.stdout == "", result
        assert result.stderr.startswith(said) and result.stderr.count("\n") == 1, result.stderr


def test_job_ids_and_signals_are_checked_before_slurm_sees_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("３４", "١٢٣", "12_٣", "12;x", "1 2", "1.2;3"):
        result = CliRunner().invoke(main, ["cancel", bad])
        assert result.exit_code != 0 and f"is not a Slurm job id" in result.output, (bad, result.output)
    for bad in ("KILL;x", "USR1 2", "", "NOPE", "99", "RTMIN", "RTMIN+1", "WINCH"):
        result = CliRunner().invoke(main, ["cancel", "--signal", bad, "12"])
        assert result.exit_code != 0 and "is not a signal" in result.output, (bad, result.output)


def test_a_controller_that_cannot_be_reached_is_said_in_one_line() -> None:
    """Real squeue and scancel where no cluster configuration can be found (an empty /etc/slurm in a
    mount namespace of their own, no SLURM_CONF: Slurm then looks the controller up in DNS, fails at
    once, and says why only in its last line)."""
    need(shutil.which("squeue") is not None and shutil.which("unshare") is not None, "Slurm's client commands, unshare")
    need_root()
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    for args in (["status", "12"], ["cancel", "12"], ["logs", "12"]):
        result = subprocess.run(["unshare", "--mount", "sh", "-c", 'mkdir -p /etc/slurm && mount -t tmpfs tmpfs /etc/slurm && exec "$@"', "sh",
                                 sys.executable, "-m", "ctrain", *args], capture_output=True, text=True, env=env,
                                timeout=120, check=False)  # fmt: skip
        assert result.returncode != 0 and result.stdout == "", result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot reach the Slurm controller" in lines[0] and "scontrol ping" in lines[0], (
            args, result.stderr)


def test_every_install_command_names_the_distribution_ctrain_installs_under() -> None:
    """The index's ``ctrain`` is an unrelated project: pyproject's name is DISTRIBUTION, and no
    message, doc or script tells anyone to install ``ctrain`` itself (``ctrain[train]``, ...)."""
    import re
    import tomllib

    from ctrain import DISTRIBUTION, install_hint

    root = Path(__file__).resolve().parents[2]
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"] == DISTRIBUTION
    assert install_hint("train") == f"pip install '{DISTRIBUTION}[train]'"
    wrong = re.compile(r"(pipx?|uv pip) install\s+['\"]?ctrain(\[|==|\s|$|['\"])")
    found = []
    for path in [root / "README.md", *root.glob("docs/*.md"), *root.glob("src/ctrain/**/*.py"), *root.glob("scripts/*")]:
        if path.is_file():
            found += [f"{path.relative_to(root)}: {line.strip()}" for line in path.read_text().splitlines() if wrong.search(line)]
    assert not found, found


@pytest.mark.parametrize("command", [["train", "RECIPE"], ["prepare", "RECIPE"], ["eval", "RECIPE"], ["bench", "--tiny"]])
def test_the_training_commands_without_the_training_stack_say_how_to_get_it(tmp_path: Path, command: list[str]) -> None:
    """A login node or laptop with the core install only: one error line (exit 3) with the install
    that gives the image's versions, not a ModuleNotFoundError. Python is told torch and trl are
    absent (a None in sys.modules, as find_spec sees a package that is not installed)."""
    from tests.plugins.train import TINY_RECIPE

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = sys.modules['trl'] = None\n")
    (tmp_path / "r.yaml").write_text(TINY_RECIPE)
    args = [str(tmp_path / "r.yaml") if a == "RECIPE" else a for a in command]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run([sys.executable, "-m", "ctrain", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"error: `ctrain {command[0]}` needs the training stack, and torch, trl are not installed")
    assert "pip install 'ctrain-slurm[train]' -c " in lines[0] and "constraints.txt --extra-index-url" in lines[0]


def test_doctor_reads_a_json_version_as_pcluster_prints_it() -> None:
    from ctrain.doctor import _version_line

    assert _version_line('{\n  "version": "3.13.2"\n}') == "version 3.13.2"
    assert _version_line("apptainer version 1.4.5\nmore") == "apptainer version 1.4.5"
    assert _version_line("{ not json") == "" and _version_line("") == ""
