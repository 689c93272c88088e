"""The subprocess layer: argument lists, typed errors with command and stderr, install hints."""

from __future__ import annotations

import sys

import pytest

from ctrain import proc
from ctrain.errors import CommandError, ToolNotFound


def test_run_captures_output() -> None:
    out = proc.run([sys.executable, "-c", "print('hello')"])
    assert out.stdout == "hello\n"
    assert out.returncode == 0


def test_run_failure_carries_command_and_stderr() -> None:
    with pytest.raises(CommandError) as info:
        proc.run([sys.executable, "-c", "import sys; sys.stderr.write('boom here'); sys.exit(3)"])
    err = info.value
    assert err.returncode == 3
    assert err.cmd[0] == sys.executable
    assert "boom here" in err.stderr
    assert "exit 3" in str(err) and "boom here" in str(err)


def test_run_check_false_returns_failure() -> None:
    out = proc.run([sys.executable, "-c", "import sys; sys.exit(4)"], check=False)
    assert out.returncode == 4


def test_arguments_are_not_shell_interpreted(tmp_path) -> None:
    marker = tmp_path / "pwned"
    out = proc.run([sys.executable, "-c", "import sys; print(sys.argv[1])", f"x; touch {marker}"])
    assert out.stdout.strip() == f"x; touch {marker}"
    assert not marker.exists()


def test_env_adds_to_environment() -> None:
    out = proc.run([sys.executable, "-c", "import os; print(os.environ['CTRAIN_T'], 'PATH' in os.environ)"], env={"CTRAIN_T": "v"})
    assert out.stdout.split() == ["v", "True"]


def test_timeout_is_a_command_error() -> None:
    with pytest.raises(CommandError, match="timed out"):
        proc.run([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.5)


def test_missing_tool_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ToolNotFound) as info:
        proc.run(["apptainer", "--version"])
    message = str(info.value)
    assert "`apptainer` or `singularity`" in message
    assert "install" in message


def test_unknown_tool_still_clear(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ToolNotFound, match="`no-such-tool-xyz` not found on PATH"):
        proc.require("no-such-tool-xyz")


def test_which_prefers_first_name(tmp_path, monkeypatch) -> None:
    for name in ("singularity", "apptainer"):
        exe = tmp_path / name
        exe.write_text("#!/bin/sh\necho " + name + "\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert proc.which("apptainer") == str(tmp_path / "apptainer")
    (tmp_path / "apptainer").unlink()
    assert proc.which("apptainer") == str(tmp_path / "singularity")


def test_stream_passes_lines_and_keeps_tail_on_failure() -> None:
    seen: list[str] = []
    code = "import sys\nfor i in range(5): print(f'line {i}', flush=True)\nsys.stderr.write('bad end\\n'); sys.exit(2)"
    with pytest.raises(CommandError) as info:
        proc.stream([sys.executable, "-c", code], on_line=seen.append)
    assert seen[:5] == [f"line {i}" for i in range(5)]
    assert "bad end" in seen
    assert "bad end" in info.value.stderr
    assert info.value.returncode == 2


def test_stream_success_returns_zero() -> None:
    seen: list[str] = []
    assert proc.stream([sys.executable, "-c", "print('ok')"], on_line=seen.append) == 0
    assert seen == ["ok"]


def test_long_stderr_is_trimmed_in_message() -> None:
    err = CommandError(["x"], 1, "\n".join(f"l{i}" for i in range(100)))
    text = str(err)
    assert "l99" in text and "l10\n" not in text and "..." in text


def test_which_finds_tools_beside_the_running_python(tmp_path, monkeypatch) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    tool = venv_bin / "pcluster"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert proc.which("pcluster") == str(tool)
