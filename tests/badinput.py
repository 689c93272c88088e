"""The bad-input contract, shared by the table-driven tests of every command.

A user's mistake (a broken recipe, a missing image, a read-only directory, counts that do not
fit) must end in exactly one ``error:`` line that says what to do, a non-zero exit, no Python
traceback, and nothing written or left behind. Each case runs the real ``ctrain`` entry point
as a subprocess in its own directory, so what the command leaves on disk can be compared.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Setup = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    """One hostile input: how to set it up, the command line, and what the error must say."""

    id: str
    args: Sequence[str]
    says: Sequence[str]
    setup: Setup | None = None
    exit_code: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    max_seconds: float = 10.0
    # Paths (relative to the case's directory) the command may create, such as a lock it removes.
    may_leave: Sequence[str] = ()
    # A command the run goes through, such as read_only(...): WRAP... python -m ctrain ARGS.
    wrap: Sequence[str] = ()


def read_only(*paths: str) -> tuple[str, ...]:
    """A ``wrap`` that mounts ``paths`` (relative to the case's directory) read-only for the command alone,
    in a private mount namespace: writing there fails with EROFS, for root too (root ignores modes)."""
    mounts = " && ".join(
        f"mount --bind {q} {q} && mount -o remount,bind,ro {q}" for q in (shlex.quote(p) for p in paths)
    )
    as_root = () if os.geteuid() == 0 else ("--map-root-user",)
    return ("unshare", "--mount", *as_root, "sh", "-c", f'{mounts} && exec "$@"', "sh")


@functools.cache
def can_wrap_read_only() -> bool:
    """Whether :func:`read_only` works here (unshare present, mount namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*read_only("."), "true"], cwd="/tmp", capture_output=True, check=False)
    return probe.returncode == 0


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    found: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


def run_case(case: Case, workdir: Path, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    """Set the case up in ``workdir``, run ``ctrain`` there and assert the bad-input contract."""
    workdir.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        case.setup(workdir)
    before = _snapshot(workdir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", **case.env}
    env.pop("CTRAIN_CONFIG", None)
    # The command runs in ``workdir``: a relative PYTHONPATH (PYTHONPATH=src) must still find this checkout.
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    started = time.monotonic()
    result = subprocess.run(
        [*case.wrap, python, "-m", "ctrain", *case.args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=max(60.0, case.max_seconds * 6),
        check=False,
    )
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    where = f"ctrain {' '.join(case.args)}\n--- output ---\n{output}"
    assert result.returncode != 0, f"exit 0 for bad input: {where}"
    if case.exit_code is not None:
        assert result.returncode == case.exit_code, f"exit {result.returncode}, expected {case.exit_code}: {where}"
    assert "Traceback" not in output, f"traceback: {where}"
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"{len(errors)} 'error:' lines, expected exactly 1: {where}"
    message = output[output.index("error:"):]
    for text in case.says:
        assert text.lower() in message.lower(), f"the error does not say {text!r}: {where}"
    assert elapsed < case.max_seconds, f"took {elapsed:.1f} s (limit {case.max_seconds} s): {where}"
    after = _snapshot(workdir)
    allowed = set(case.may_leave)
    new = sorted(p for p in after if p not in before and not any(p == a or p.startswith(a + "/") for a in allowed))
    changed = sorted(p for p in before if p in after and after[p] != before[p] and not Path(workdir, p).is_dir())
    assert not new, f"left behind {new}: {where}"
    assert not changed, f"changed {changed}: {where}"
    return result
