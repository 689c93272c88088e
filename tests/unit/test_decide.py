"""The run's decision as a table: ctrain_classify (sbatch/lib/decide.sh) takes facts and gives the
decision, with no file, Slurm command or node involved; and the sentinel's payload, run in a bash
that holds only what it was shipped, decides as the library does."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import need

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "sbatch" / "lib" / "ctrain.sh"

# facts -> decision; the most specific cause first (decide.sh's comment states the order).
TABLE = [
    ({"rc": "0"}, "finish none"),
    ({"rc": "75"}, "requeue none"),
    ({"rc": "0", "signal": "USR1"}, "requeue USR1"),
    ({"rc": "143", "signal": "TERM"}, "leave TERM"),
    ({"rc": "1"}, "probe"),
    ({"rc": "1", "signal": "USR1"}, "probe"),
    ({"rc": "1", "probed": "1"}, "retry step-failed"),
    ({"rc": "1", "probed": "1", "lost": "gpu002"}, "exclude node-lost gpu002"),
    ({"rc": "1", "failed": "1 gpu002"}, "probe"),
    ({"rc": "1", "failed": "1 gpu002", "probed": "1"}, "retry rank-failed"),
    ({"rc": "1", "failed": "1 gpu002", "probed": "1", "signal": "USR1"}, "requeue USR1"),
    ({"rc": "137", "hung": "1", "probed": "1"}, "retry hang"),
    ({"rc": "137", "hung": "1", "signal": "TERM"}, "retry hang"),
    ({"rc": "1", "rank": "3 65 nonfinite gpu002 step 5: loss nan"}, "end rank-nonfinite"),
    ({"rc": "1", "rank": "3 65 nonfinite gpu002 loss nan", "signal": "TERM"}, "leave TERM"),
    ({"rc": "1", "rank": "3 65 nonfinite gpu002 loss nan", "lost": "gpu002"}, "exclude node-lost gpu002"),
    ({"rc": "1", "lost": "gpu001 gpu002", "signal": "TERM"}, "exclude node-lost gpu001 gpu002"),
    ({"rc": "1", "unfit": "gpu002", "nodes": "2"}, "exclude preflight gpu002"),
    ({"rc": "1", "unfit": "gpu001 gpu002", "nodes": "2"}, "end preflight"),
    ({"rc": "1", "unfit": "gpu001", "nodes": "1"}, "exclude preflight gpu001"),
    ({"rc": "1", "unfit": "gpu002", "nodes": "2", "lost": "gpu001"}, "exclude preflight gpu002"),
    ({"rc": "1", "unfit": "gpu002", "nodes": "2", "signal": "USR1"}, "requeue USR1"),
    ({"rc": "9", "requeue_exit": "9"}, "requeue none"),
]


def classify(facts: dict[str, str]) -> subprocess.CompletedProcess[str]:
    args = [f"{key}={value}" for key, value in facts.items()]
    # Nothing but bash itself: no PATH, so a command the classifier ran would fail.
    return subprocess.run(["/bin/bash", "-c", 'source "$0" && ctrain_classify d "$@" && echo "$d"', LIB, *args],
                          env={"PATH": "/nonexistent"}, capture_output=True, text=True, check=False)  # fmt: skip


@pytest.mark.parametrize(("facts", "decision"), TABLE, ids=[d + " " + " ".join(f) for f, d in TABLE])
def test_facts_decide_the_run(facts: dict[str, str], decision: str) -> None:
    out = classify(facts)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.strip() == decision


def test_an_unknown_fact_is_refused() -> None:
    out = classify({"rc": "0", "mystery": "1"})
    assert out.returncode == 2 and "'mystery=1' is not one of its facts" in out.stderr


def test_every_decision_has_an_outcome() -> None:
    """ctrain_outcome, the other pure step: the decided state from what the act did."""
    cases = [("1", "", "1", "", "requeued"), ("", "TERM", "0", "", "left"), ("", "", "0", "", "finished"),
             ("", "", "0", "gpu002", "ended"), ("", "USR1", "1", "", "ended")]  # fmt: skip
    for requeued, signal, rc, lost, outcome in cases:
        out = subprocess.run(["/bin/bash", "-c", 'source "$0" && ctrain_outcome "$@"', LIB, requeued, signal, rc, lost],
                             env={"PATH": "/nonexistent"}, capture_output=True, text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == outcome, (requeued, signal, rc, lost)


def _payload(tmp: Path) -> str:
    env = {"PATH": os.environ["PATH"], "CTRAIN_PROJECT_DIR": str(tmp), "CTRAIN_RUN_DIR": "pids",
           "CTRAIN_NNODES": "2", "CTRAIN_MAX_REQUEUES": "10", "CTRAIN_STEP_GRACE": "1", "CTRAIN_REQUEUE_EXIT": "75",
           "CTRAIN_BATCH_HOST": "gpu001", "CTRAIN_TIMELINE": ".ctrain/4242.timeline", "CTRAIN_DRY_RUN": "0"}  # fmt: skip
    script = 'source "$0"; ctrain_sentinel_payload'
    return subprocess.run(["bash", "-c", script, LIB], env=env, capture_output=True, text=True, check=True).stdout


def test_the_sentinel_ships_what_it_calls_and_nothing_it_does_not(tmp_path: Path) -> None:
    payload = _payload(tmp_path)
    shipped = {line.split()[0] for line in payload.splitlines() if line.endswith(" () ")}
    for called in ("ctrain_sentinel", "ctrain_sentinel_watch", "ctrain_decide", "ctrain_classify", "ctrain_facts",
                   "ctrain_probe", "ctrain_requeue_without", "ctrain_transition", "ctrain_mark", "ctrain_kill_step"):
        assert called in shipped, called  # fmt: skip
    for unrelated in ("ctrain_main", "ctrain_launcher", "ctrain_container_apptainer", "ctrain_sentinel_step"):
        assert unrelated not in shipped, unrelated
    assert "declare -A CTRAIN_LIFE=" in payload and "CTRAIN_BATCH_HOST=\"gpu001\"" in payload


def test_the_sentinel_decides_in_a_bash_that_holds_only_its_payload(tmp_path: Path) -> None:
    """The batch host gone (its heartbeat stops, its slurmd does not answer): the payload, in a bash with
    no library and no CTRAIN_* variable, records gpu001 lost and decides the run (requeued without it)."""
    need(shutil.which("scontrol") is not None, "scontrol (slurm-client)")
    from tests.bashlib import fake_slurm, slurm_conf  # the fake Slurm commands of the library's tests

    fake = fake_slurm(tmp_path)
    (fake / "pids").mkdir()
    (fake / "pids" / "state").write_text("0 running\n")
    (fake / "pids" / "batch-alive").write_text("1\n")
    (fake / "dead").write_text("gpu001\n")
    (fake / "sinfo").write_text("gpu001 down*\ngpu002 alloc\ngpu003 idle\n")
    payload = _payload(fake)
    env = {"PATH": f"{fake / 'bin'}:/usr/bin:/bin", "FAKE": str(fake), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_JOB_PARTITION": "p", "SLURMD_NODENAME": "gpu002",
           "SLURM_CONF": str(slurm_conf(tmp_path / "conf"))}  # fmt: skip
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", payload, "ctrain-sentinel", "gpu001", ""], env=env,
                         cwd=fake, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "ctrain: failure: node lost: gpu001 (the batch host: no heartbeat for 1s" in out.stdout, out.stdout
    assert (fake / "pids" / "state").read_text() == "0 requeued\n"
    assert (fake / "pids" / "lost").read_text() == "gpu001\n"
