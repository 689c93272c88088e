"""Typed errors. Anything a user can fix is a ``CtrainError``: the CLI prints its message, not a traceback."""

from __future__ import annotations

from collections.abc import Sequence

from ctrain.redact import redact, redact_command


class CtrainError(Exception):
    """An error whose message tells the user what went wrong and what to do."""

    exit_code: int = 1


class ConfigError(CtrainError):
    """A settings file, recipe or flag is invalid.

    ``key`` is the dotted setting at fault, when known, so the message can point at its line.
    """

    exit_code = 2

    def __init__(self, message: str = "", *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ToolNotFound(CtrainError):
    """An external program is missing; the message says how to install it."""

    exit_code = 3


class NonFiniteTraining(CtrainError):
    """The loss or gradient norm became NaN or infinite: the run stops before saving that state.

    A distinct exit code, so a job script does not requeue it (resuming would diverge again).
    """

    exit_code = 65  # EX_DATAERR from sysexits.h: the numbers went bad, requeueing will not help


class DiskFull(CtrainError):
    """A save filled the file system a run writes to: a requeue would write to the same one, so the
    batch script does not requeue it (cause ``disk-full``)."""


class NodeUnfit(CtrainError):
    """A node failed the job's preflight (``ctrain.train.health``): the batch script requeues the job
    without it, as it does for a lost node."""


class CommandError(CtrainError):
    """An external program failed; carries the command, its stderr and stdout.

    Credentials are masked (:mod:`ctrain.redact`) in all three as they are stored, so neither the
    printed message nor anything that reads the attributes can show one.
    """

    def __init__(self, cmd: Sequence[str], returncode: int, stderr: str = "", stdout: str = "") -> None:
        self.cmd = redact_command(cmd)
        self.returncode = returncode
        self.stderr = redact(stderr)
        self.stdout = redact(stdout)
        super().__init__(self._message())

    def _message(self) -> str:
        from shlex import join

        text = f"command failed (exit {self.returncode}): {join(self.cmd)}"
        detail = (self.stderr or self.stdout).strip()
        if detail:
            lines = detail.splitlines()
            if len(lines) > 40:
                lines = ["..."] + lines[-40:]
            text += "\n" + "\n".join("  " + line for line in lines)
        return text


class ParseError(CtrainError):
    """Tool output did not have the shape we expected; carries the raw text."""

    def __init__(self, what: str, raw: str) -> None:
        self.raw = raw
        super().__init__(f"could not parse {what}; raw output was:\n{raw.rstrip()}")
