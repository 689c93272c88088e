"""The bad-input contract, shared by the table-driven tests of every command.

A user's mistake (a broken recipe, a missing image, a read-only directory, counts that do not
fit) must end in exactly one ``error:`` line that says what to do, a non-zero exit, no Python
traceback, and nothing written or left behind. Each case runs the real ``ctrain`` entry point
as a subprocess in its own directory, so what the command leaves on disk can be compared.

A read-only directory or a full disk is made for the command alone, in a private mount
namespace (``unshare -m``; root only): a read-only bind mount of the directory onto itself, or a
small tmpfs over it, gone when the command ends. Before it ends, what the command left in the
full tmpfs is listed, so "nothing left behind" holds there too.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ctrain

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
    # A command still running after this long is taken as hung, the failure these cases can show in
    # time; how fast an error comes is a figure for the benchmarks, not an assertion here.
    hang_seconds: float = 120.0
    # Paths (relative to the case's directory) the command may create, such as a lock it removes.
    may_leave: Sequence[str] = ()
    # Text the output must not contain anywhere (a password given in a URL, say).
    never_says: Sequence[str] = ()
    # Directories (relative to the case's directory, made by setup) the command sees read-only.
    read_only: Sequence[str] = ()
    # Directories (relative, made by setup) the command sees as a nearly full disk (a tmpfs of full_size).
    full_disk: Sequence[str] = ()
    full_size: str = "1m"
    # Run without root's power over file modes (CAP_DAC_OVERRIDE), so a chmod 000 file is unreadable.
    respect_modes: bool = False


_LEFTOVER = "badinput-leftover: "


def _text(output: bytes | str | None) -> str:
    """What a timed-out process printed (bytes there, whatever ``text=`` said)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


_SOURCE = str(Path(ctrain.__file__).resolve().parents[1])


def _namespaced(case: Case, workdir: Path, command: list[str]) -> list[str]:
    """``command`` in a private mount namespace with the case's read-only and full directories (and
    without root's power over file modes, when asked); afterwards it lists what stayed in the full
    ones (``badinput-leftover:`` lines)."""
    if case.respect_modes:
        dropped = "-dac_override,-dac_read_search"
        command = ["setpriv", f"--bounding-set={dropped}", f"--inh-caps={dropped}", *command]
    if not case.read_only and not case.full_disk:
        return command
    quoted = {d: shlex.quote(str(workdir / d)) for d in [*case.read_only, *case.full_disk]}
    mounts = [f"mount --bind -o ro {quoted[d]} {quoted[d]}" for d in case.read_only]
    mounts += [f"mount -t tmpfs -o size={shlex.quote(case.full_size)} tmpfs {quoted[d]}" for d in case.full_disk]
    listing = " ".join(quoted[d] for d in case.full_disk)
    script = (
        " && ".join(mounts) + ' || exit 99; "$@"; rc=$?; '
        + (f'for d in {listing}; do ls -A "$d" | sed "s|^|{_LEFTOVER}$d/|" >&2; done; ' if listing else "")
        + "exit $rc"
    )
    return ["unshare", "-m", "sh", "-c", script, "sh", *command]


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
    # The command runs the ctrain these tests import, whatever the working directory: a relative
    # PYTHONPATH (PYTHONPATH=src) would not reach it from the case's directory.
    env["PYTHONPATH"] = os.pathsep.join([_SOURCE, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env.pop("CTRAIN_CONFIG", None)
    try:
        result = subprocess.run(
            _namespaced(case, workdir, [python, "-m", "ctrain", *case.args]),
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=case.hang_seconds,
        )
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"ctrain {' '.join(case.args)} hung: still running after {case.hang_seconds:.0f} s\n"
                             f"--- output ---\n{_text(hung.stdout)}{_text(hung.stderr)}") from None
    output = result.stdout + result.stderr
    where = f"ctrain {' '.join(case.args)}\n--- output ---\n{output}"
    assert result.returncode != 99 or not (case.read_only or case.full_disk), f"mounts failed (root?): {where}"
    assert result.returncode != 0, f"exit 0 for bad input: {where}"
    if case.exit_code is not None:
        assert result.returncode == case.exit_code, f"exit {result.returncode}, expected {case.exit_code}: {where}"
    assert "Traceback" not in output, f"traceback: {where}"
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"{len(errors)} 'error:' lines, expected exactly 1: {where}"
    message = output[output.index("error:"):]
    for text in case.says:
        assert text.lower() in message.lower(), f"the error does not say {text!r}: {where}"
    for text in case.never_says:
        assert text not in output, f"the output shows {text!r}: {where}"
    leftovers = [line.removeprefix(_LEFTOVER) for line in output.splitlines() if line.startswith(_LEFTOVER)]
    assert not leftovers, f"left behind on the full disk {leftovers}: {where}"
    after = _snapshot(workdir)
    allowed = set(case.may_leave)
    new = sorted(p for p in after if p not in before and not any(p == a or p.startswith(a + "/") for a in allowed))
    changed = sorted(p for p in before if p in after and after[p] != before[p] and not Path(workdir, p).is_dir())
    assert not new, f"left behind {new}: {where}"
    assert not changed, f"changed {changed}: {where}"
    return result
