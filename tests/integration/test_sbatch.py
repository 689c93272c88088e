"""The sbatch scripts for real on the testbed: Slurm, Apptainer as the job user, the CPU training image.

One multi-node demo run is shared by the assertions about it; the single-node, launcher, pyxis and
requeue runs are short (a few steps each). Every job costs about a minute of start-up on 2 cores
(four Python processes importing the training stack), so there are as few as the issue asks for.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.testbed.demo import busybox
from ctrain.testbed.plan import CRED_EXPIRE_S
from tests.plugins.slurm import Project

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = "recipes/demo-addition.yaml"
JOB_TIMEOUT = 1200
# A few steps, then the final model: enough to see every process train together and save once.
SHORT = ("training.max_steps=4", "training.logging_steps=2", "training.save_steps=1000")
# The plain-sbatch demo trains long enough to log, checkpoint and save on 4 ranks; the accuracy bar
# on 2 nodes x 2 processes is the quickstart's (tests/integration/test_quickstart.py), not repeated.
DEMO_STEPS = ("training.max_steps=60", "training.save_steps=30")


def finish(project: Project, job_id: str) -> str:
    """Wait for the job to end; its log, after checking it completed."""
    state = project.testbed.wait(job_id, timeout=JOB_TIMEOUT)
    log = project.log(job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{log[-8000:]}"
    return log


def launcher_line(log: str, task: int, node: str) -> str:
    """The launcher command node ``node`` ran (printed by each srun task)."""
    match = re.search(rf"^{task}: ctrain: {node}: (.*)$", log, re.MULTILINE)
    assert match, f"no launcher line from {node}:\n{log[-6000:]}"
    return match.group(1)


def submit(project: Project, *args: str, image: Path, env: dict[str, str] | None = None, **options: object) -> str:
    """`ctrain submit --write-script` on the login node (here: as root), then sbatch as the user
    (with ``env`` on top of the user's environment)."""
    script = project.path / "logs" / f"submitted-{time.monotonic_ns()}.sbatch"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    result = CliRunner().invoke(main, ["--config", str(project.path / "ctrain.yaml"), "submit", f"--image={image}",
                                       *flags, f"--write-script={script}", *args])  # fmt: skip
    assert result.exit_code == 0, result.output
    project.own(script)
    return project.sbatch(str(script), env=env)


@pytest.fixture(scope="module")
def project(sbatch_project: Project) -> Project:
    """The user's project with a ctrain.yaml for the testbed: CPU nodes, 2 processes on each."""
    (sbatch_project.path / "ctrain.yaml").write_text("slurm:\n  ntasks_per_node: 2\n")
    sbatch_project.own(sbatch_project.path / "ctrain.yaml")
    return sbatch_project


# --- the demo on 2 nodes x 2 processes, with plain sbatch ------------------------------------------


# What earlier jobs left in the job user's image cache (/tmp: the nodes' local disk, one machine's):
# a half-unpacked image (its job was killed while unpacking), and two images of 40 GiB each by
# their records, last used hours ago, the older one held by a running task. With the demo's image the
# cache is over its 50 GiB: the job skips the held one, evicts the other, and stops there.
GIB_KIB = 1024 * 1024
PLANTED = {"0000000000000000": None, "1111111111111111": 40 * GIB_KIB, "2222222222222222": 40 * GIB_KIB}


def plant_cache(cache: Path, project: Project) -> subprocess.Popen[bytes]:
    """Write :data:`PLANTED` into ``cache``; the process that holds the third entry, as a task does."""
    for age, (key, size) in enumerate(PLANTED.items()):
        entry = cache / key
        (entry / "rootfs" / "usr").mkdir(parents=True, exist_ok=True)
        (entry / "image").write_text(f"/images/planted-{key[0]}.sif\n")
        if size is not None:
            (entry / "size-kib").write_text(f"{size}\n")
            (entry / "complete").write_text("")
            (entry / "used").write_text("")
            os.utime(entry / "used", (time.time() - 3600 * (2 + age),) * 2)  # the held one is the oldest
    project.own(cache)
    subprocess.run(["chmod", "-R", "go-rwx", str(cache)], check=True)
    return subprocess.Popen(["flock", "-s", str(cache / "2222222222222222" / "complete"), "sleep", "3600"],
                            start_new_session=True)


@pytest.fixture(scope="module")
def demo(project: Project, cpu_sif: Path) -> Iterator[tuple[str, str]]:
    """`sbatch sbatch/apptainer_multinode.sbatch` of the demo recipe, as a user types it: job id, log.
    Before it, :data:`PLANTED` entries are put in the job user's image cache."""
    cache = Path("/tmp") / f"ctrain-images-{pwd.getpwnam(project.testbed.user).pw_uid}"
    holder = plant_cache(cache, project)
    try:
        job_id = project.sbatch(
            "--ntasks-per-node=2", "sbatch/apptainer_multinode.sbatch", DEMO, *DEMO_STEPS, env={"IMAGE": str(cpu_sif)}
        )
        yield job_id, finish(project, job_id)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # flock and its sleep
        holder.wait()
        for key in PLANTED:
            shutil.rmtree(cache / key, ignore_errors=True)


def test_the_image_runs_from_the_node_cache_which_stays_bounded(demo: tuple[str, str], cpu_sif: Path,
                                                                project: Project) -> None:  # fmt: skip
    job_id, log = demo
    cache = Path("/tmp") / f"ctrain-images-{pwd.getpwnam(project.testbed.user).pw_uid}"
    entries = set(re.findall(rf"^ctrain: node\d: (?:unpacked {re.escape(str(cpu_sif))} into|the image is cached in) "
                             rf"({re.escape(str(cache))}/[0-9a-f]{{16}})", log, re.MULTILINE))  # fmt: skip
    assert len(entries) == 1, log[:6000]  # both nodes, one entry (their /tmp is one directory here)
    entry = Path(entries.pop())
    assert f"ctrain-image {entry} apptainer exec " in log and f" {entry}/rootfs sh -c " in log
    assert (entry / "complete").is_file() and (entry / "rootfs" / "usr" / "bin").is_dir()
    assert (entry / "image").read_text() == f"{cpu_sif}\n"
    assert not (cache / "0000000000000000").exists()  # half-unpacked: removed
    assert not (cache / "1111111111111111").exists()  # least recently used, not held: evicted
    assert "evicted /images/planted-1.sif (40960 MiB) from the image cache" in log
    assert (cache / "2222222222222222" / "complete").is_file()  # held by a running task: kept
    listed = CliRunner().invoke(main, ["cache", "list", "--dir", str(cache)])
    assert listed.exit_code == 0, listed.output
    assert re.search(rf"^{entry.name} .* ready .* {re.escape(str(cpu_sif))}$", listed.output, re.MULTILINE), listed.output
    assert re.search(r"^2222222222222222 +40\.00 GiB +in use ", listed.output, re.MULTILINE), listed.output


def test_demo_trains_across_two_nodes(demo: tuple[str, str]) -> None:
    job_id, log = demo
    assert "on 2 node(s) [node[1-2]] x 2 process(es)" in log
    port = int(job_id) % 4536 + 61000
    for task, node in ((0, "node1"), (1, "node2")):
        assert launcher_line(log, task, node) == (
            f"torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=node1:{port} "
            f"--rdzv-conf=is_host=false --rdzv-id={job_id} -m ctrain train {DEMO} {' '.join(DEMO_STEPS)}"
        )
    # The trainer's own prefixes: four ranks, two on each node.
    ranks = set(re.findall(r"^\d: \[rank (\d) host (node\d)\]", log, re.MULTILINE))
    assert ranks == {("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")}, sorted(ranks)
    assert re.search(r"on 4 process\(es\)", log), log[-4000:]
    assert "saved the final model and tokenizer to /outputs/demo-addition/final" in log
    # A finished run ends quietly: no launcher's exit barrier lost its store (pytorch#69520).
    assert "Traceback" not in log and "exit barrier" not in log, log[-4000:]


def test_status_and_logs_of_the_finished_demo(demo: tuple[str, str]) -> None:
    job_id, log = demo
    status = CliRunner().invoke(main, ["status", job_id])
    assert re.search(rf"^{job_id}\s+ctrain\s+COMPLETED\s", status.output, re.MULTILINE), status.output
    assert CliRunner().invoke(main, ["logs", job_id]).output == log


# --- one node, through ctrain submit ----------------------------------------------------------------


def poisoned_host(project: Project) -> dict[str, str]:
    """What `module load` or a conda ~/.bashrc leave in a user's shell: a PYTHONPATH whose packages
    break any Python that imports them (a torch, and a sitecustomize that every Python runs), conda's
    variables and a library path. The job's containers must not see them."""
    poison = project.path / "host-python"
    (poison / "torch").mkdir(parents=True, exist_ok=True)
    message = 'raise ImportError("poisoned: the host\'s PYTHONPATH reached the container")\n'
    (poison / "torch" / "__init__.py").write_text(message)
    (poison / "sitecustomize.py").write_text(message)
    project.own(poison)
    return {"PYTHONPATH": str(poison), "CONDA_PREFIX": str(poison), "CONDA_DEFAULT_ENV": "base",
            "LD_LIBRARY_PATH": str(poison)}  # fmt: skip


def test_single_node_apptainer(project: Project, cpu_sif: Path) -> None:
    """Submitted from a shell with a poisoned PYTHONPATH (poisoned_host): the job trains all the same."""
    job_id = submit(project, DEMO, *SHORT, "training.output_dir=/outputs/single", image=cpu_sif, nodes=1,
                    job_name="single", env=poisoned_host(project))  # fmt: skip
    log = finish(project, job_id)
    assert "poisoned" not in log
    assert launcher_line(log, 0, "node1").startswith("torchrun --nnodes=1 --nproc-per-node=2 ")
    assert not re.search(r"^1: ", log, re.MULTILINE)  # one task, one node
    assert (project.path / "outputs" / "single" / "final" / "config.json").is_file()


# --- a new user's first day: a model and a data set from the hub, to nodes without internet ------------


FIRST_DAY_RECIPE = """\
task: sft
seed: 7
model:
  path: org/tiny
data:
  source: org/sums
  format: hub
  eval_size: 16
  max_length: 64
  packing: false
training:
  global_batch_size: 16
  learning_rate: 1.0e-3
logging:
  report_to: []
"""


def test_a_hub_model_and_data_set_fetched_on_the_login_node_train_on_nodes_with_the_hub_offline(
    project: Project, cpu_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recipe naming a model and a data set by hub name: `ctrain submit` refuses it with the `ctrain
    fetch` line that fixes it; `ctrain fetch RECIPE` on the login node (here, from a local server that
    speaks the hub's file API) puts both into the Hugging Face cache on the shared filesystem; the job
    then trains on 2 nodes with the hub offline (HF_HUB_OFFLINE in the container), from that cache."""
    from tests.hubserver import HubRepo, HubServer
    from tests.plugins.train import TINY_RECIPE, run_ctrain

    (tmp_path / "tiny.yaml").write_text(TINY_RECIPE)
    trained = run_ctrain(tmp_path, "train", "tiny.yaml", "training.max_steps=2", "training.output_dir=tiny")
    assert trained.returncode == 0, trained.stderr[-3000:]
    final = tmp_path / "tiny" / "final"
    model = HubRepo("model", "org/tiny", {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()})
    rows = [json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {a}?"},
                                     {"role": "assistant", "content": str(2 * a)}]}) for a in range(200)]  # fmt: skip
    data = HubRepo("dataset", "org/sums", {"data/train.jsonl": ("\n".join(rows) + "\n").encode()})
    recipe = project.path / "recipes" / "first-day.yaml"
    recipe.write_text(FIRST_DAY_RECIPE)
    project.own(recipe)
    home = project.path / "hf-first-day"
    monkeypatch.setenv("HF_HOME", str(home))
    args = ("recipes/first-day.yaml", *SHORT, "training.output_dir=/outputs/first-day")
    refused = CliRunner().invoke(main, ["--config", str(project.path / "ctrain.yaml"), "submit", f"--image={cpu_sif}",
                                        "--write-script", str(tmp_path / "x.sbatch"), *args])  # fmt: skip
    assert refused.exit_code == 2 and "run ctrain fetch org/tiny datasets/org/sums first" in refused.stderr, refused.output
    with HubServer([model, data]) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        fetched = subprocess.run([sys.executable, "-m", "ctrain", "fetch", "recipes/first-day.yaml"], cwd=project.path,
                                 env={**env, "HF_HOME": str(home), "HF_ENDPOINT": server.url,
                                      "HF_HUB_DISABLE_PROGRESS_BARS": "1"}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    project.own(home)
    job_id = submit(project, *args, image=cpu_sif, nodes=2, job_name="first-day", env={"HF_HOME": str(home)})
    log = finish(project, job_id)
    assert re.search(r"training first-day .* on 4 process\(es\)", log), log[-4000:]
    assert (project.path / "outputs" / "first-day" / "final" / "config.json").is_file()
    assert "HF_HUB_OFFLINE" in log and "huggingface.co" not in log


# --- accelerate and DeepSpeed, one multi-node job each ------------------------------------------------


@pytest.mark.full
@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_launcher_on_two_nodes(launcher: str, project: Project, cpu_sif: Path) -> None:
    """Full tier alone; CI tier: test_srun_command_golden (every launcher's line, golden) and
    test_accelerate_machine_rank_per_node (each node's rank), with torchrun's rendezvous across two
    nodes in test_faults_in_turn_each_checkpoint_resume_or_end_the_run."""
    # One process per node: what is under test is the launcher's rendezvous across nodes, and each
    # process's start (the training stack, DeepSpeed) is what these jobs spend their time on.
    job_id = submit(project, DEMO, *SHORT, f"training.output_dir=/outputs/{launcher}", image=cpu_sif, nodes=2,
                    ntasks_per_node=1, launcher=launcher, job_name=launcher)  # fmt: skip
    log = finish(project, job_id)
    for task, node in ((0, "node1"), (1, "node2")):
        line = launcher_line(log, task, node)
        if launcher == "accelerate":
            assert line.startswith(
                f"accelerate launch --machine_rank={task} --multi_gpu --num_machines=2 --num_processes=2 "
            )
        else:
            assert line.startswith("torchrun --nnodes=2 --nproc-per-node=1 ")
            assert line.endswith("training.deepspeed?=configs/deepspeed/zero2.json")
    assert re.search(r"on 2 process\(es\)", log), log[-4000:]
    assert (project.path / "outputs" / launcher / "final" / "config.json").is_file()


# --- the time-limit warning: checkpoint, requeue, resume, finish -------------------------------------


def warn_and_release(project: Project, job_id: str) -> None:
    """What `#SBATCH --signal=B:USR1@300` does near the time limit (USR1 to the batch shell only), then
    wait for the batch script's requeue and let the requeued job start as soon as it can."""
    project.testbed.slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
    project.wait_for_log(job_id, r"^ctrain: requeueing job", timeout=600)
    deadline = time.monotonic() + 120
    while "Restarts=1" not in (record := project.testbed.slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout):
        assert time.monotonic() < deadline, record
        time.sleep(1)
    # Slurm holds a requeued job back (about two minutes): let it start once the old job's
    # credential has expired; starting it sooner gets "Job credential revoked" and the job fails.
    project.testbed.slurm.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{CRED_EXPIRE_S + 2}"])


@pytest.mark.full
def test_time_limit_warning_requeues_and_resumes(project: Project, cpu_sif: Path) -> None:
    # Long enough (under a minute on 2 cores) to be warned mid-run; saves only when warned. One
    # process per node: the warning goes to each node's launcher, however many processes it runs.
    """Full tier alone; CI tier: test_faults_in_turn_each_checkpoint_resume_or_end_the_run (the warning
    checkpoints, requeues and resumes)."""
    steps = ("training.max_steps=150", "training.logging_steps=10", "training.save_steps=1000",
             "training.output_dir=/outputs/requeue")  # fmt: skip
    job_id = project.sbatch("--ntasks-per-node=1", "--job-name=requeue", "sbatch/apptainer_multinode.sbatch", DEMO,
                            *steps, env={"IMAGE": str(cpu_sif)})  # fmt: skip
    project.wait_for_log(job_id, r"step [1-9]\d+/150, loss", timeout=JOB_TIMEOUT)
    warn_and_release(project, job_id)
    log = finish(project, job_id)
    first, _, second = log.partition("ctrain: requeueing job")
    stopped = int(re.search(r"saving a complete checkpoint at step (\d+)", first).group(1))
    assert f"checkpoint /outputs/requeue/checkpoint-{stopped} complete" in first
    assert "step exited with" in first and "after SIGUSR1" in first
    assert "Bus error" not in first  # the image's files stayed (squashfuse not signalled)
    assert "restart 1 on 2 node(s)" in second
    assert re.search(r"^ctrain: node\d: the image is cached in ", second, re.MULTILINE)  # not unpacked again
    assert f"resuming from /outputs/requeue/checkpoint-{stopped} " in second
    resumed_steps = [int(n) for n in re.findall(r"step (\d+)/150, loss", second)]
    assert resumed_steps and min(resumed_steps) > stopped, resumed_steps  # it went on, it did not start over
    assert "saved the final model and tokenizer to /outputs/requeue/final" in second
    assert (project.path / "outputs" / "requeue" / "final" / "config.json").is_file()


# --- a training script of your own, through `ctrain submit -- SCRIPT` ---------------------------------


def _losses(log: str) -> dict[str, float]:
    """The per-step losses examples/train_clm.py prints at its end (rank 0, srun's label before it)."""
    found = re.search(r"^\d+: losses (\{.*\})$", log, re.MULTILINE)
    assert found, log[-6000:]
    return json.loads(found[1])


@pytest.mark.full
def test_own_trainer_script_checkpoints_at_the_warning_and_resumes_to_the_same_losses(project: Project,
                                                                                      cpu_sif: Path) -> None:  # fmt: skip
    """examples/train_clm.py (transformers' Trainer with ctrain's one-line callback), 2 nodes x 2
    processes through `ctrain submit -- SCRIPT`: the time-limit warning makes every rank save the same
    step and exit 75, the job is requeued, and the resumed run logs the losses of a run never warned.
    Full tier alone (on the testbed); CI tier:
    test_a_signalled_script_checkpoints_exits_75_and_resumes_to_the_same_losses (the same script and callback,
    two processes)."""
    command = ("--", "examples/train_clm.py", "--max_steps", "80")
    whole = submit(project, *command, "--output_dir", "/outputs/clm-whole", image=cpu_sif, nodes=2,
                   job_name="clm-whole")  # fmt: skip
    reference = _losses(finish(project, whole))
    job_id = submit(project, *command, "--output_dir", "/outputs/clm", image=cpu_sif, nodes=2, job_name="clm")
    beat = project.path / ".ctrain" / job_id / "heartbeat" / "rank-0"

    deadline = time.monotonic() + JOB_TIMEOUT
    while not beat.exists():  # rank 0 has finished a step
        assert time.monotonic() < deadline, project.log(job_id)[-6000:]
        assert project.testbed.job_state(job_id) in ("PENDING", "RUNNING"), project.log(job_id)[-6000:]
        time.sleep(0.5)
    warn_and_release(project, job_id)
    log = finish(project, job_id)
    first, _, second = log.partition("ctrain: requeueing job")
    assert "your command: examples/train_clm.py --max_steps 80 --output_dir /outputs/clm " in first
    assert "step exited with" in first and "after SIGUSR1" in first, first[-4000:]
    assert "has not opted in" not in first  # its heartbeats said it would checkpoint
    # The step the ranks agreed on, and the Trainer's own save at the last step (of the resumed run).
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (project.path / "outputs" / "clm").glob("checkpoint-*"))
    assert len(checkpoints) == 2 and 1 <= checkpoints[0] < 80 and checkpoints[1] == 80, checkpoints
    assert "restart 1 on 2 node(s)" in second
    resumed = _losses(second)
    straddled = min(int(step) for step in reference if int(step) > checkpoints[0])
    assert resumed.keys() == reference.keys()
    for step, loss in reference.items():
        if int(step) != straddled:  # that one's mean covers only the steps since the checkpoint
            assert resumed[step] == pytest.approx(loss, rel=1e-3), (step, resumed, reference)
    assert (project.path / "outputs" / "clm" / "final" / "config.json").is_file()


# --- pyxis: the squashfs through real pyxis and enroot (the testbed runs both) ----------------------


@pytest.mark.full
def test_pyxis_multinode_trains_in_the_squashfs(project: Project, cpu_sqsh: Path) -> None:
    """`sbatch sbatch/pyxis_multinode.sbatch` as a user types it, with the squashfs `ctrain convert
    --to sqsh` made: pyxis unpacks it with enroot on both nodes, and the demo trains as 4 processes.
    Full tier alone; CI tier: test_through_pyxis_faults_behave_as_under_apptainer (a job through pyxis and
    enroot that trains, from `ctrain submit`)."""
    job_id = project.sbatch("--ntasks-per-node=2", "--job-name=pyxis", "sbatch/pyxis_multinode.sbatch", DEMO, *SHORT,
                            "training.output_dir=/outputs/pyxis", env={"IMAGE": str(cpu_sqsh)})  # fmt: skip
    log = finish(project, job_id)
    assert launcher_line(log, 1, "node2").startswith("torchrun --nnodes=2 --nproc-per-node=2 ")
    assert re.search(r"on 4 process\(es\)", log)
    assert "rank 3 host node2" in log and "rank 0 host node1" in log
    assert f"ctrain: pyxis image {cpu_sqsh}, torchrun" in log
    # enroot unpacked the image on each node, into that node's own directory: pyxis reported nothing.
    assert not re.search(r"slurmstepd-node\d: error", log), log[-4000:]
    assert (project.path / "outputs" / "pyxis" / "final" / "config.json").is_file()


def _tiny_sqsh(testbed, path: Path, *, venv_back: bool) -> Path:
    """A busybox image laid out like a Debian one under enroot: its ENV PATH puts a venv with
    `torchrun` and `python` first, and /etc/profile resets PATH as Debian's does; with ``venv_back``
    /etc/profile.d puts the venv back, as containers/install.sh does."""
    root = path.with_suffix(".root")
    (root / "bin").mkdir(parents=True)
    work = testbed.shared_dir / ".demo-image"  # where the job user downloads busybox for the demo image
    work.mkdir(exist_ok=True)
    shutil.chown(work, testbed.user)
    shutil.copy(busybox(testbed, work), root / "bin" / "busybox")
    for tool in ("sh", "cat", "echo"):
        (root / "bin" / tool).symlink_to("busybox")
    (root / "opt" / "v" / "bin").mkdir(parents=True)
    for tool in ("torchrun", "python"):
        (root / "opt" / "v" / "bin" / tool).write_text("#!/bin/sh\n")
        (root / "opt" / "v" / "bin" / tool).chmod(0o755)
    (root / "etc" / "profile.d").mkdir(parents=True)
    (root / "etc" / "environment").write_text("PATH=/opt/v/bin:/usr/bin:/bin\n")
    (root / "etc" / "rc").write_text('exec "$@"\n')
    (root / "etc" / "profile").write_text(
        'PATH="/usr/local/bin:/usr/bin:/bin"\nexport PATH\nfor i in /etc/profile.d/*.sh; do [ -r "$i" ] && . "$i"; done\n'
    )
    if venv_back:
        (root / "etc" / "profile.d" / "venv.sh").write_text('PATH="/opt/v/bin:$PATH"; export PATH\n')
    subprocess.run(["mksquashfs", str(root), str(path), "-all-root", "-noappend", "-quiet"], check=True)
    return path


def test_convert_starts_the_squashfs_with_enroot_before_calling_it_done(testbed, cpu_sqsh: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:  # fmt: skip
    """ctrain convert's self-check starts the squashfs with enroot the way pyxis does (the testbed's
    enroot): the image the tests train with passes; an image whose login shell loses the venv from
    PATH fails with the reason, and one that puts it back in /etc/profile.d passes."""
    from ctrain.errors import CtrainError
    from ctrain.image import sqsh
    from ctrain.testbed import pyxis

    monkeypatch.setenv("PATH", f"{pyxis.bin_dir(testbed.layout)}:{os.environ['PATH']}")
    said: list[str] = []
    sqsh.self_check(cpu_sqsh, tmp_path / "real", said.append)
    assert said == ["sqsh: started with enroot as pyxis does; torchrun and python are on the image's PATH"]
    sqsh.self_check(_tiny_sqsh(testbed, tmp_path / "fixed.sqsh", venv_back=True), tmp_path / "fixed", said.append)
    broken = _tiny_sqsh(testbed, tmp_path / "broken.sqsh", venv_back=False)
    with pytest.raises(CtrainError) as caught:
        sqsh.self_check(broken, tmp_path / "broken", said.append, shown="images/broken.sqsh")
    assert str(caught.value).startswith("images/broken.sqsh does not start as pyxis starts it")
    assert "torchrun is not on the container's PATH (/usr/local/bin:/usr/bin:/bin)" in str(caught.value)
