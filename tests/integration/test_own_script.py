"""A training script of your own with ctrain's opt-in (examples/train_clm.py, transformers' Trainer
and ``ctrain.train.hf.Callback``), run as the sbatch scripts run it, but as one process here: a
preemption signal ends it at a checkpoint with exit 75 and a record saying so, and the next run
resumes from that checkpoint to the same losses as a run never interrupted. The 2-node runs
through Slurm are in test_sbatch_commands.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_clm.py"
STEPS = 100

pytestmark = [pytest.mark.integration]


def start(output: Path, tmp_path: Path) -> subprocess.Popen[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CTRAIN_HEARTBEATS": str(tmp_path / "beats"),
           "CTRAIN_EXITS": str(tmp_path / "exits")}  # fmt: skip
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, str(SCRIPT), "--output_dir", str(output), "--max_steps", str(STEPS)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def losses(output: str) -> dict[str, float]:
    found = re.search(r"^losses (\{.*\})$", output, re.MULTILINE)
    assert found, output[-3000:]
    return json.loads(found[1])


def test_a_signalled_script_checkpoints_exits_75_and_resumes_to_the_same_losses(tmp_path: Path) -> None:
    whole = start(tmp_path / "whole", tmp_path / "a")
    reference = losses(whole.communicate(timeout=600)[0])
    assert whole.returncode == 0

    run = tmp_path / "b"
    first = start(run / "out", run)
    beat = run / "beats" / "rank-0"
    deadline = time.monotonic() + 300
    while not beat.exists():  # its first step is done
        assert first.poll() is None and time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)  # as Slurm sends it at a requeue or preemption
    log = first.communicate(timeout=300)[0]
    assert first.returncode == 75, log[-3000:]
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (run / "out").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and 1 <= checkpoints[0] < STEPS, checkpoints
    assert (run / "exits" / "rank-0").read_text().startswith("75 preempted retry ")
    assert not (run / "out" / "final").exists()  # the script's own final save never ran

    second = start(run / "out", run)
    log = second.communicate(timeout=600)[0]
    assert second.returncode == 0, log[-3000:]
    resumed = losses(log)
    # The curve (before the checkpoint: from its trainer state; after: trained again) is the uninterrupted
    # one, but for the first logged step after the checkpoint, whose mean covers only the steps since it.
    assert resumed.keys() == reference.keys()
    straddled = min(int(step) for step in reference if int(step) > checkpoints[0])
    for step, loss in reference.items():
        if int(step) != straddled:
            assert resumed[step] == pytest.approx(loss, rel=1e-4), (step, resumed, reference)
    assert beat.read_text().startswith("done ")
    assert (run / "out" / "final").is_dir()
