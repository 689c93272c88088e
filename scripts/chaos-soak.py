#!/usr/bin/env python3
"""A chaos soak on the testbed: one training job meets a seeded random fault every few minutes and
must finish with the final loss of the same job run without faults; `ctrain report` says where the
time went.

    .venv/bin/python scripts/chaos-soak.py IMAGE.sif [--minutes 20] [--seed 1] [--every 150] [--steps 3000]

Runs as root on a 3-node testbed (`ctrain testbed up --nodes 3`): the job uses 2 nodes, so a lost
node leaves it one to be requeued onto. The faults, drawn from ``--seed``:

- ``term``: Slurm's TERM (``scontrol requeue``, as preemption sends it), any number of times;
- ``warn``: the time-limit warning (USR1 to the batch shell), any number of times;
- ``rank``: one rank SIGKILLed (at most once: a second failed rank ends the job, by design);
- ``node``: the newest checkpoint damaged, then a node lost (brought back 30 s later); at most once,
  since the job keeps the node excluded and the testbed has no fourth.

First the reference: the same job with no fault. Prints ``soak |`` lines (docs/reliability.md) and
exits 1 when the soaked job did not complete or its final loss differs by more than ``--tolerance``.
On a cluster of your own, the same job with `scontrol requeue JOB` and `ctrain cancel --signal USR1
JOB` at random times is the part of this soak that needs no root.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ctrain.slurm import Slurm
from ctrain.testbed import Testbed

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/demo-addition.yaml"
LOSS = re.compile(r"step (\d+)/(\d+), loss ([0-9.]+)")


def say(what: str, value: str) -> None:
    print(f"soak | {what} | {value}", flush=True)


def project_dir(tb: Testbed) -> Path:
    path = tb.shared_dir / "soak"
    if path.exists():
        shutil.rmtree(path)
    (path / "logs").mkdir(parents=True)
    for name in ("sbatch", "recipes", "configs"):
        shutil.copytree(REPO / name, path / name)
    subprocess.run(["chown", "-R", f"{tb.user}:", str(path)], check=True)
    return path


def submit(client: Slurm, project: Path, name: str, steps: int) -> str:
    return client.sbatch(["--ntasks-per-node=1", "--nodes=2", f"--job-name={name}", "sbatch/apptainer_multinode.sbatch",
                          RECIPE, f"training.max_steps={steps}", "training.logging_steps=50", "training.save_steps=250",
                          f"training.output_dir=/outputs/{name}"], cwd=project)  # fmt: skip


def log_of(project: Path, name: str, job: str) -> str:
    path = project / "logs" / f"{name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def final_loss(text: str, steps: int) -> float | None:
    found = [float(m[3]) for m in LOSS.finditer(text) if int(m[1]) == steps]
    return found[-1] if found else None


def restarts(tb: Testbed, job: str) -> int:
    record = tb.slurm.run(["scontrol", "show", "job", "-o", job]).stdout
    match = re.search(r"\bRestarts=(\d+)", record)
    return int(match.group(1)) if match else 0


def heartbeats(project: Path, job: str) -> list[tuple[int, str, int]]:
    beats = []
    for path in (project / ".ctrain" / job / "heartbeat").glob("rank-*"):
        fields = path.read_text().split()
        if len(fields) == 3:
            beats.append((int(fields[0] or 0), fields[1], int(fields[2])))
    return beats


def newest_checkpoint(project: Path, name: str) -> Path | None:
    found = [p for p in (project / "outputs" / name).glob("checkpoint-*") if (p / "ctrain-complete.json").exists()]
    return max(found, key=lambda p: int(p.name.split("-")[1])) if found else None


def release(tb: Testbed, job: str, before: int) -> None:
    """After a requeue: let the job start once the testbed's credentials allow (as the tests do)."""
    deadline = time.monotonic() + 120
    while restarts(tb, job) == before and time.monotonic() < deadline:
        time.sleep(1)
    tb.slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now+12"], check=False)


def inject(fault: str, tb: Testbed, project: Path, job: str, name: str) -> str:
    """Inject ``fault`` into the running job; what was done."""
    before = restarts(tb, job)
    if fault == "term":
        tb.slurm.run(["scontrol", "requeue", job])
        release(tb, job, before)
        return "scontrol requeue (TERM)"
    if fault == "warn":
        tb.slurm.run(["scancel", "--batch", "--signal=USR1", job])
        release(tb, job, before)
        return "USR1 to the batch shell"
    if fault == "rank":
        step, host, pid = max(heartbeats(project, job), key=lambda beat: beat[1])
        os.kill(pid, signal.SIGKILL)
        release(tb, job, before)
        return f"SIGKILL of the rank on {host} (pid {pid}, step {step})"
    newest = newest_checkpoint(project, name)
    damaged = "no checkpoint yet"
    if newest is not None:
        weights = next(iter(sorted(newest.glob("*.safetensors"))), None)
        if weights is not None:
            with open(weights, "r+b") as handle:
                handle.truncate(weights.stat().st_size // 2)
            damaged = f"{newest.name}/{weights.name} cut in half"
    node = max(heartbeats(project, job), key=lambda beat: beat[1])[1]
    tb.kill_node(node)
    time.sleep(30)
    tb.start_node(node)
    release(tb, job, before)
    return f"{damaged}, then {node} lost (back 30 s later)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", type=Path)
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--every", type=float, default=150, help="mean seconds between faults")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative difference of the final loss allowed")
    parser.add_argument("--abs-tolerance", type=float, default=0.005, help="or absolute difference (a loss near 0)")
    parser.add_argument("--no-reference", action="store_true", help="skip the run without faults")
    args = parser.parse_args()
    tb = Testbed()
    if len(tb.nodes) < 3 or not tb.is_up():
        sys.exit("error: the soak needs a 3-node testbed: ctrain testbed down; ctrain testbed up --nodes 3")
    project = project_dir(tb)
    client = Slurm(tb.user_runner({"IMAGE": str(args.image)}))
    reference = None
    if not args.no_reference:
        job = submit(client, project, "reference", args.steps)
        started = time.monotonic()
        state = tb.wait(job, timeout=args.minutes * 120)
        reference = final_loss(log_of(project, "reference", job), args.steps)
        say("reference (no fault)", f"job {job} {state} in {time.monotonic() - started:.0f} s, final loss {reference}")
    rng = random.Random(args.seed)
    job = submit(client, project, "soak", args.steps)
    started = time.monotonic()
    budget = {"term": 99, "warn": 99, "rank": 1, "node": 1}
    faults = []
    while tb.job_state(job) in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING"):
        wait = rng.uniform(0.5 * args.every, 1.5 * args.every)
        until = time.monotonic() + wait
        while time.monotonic() < until and tb.job_state(job) in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING"):
            time.sleep(2)
        elapsed = time.monotonic() - started
        if elapsed > args.minutes * 60 or tb.job_state(job) != "RUNNING" or len(heartbeats(project, job)) < 2:
            if elapsed > args.minutes * 60:
                break
            continue
        fault = rng.choice([f for f, left in budget.items() if left > 0])
        budget[fault] -= 1
        did = inject(fault, tb, project, job, "soak")
        faults.append(fault)
        say(f"fault {len(faults)} at {elapsed:.0f} s", f"{fault}: {did}")
    state = tb.wait(job, timeout=args.minutes * 120)
    text = log_of(project, "soak", job)
    loss = final_loss(text, args.steps)
    say("soaked job", f"job {job} {state} after {time.monotonic() - started:.0f} s, {len(faults)} fault(s) "
                      f"({', '.join(faults)}), {restarts(tb, job)} restart(s), final loss {loss}")  # fmt: skip
    report = subprocess.run([sys.executable, "-m", "ctrain", "report", job], cwd=project, capture_output=True,
                            text=True, check=False)  # fmt: skip
    print(report.stdout + report.stderr, flush=True)
    ok = state == "COMPLETED" and loss is not None
    if ok and reference is not None:
        difference = abs(loss - reference)
        say("final loss against the reference", f"{loss} vs {reference}: difference {difference:.4g}")
        ok = difference <= max(args.tolerance * reference, args.abs_tolerance)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
