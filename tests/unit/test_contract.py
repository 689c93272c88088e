"""The values Python and the sbatch library (bash) must agree on, read from both sides.

Each is stated in bash for the job (which cannot import ctrain on the host) and in Python for the
trainer and the login-node checks; a change to one side without the other fails here, not in a
job after an hour in the queue."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ctrain.jobs import submit
from ctrain.train.artifacts import PREEMPTED_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "sbatch" / "lib" / "ctrain.sh"


def _bash_values(tmp_path: Path) -> dict[str, str]:
    """CTRAIN_REQUEUE_EXIT, CTRAIN_WORKDIR and the mount targets, as a job computes them."""
    script = f"""
source {LIB}
ctrain_settings apptainer recipes/r.yaml
ctrain_mounts
echo "requeue=$CTRAIN_REQUEUE_EXIT"
echo "workdir=$CTRAIN_WORKDIR"
for mount in "${{CTRAIN_MOUNT_LIST[@]}}"; do target=${{mount#*:}}; echo "target=${{target%%:*}}"; done
"""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CTRAIN_PROJECT_DIR": str(tmp_path),
           "CTRAIN_DATA": str(tmp_path / "data"), "CTRAIN_DRY_RUN": "1"}  # fmt: skip
    out = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    values: dict[str, str] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        values[key] = f"{values[key]} {value}" if key in values else value
    return values


def test_the_requeue_exit_code_is_the_trainers(tmp_path: Path) -> None:
    assert int(_bash_values(tmp_path)["requeue"]) == PREEMPTED_EXIT_CODE


def test_mount_targets_are_the_ones_the_image_makes_and_submit_knows(tmp_path: Path) -> None:
    values = _bash_values(tmp_path)
    bash_targets = set(values["target"].split())
    assert bash_targets == set(submit._CONTAINER_TARGETS)
    for definition in ("Dockerfile", "ctrain-standalone.def"):  # the image makes them, writable
        text = (REPO / "containers" / definition).read_text()
        made = re.search(r"mkdir -p ((?:/\w+ ?)+)", text)
        assert made and set(made.group(1).split()) == bash_targets, (definition, made)
    dockerfile = (REPO / "containers" / "Dockerfile").read_text()
    assert re.search(rf"^WORKDIR {values['workdir']}$", dockerfile, re.MULTILINE)
