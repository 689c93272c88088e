"""One run across its job ids. A lost node's job goes on as a new job, its continuation
(``sbatch/lib/chain.sh``); ``ctrain status``, ``logs``, ``cancel`` and ``report`` take any job of the run.
The next job is found in each job's log (its ``requeueing as job N`` line), which the commands read here
or over SSH alike; the run a continuation belongs to, in the project's ``.ctrain/JOB.run``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from ctrain import protocol, slurm
from ctrain.errors import CtrainError
from ctrain.files import read_text_bounded

# The most jobs one run is followed through: CTRAIN_MAX_REQUEUES (10 by default) caps a run's restarts,
# and a log that names a job already seen ends the walk.
MAX_JOBS = 100


def next_job(client: slurm.Slurm, job_id: str, search: Iterable[Path]) -> str | None:
    """The job that continues JOB_ID's run, as JOB_ID's log says; None when it says none (or cannot be read)."""
    try:
        return protocol.continued_as(client.read_log(job_id, search=search))
    except CtrainError:
        return None


def jobs_from(client: slurm.Slurm, job_id: str, search: Iterable[Path]) -> list[str]:
    """JOB_ID and every job that continued its run after it, in order."""
    found = [job_id]
    while len(found) < MAX_JOBS and (after := next_job(client, found[-1], search)) and after not in found:
        found.append(after)
    return found


def run_of(state_dir: Path, job_id: str) -> str:
    """The run JOB_ID belongs to: its first job's id (whose timeline and report are the run's)."""
    path = state_dir / protocol.run_file(job_id)
    try:
        run = read_text_bounded(path, 64, "the run of a continuation").strip()
    except (OSError, CtrainError):
        return job_id
    return run if run.isdigit() and len(run) <= 12 else job_id


def follow(client: slurm.Slurm, job_id: str, *, emit: Callable[[str], None], note: Callable[[str], None],
           search: Iterable[Path]) -> tuple[str, slurm.Job | None]:  # fmt: skip
    """Print the run's log from JOB_ID on as it grows, from job to job as it is continued, until its last
    job ends; that job's id and its final record."""
    seen = {job_id}
    while True:
        final = client.follow(job_id, emit=emit, search=search)
        after = next_job(client, job_id, search)
        if after is None or after in seen or len(seen) >= MAX_JOBS:
            return job_id, final
        note(f"job {job_id}: the run goes on as job {after}")
        seen.add(after)
        job_id = after
