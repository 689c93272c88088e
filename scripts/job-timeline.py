#!/usr/bin/env python3
"""Where a job's time goes at its edges, on the testbed: `sbatch` to the first training step, and
the last step to the job's end, timed from outside (the log and the controller polled every 0.1 s).

    .venv/bin/python scripts/job-timeline.py PROJECT_DIR IMAGE.sif [--runs N] [--clear-cache] [--lib FILE] [SCRIPT]

PROJECT_DIR is a project on the testbed's shared directory that the job user owns (sbatch/,
recipes/); SCRIPT is its batch script (default sbatch/apptainer_multinode.sbatch). Each run trains
the demo recipe 20 steps on 2 nodes x 2 processes. --clear-cache empties the job user's image cache
on the nodes before each run (a cold start); --lib runs the jobs with another sbatch library
(CTRAIN_SBATCH_LIB: an earlier version, as a baseline). Prints one line per run (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import pwd
import re
import shutil
import subprocess
import time
from pathlib import Path

from ctrain.slurm import Slurm
from ctrain.testbed import Testbed

STEPS = 20


def run(tb: Testbed, project: Path, image: Path, script: str, lib: Path | None) -> tuple[float, float, float]:
    """(sbatch to first step, last step to the job's end, whole job) in seconds."""
    client = Slurm(tb.user_runner({"IMAGE": str(image), **({"CTRAIN_SBATCH_LIB": str(lib)} if lib else {})}))
    started = time.monotonic()
    job = client.sbatch(["--ntasks-per-node=2", f"--job-name=timeline{STEPS}", script, "recipes/demo-addition.yaml",
                         f"training.max_steps={STEPS}", "training.save_steps=1000",
                         f"training.output_dir=/outputs/timeline-{time.monotonic_ns()}"], cwd=project)  # fmt: skip
    log = project / "logs" / f"timeline{STEPS}-{job}.out"
    first = last = None
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        now = time.monotonic()
        if first is None and re.search(r"step 1/\d+, loss", text):
            first = now
        if last is None and re.search(rf"step {STEPS}/{STEPS}, loss", text):
            last = now
        if last is not None and not client.squeue([job]):
            ended = time.monotonic()
            break
        if now - started > 900:
            raise SystemExit(f"job {job} did not end in 900 s: {log}")
        time.sleep(0.1)
    state = tb.job_state(job)
    if state != "COMPLETED" or first is None:
        raise SystemExit(f"job {job} ended {state}: {log}")
    return first - started, ended - last, ended - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", type=Path)
    parser.add_argument("image", type=Path)
    parser.add_argument("script", nargs="?", default="sbatch/apptainer_multinode.sbatch")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clear-cache", action="store_true")
    parser.add_argument("--lib", type=Path)
    args = parser.parse_args()
    tb = Testbed()
    cache = Path("/tmp") / f"ctrain-images-{pwd.getpwnam(tb.user).pw_uid}"  # the nodes share this /tmp
    for number in range(1, args.runs + 1):
        if args.clear_cache and cache.exists():
            for entry in cache.iterdir():
                if entry.is_dir():
                    subprocess.run(["chmod", "-R", "u+rwX", str(entry)], check=True)  # read-only image dirs
                    shutil.rmtree(entry)
        to_first, to_end, whole = run(tb, args.project, args.image, args.script, args.lib)
        how = f"library {args.lib}" if args.lib else ("cache cold" if args.clear_cache else "cache warm")
        if "pyxis" in args.script:  # pyxis has enroot unpack the image at every step's start: no cache
            how = "pyxis, unpacked by enroot at the start"
        print(f"{args.script}, {how}, run {number}: sbatch to step 1 {to_first:.1f} s, "
              f"step {STEPS} to the job's end {to_end:.1f} s, whole job {whole:.1f} s", flush=True)


if __name__ == "__main__":
    main()
