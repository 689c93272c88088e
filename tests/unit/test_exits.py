"""Each rank's record of why it ended (ctrain.train.exits), which the batch script decides from."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctrain.errors import ConfigError, CtrainError, DiskFull, NonFiniteTraining, ToolNotFound
from ctrain.train import exits

ROOT = Path(__file__).resolve().parents[2]


def raised(exc: BaseException, filename: str = "train_script.py") -> BaseException:
    """EXC with a traceback whose innermost frame is in FILENAME (where a collective or the training code raised it)."""
    code = compile("raise exc", filename, "exec")
    try:
        exec(code, {"exc": exc})
    except BaseException as caught:  # noqa: BLE001 - handed back as it was raised
        return caught
    raise AssertionError("not raised")


@pytest.mark.parametrize(
    ("exc", "code", "cause", "retry"),
    [
        (NonFiniteTraining("step 5: loss nan"), 65, "nonfinite", False),
        (ConfigError("training.bogus is not a setting"), 2, "config", False),
        (ToolNotFound("peft is not installed"), 3, "environment", False),
        (CtrainError("the final model cannot be read back"), 1, "error", False),
        (ValueError("labels and logits differ in length"), 1, "exception", False),
        (MemoryError(), 1, "out-of-memory", False),
        (OSError(errno.ENOSPC, "No space left on device"), 1, "disk-full", False),
        (DiskFull("the file system of outputs is full and a save failed"), 1, "disk-full", False),
        (OSError(errno.EIO, "Input/output error"), 1, "io", True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), 1, "peer", True),
        (KeyboardInterrupt(), 130, "interrupted", True),
    ],
)
def test_each_way_a_rank_ends_has_a_cause_and_a_retry_rule(exc: BaseException, code: int, cause: str,
                                                         retry: bool) -> None:  # fmt: skip
    record = exits.classify(raised(exc), 1)
    assert (record.code, record.cause, record.retry) == (code, cause, retry)


def test_an_error_raised_inside_torch_distributed_is_a_peers_failure() -> None:
    """A collective that fails because another rank died raises whatever the backend raises; where it
    was raised (torch/distributed/) says it, whatever the message."""
    exc = raised(RuntimeError("something unexpected"), "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py")
    assert exits.classify(exc, 1).cause == "peer"
    assert exits.classify(raised(RuntimeError("something unexpected")), 1).cause == "exception"


def test_returned_codes_and_exits() -> None:
    assert exits.classify(None, 0).cause == "done"
    assert (exits.classify(None, 75).cause, exits.classify(None, 75).retry) == ("preempted", True)
    assert exits.classify(raised(SystemExit(0)), 1).cause == "done"
    stopped = exits.classify(raised(SystemExit(4)), 1)
    assert (stopped.code, stopped.cause) == (4, "error")


def test_every_cause_has_a_rule_and_the_docs_list_them() -> None:
    text = (ROOT / "docs" / "training.md").read_text()
    for cause, retry in exits.CAUSES.items():
        assert f"`{cause}`" in text, f"docs/training.md does not list the exit cause {cause}"
    assert set(exits.CAUSES) >= {"nonfinite", "config", "exception", "peer", "preempted"}


def test_the_message_is_one_printable_bounded_line() -> None:
    exc = raised(ValueError("first line\nsecond\tline \x1b[31m$(touch x)" + "y" * 1000))
    record = exits.classify(exc, 1)
    assert "\n" not in record.message and "\x1b" not in record.message
    assert record.message.startswith("ValueError: first line second line ?[31m$(touch x)")
    assert len(record.message) == exits.MESSAGE_CHARS and record.message.endswith("...")


def test_the_record_is_one_line_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(exits.EXITS_ENV, raising=False)
    exits.record(raised(NonFiniteTraining("step 5: loss nan")))
    assert not list(tmp_path.iterdir())  # outside the batch scripts: nothing written
    monkeypatch.setenv(exits.EXITS_ENV, str(tmp_path / "exit"))
    exits.record(raised(NonFiniteTraining("step 5: loss nan")))
    (written,) = (tmp_path / "exit").iterdir()
    assert written.name == "rank-3"
    code, cause, retry, host, message = written.read_text().rstrip("\n").split(" ", 4)
    assert (code, cause, retry, message) == ("65", "nonfinite", "end", "step 5: loss nan")
    assert host and written.read_text().count("\n") == 1


def test_ctrain_train_records_a_recipe_error_before_importing_the_training_stack(tmp_path: Path) -> None:
    """The real command, as the batch scripts run it: a bad override is recorded as a config error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), exits.EXITS_ENV: str(tmp_path / "exit"), "RANK": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "ctrain", "train", str(ROOT / "recipes" / "demo-addition.yaml"), "training.bogus=1"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    line = (tmp_path / "exit" / "rank-1").read_text()
    assert line.startswith("2 config end ") and "training.bogus" in line, line


def _loop(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """A plain training loop of a user's own with ctrain.train.script's opt-in, as the sbatch scripts run it."""
    program = (
        "import os, signal\n"
        "from ctrain.train import script\n"
        "script.start()\n"
        "for step in range(1, 1000):\n"
        "    script.beat(step)\n" + body
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), exits.EXITS_ENV: str(tmp_path / "exit"),
           "CTRAIN_HEARTBEATS": str(tmp_path / "beats"), "RANK": "0"}  # fmt: skip
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env,
                          check=False)  # fmt: skip


def test_a_plain_loop_stops_at_a_signal_with_the_requeue_code(tmp_path: Path) -> None:
    result = _loop(tmp_path, "    if step == 3:\n        os.kill(os.getpid(), signal.SIGUSR1)\n"
                             "    if script.stop_requested():\n        print('saved', step)\n"
                             "        script.exit_preempted()\n")  # fmt: skip
    assert result.returncode == 75, result.stderr
    assert result.stdout == "saved 3\n"
    assert (tmp_path / "exit" / "rank-0").read_text().startswith("75 preempted retry ")
    assert (tmp_path / "beats" / "rank-0").read_text().split()[0] == "1"  # one write a second at most


def test_an_error_in_a_plain_loop_is_recorded_and_still_reported(tmp_path: Path) -> None:
    result = _loop(tmp_path, "    if step == 2:\n        raise ValueError('shapes differ')\n")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: shapes differ" in result.stderr
    line = (tmp_path / "exit" / "rank-0").read_text()
    assert line.startswith("1 exception end ") and line.endswith(" ValueError: shapes differ\n"), line
