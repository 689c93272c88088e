"""The sbatch scripts and their library, run for real by bash in dry-run mode on a made-up allocation.

CTRAIN_DRY_RUN=1 makes the library print the srun command instead of running it; everything
before that (settings, allocation, environment, container and launcher words) runs as in a job.
``scontrol show hostnames`` is the real one, reading a minimal slurm.conf (it needs no controller).
Golden files: tests/golden/sbatch/; CTRAIN_UPDATE_GOLDEN=1 rewrites them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctrain.jobs.library import assemble
from tests import golden_files
from tests.conftest import need
from tests.golden_files import assert_golden

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "sbatch"
LIB = SBATCH / "lib" / "ctrain.sh"
GOLDEN = golden_files.GOLDEN / "sbatch"
SCRIPTS = ["apptainer", "apptainer_multinode", "pyxis", "pyxis_multinode"]
NODE_COUNTS = [1, 2, 16]


def golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/sbatch/NAME."""
    assert_golden("sbatch", name, text)


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory) -> Path:
    """Just enough slurm.conf for `scontrol show hostnames` to expand node lists offline."""
    need(shutil.which("scontrol") is not None, "scontrol (slurm-client)")
    path = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    path.write_text("ClusterName=unit\nSlurmctldHost=localhost\nNodeName=gpu[001-016]\nPartitionName=p Nodes=ALL\n")
    return path


def allocation(nodes: int, *, gpus: int = 8, tasks_per_node: int = 1, cpus: int = 96) -> dict[str, str]:
    """The environment Slurm gives a batch script on an allocation of ``nodes`` nodes."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ctrain",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]" if nodes > 1 else "gpu001",
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node),
        "SLURM_CPUS_ON_NODE": str(cpus),
        "SLURM_SUBMIT_DIR": "/project",
    }
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def dry_run(
    script: str, *args: str, env: dict[str, str], slurm_conf: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run sbatch/SCRIPT.sbatch under bash as Slurm would, printing instead of launching."""
    base = {
        "PATH": os.environ["PATH"],
        "HOME": "/home/alice",
        "SLURM_CONF": str(slurm_conf),
        "CTRAIN_DRY_RUN": "1",
        "CTRAIN_SBATCH_LIB": str(LIB),
    }
    result = subprocess.run(["bash", str(SBATCH / f"{script}.sbatch"), *args], env={**base, **env},
                            capture_output=True, text=True, cwd="/", check=False)  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


def srun_words(output: str) -> list[str]:
    """The srun command the library printed (its `+ ` line), as words."""
    assert output.count("\n+ srun ") == 1, output  # the last thing printed; it may span lines
    return ["srun", *shlex.split(output.split("\n+ srun ", 1)[1])]


# --- goldens: what runs on 1, 2 and 16 nodes ----------------------------------------------------


@pytest.mark.parametrize("nodes", NODE_COUNTS)
@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_srun_command_golden(runtime: str, nodes: int, slurm_conf: Path) -> None:
    script = runtime if nodes == 1 else f"{runtime}_multinode"
    result = dry_run(
        script, "recipes/demo-addition.yaml", "training.max_steps=50", env=allocation(nodes), slurm_conf=slurm_conf
    )
    golden(f"{runtime}-{nodes}node.txt", result.stdout)


def test_same_script_any_size(slurm_conf: Path) -> None:
    """Between 2 and 16 nodes only the allocation changes: the commands differ in node counts alone."""
    two = dry_run("pyxis_multinode", env=allocation(2), slurm_conf=slurm_conf).stdout
    sixteen = dry_run("pyxis_multinode", env=allocation(16), slurm_conf=slurm_conf).stdout
    words = [(a, b) for a, b in zip(srun_words(two), srun_words(sixteen)) if a != b]
    assert words == [("--nodes=2", "--nodes=16"), ("--ntasks=2", "--ntasks=16"), ("--nnodes=2", "--nnodes=16")]


# --- how the allocation becomes the launch ------------------------------------------------------


def test_processes_per_node_follow_gpus_else_tasks(slurm_conf: Path) -> None:
    gpus = srun_words(dry_run("apptainer_multinode", env=allocation(2, gpus=4), slurm_conf=slurm_conf).stdout)
    assert "--nproc-per-node=4" in gpus and "--nv" in gpus
    cpu = srun_words(
        dry_run("apptainer_multinode", env=allocation(2, gpus=0, tasks_per_node=3), slurm_conf=slurm_conf).stdout
    )
    assert "--nproc-per-node=3" in cpu and "--nv" not in cpu


def test_rendezvous_from_first_node_and_job_id(slurm_conf: Path) -> None:
    env = {**allocation(16), "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[007-016,001-006]"}
    words = srun_words(dry_run("pyxis_multinode", env=env, slurm_conf=slurm_conf).stdout)
    port = 123456 % 4536 + 61000
    assert f"--rdzv-endpoint=gpu007:{port}" in words
    assert "--rdzv-id=123456" in words and "--rdzv-backend=c10d" in words
    assert 60999 < port <= 65535  # above Linux's ephemeral ports (32768-60999)


def test_one_task_per_node_kill_on_bad_exit_labels(slurm_conf: Path) -> None:
    words = srun_words(dry_run("apptainer_multinode", env=allocation(2), slurm_conf=slurm_conf).stdout)
    assert words[:6] == ["srun", "--label", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]


def test_recipe_and_overrides_reach_the_trainer(slurm_conf: Path) -> None:
    env = {**allocation(2), "CTRAIN_LAUNCHER": "deepspeed", "CTRAIN_DEEPSPEED_CONFIG": "configs/z3.json"}
    words = srun_words(
        dry_run("pyxis_multinode", "/project/recipes/r.yaml", "a.b=1", env=env, slurm_conf=slurm_conf).stdout
    )
    assert words[-6:] == ["-m", "ctrain", "train", "recipes/r.yaml", "a.b=1", "training.deepspeed?=configs/z3.json"]
    assert words[words.index("ctrain-task") + 1] == "torchrun"


@pytest.mark.parametrize(
    ("command", "launched"),
    [
        (["train.py", "--lr", "1e-4"], ["train.py", "--lr", "1e-4"]),
        (["-m", "pkg.train", "--x"], ["-m", "pkg.train", "--x"]),
        (["python", "-u", "run_clm.py", "--deepspeed", "configs/z3.json"],
         ["--no-python", "python", "-u", "run_clm.py", "--deepspeed", "configs/z3.json"]),
        (["./train.sh", "a b", "$(touch x)"], ["--no-python", "./train.sh", "a b", "$(touch x)"]),
    ],
)
def test_a_command_of_your_own_runs_under_the_launcher_as_written(command: list[str], launched: list[str],
                                                                  slurm_conf: Path) -> None:  # fmt: skip
    """After `--`, the command replaces `-m ctrain train RECIPE`: its words reach torchrun one by one
    (the DeepSpeed launcher mode adds no recipe key to them), and the log says where it runs."""
    env = {**allocation(2), "CTRAIN_LAUNCHER": "deepspeed"}
    result = dry_run("apptainer_multinode", "--", *command, env=env, slurm_conf=slurm_conf)
    words = srun_words(result.stdout)
    assert words[words.index("ctrain-task") + 1] == "torchrun"
    assert words[-len(launched):] == launched and words[-len(launched) - 1].startswith("--rdzv-id=")
    assert f"your command: {' '.join(command)} (rendezvous " in result.stdout
    assert "it runs in /workspace, which is the project directory /project on every node; write outputs under " \
           "/outputs (/project/outputs)" in result.stdout
    accelerate = srun_words(dry_run("pyxis_multinode", "--", *command, env={**allocation(2), "CTRAIN_LAUNCHER":
                                                                           "accelerate"}, slurm_conf=slurm_conf).stdout)
    program = launched[1:] if launched[0] == "--no-python" else launched
    assert accelerate[-len(program):] == program
    assert ("--no_python" in accelerate) == (launched[0] == "--no-python")


def test_nothing_after_the_dashes_is_an_error(slurm_conf: Path) -> None:
    result = dry_run("apptainer_multinode", "--", env=allocation(2), slurm_conf=slurm_conf, check=False)
    assert result.returncode == 2 and "nothing after --: give the command to run" in result.stderr
    assert "+ srun" not in result.stdout


def test_accelerate_machine_rank_per_node(slurm_conf: Path, tmp_path: Path) -> None:
    env = {**allocation(2, gpus=0, tasks_per_node=2), "CTRAIN_LAUNCHER": "accelerate"}
    result = dry_run("apptainer_multinode", env=env, slurm_conf=slurm_conf)
    words = srun_words(result.stdout)
    launch = words[words.index("ctrain-task") + 1 :]
    assert launch[:3] == ["accelerate", "launch", "--multi_gpu"]
    assert {"--num_machines=2", "--num_processes=4", "--main_process_ip=gpu001", "--rdzv_backend=c10d"} <= set(launch)
    # The per-node part: the task script inserts the node's own rank, here run as node 1 would.
    task = words[words.index("ctrain-task") - 1]
    shown = subprocess.run(["sh", "-c", task.replace('"$@" &', "true &"), "ctrain-task", *launch], cwd=tmp_path,
                           env={"SLURM_NODEID": "1", "PATH": os.environ["PATH"], "CTRAIN_PIDS": "."},
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert f"ctrain: {os.uname().nodename}: accelerate launch --machine_rank=1 --multi_gpu" in shown.stdout


def test_task_script_drops_hook_variables_records_pid_ignores_usr1(slurm_conf: Path, tmp_path: Path) -> None:
    """enroot's PyTorch hook sets RANK/WORLD_SIZE/MASTER_* per task; the task script drops them,
    leaves the launcher's PID where the time-limit warning finds it, and makes USR1 harmless to it."""
    words = srun_words(dry_run("pyxis_multinode", env=allocation(2), slurm_conf=slurm_conf).stdout)
    task = words[words.index("ctrain-task") - 1]
    hook = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "gpu001", "MASTER_PORT": "61000"}
    launcher = 'kill -USR1 $$; sleep 0.2; env; echo "pid $$"'  # a USR1 it did not ignore would end it first
    (tmp_path / "pids").mkdir()
    probe = subprocess.run(["sh", "-c", task, "ctrain-task", "sh", "-c", launcher], cwd=tmp_path,
                           env={"PATH": os.environ["PATH"], "CTRAIN_PIDS": "pids", "CTRAIN_RUN_DIR": "pids", **hook}, capture_output=True, text=True,
                           check=False)  # fmt: skip
    seen = dict(
        line.split("=", 1) for line in probe.stdout.splitlines() if "=" in line and not line.startswith("ctrain:")
    )
    assert probe.returncode == 0, probe.stderr
    assert not set(hook) & set(seen), seen
    pid = re.search(r"^pid (\d+)$", probe.stdout, re.MULTILINE).group(1)
    assert (tmp_path / "pids" / f"{os.uname().nodename}.pid").read_text().strip() == pid


def test_apptainer_mounts_env_and_home(slurm_conf: Path) -> None:
    env = {**allocation(1, gpus=0), "CTRAIN_DATA": "data", "CTRAIN_MOUNTS": "/scratch:/scratch,/ro:/ro:ro",
           "IMAGE": "images/x.sif", "FOO": "bar", "CTRAIN_CONTAINER_ENV": "FOO"}  # fmt: skip
    shown = dry_run("apptainer", env=env, slurm_conf=slurm_conf).stdout
    words = srun_words(shown)
    binds = [words[i + 1] for i, w in enumerate(words) if w == "--bind"]
    assert binds == ["/project:/workspace", "/home/alice/.cache/huggingface:/hf_home", "/project/outputs:/outputs",
                     "/project/data:/data:ro", "/scratch:/scratch", "/ro:/ro:ro"]  # fmt: skip
    assert "--no-home" in words and words[words.index("--pwd") + 1] == "/workspace"
    # The image runs from this node's cache (CTRAIN_IMAGE_CACHE; named by the file's contents, which
    # a dry run without the file cannot read), held by the task while it runs.
    assert "ctrain: apptainer image /project/images/x.sif," in shown
    entry = words[words.index("ctrain-image") + 1]
    assert entry == "/tmp/ctrain-images-0/unread" and words[words.index("--pwd") + 2] == f"{entry}/rootfs"
    on = srun_words(dry_run("apptainer", env={**env, "CTRAIN_MOUNT_HOME": "1"}, slurm_conf=slurm_conf).stdout)
    assert "--no-home" not in on


def test_apptainer_forced_variables_are_exported(slurm_conf: Path) -> None:
    """Variables that must beat the image's go in as APPTAINERENV_* (what srun's tasks inherit)."""
    script = (f'source {LIB}; ctrain_settings apptainer; ctrain_allocation; ctrain_environment; ctrain_container; '
              'env | grep -E "^(APPTAINERENV|SINGULARITYENV)_" | sort')  # fmt: skip
    env = {"PATH": os.environ["PATH"], "HOME": "/home/alice", "SLURM_CONF": str(slurm_conf), "CTRAIN_DRY_RUN": "1",
           **allocation(2, gpus=0, tasks_per_node=2, cpus=8), "CTRAIN_EFA": "1"}  # fmt: skip
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert "APPTAINERENV_OMP_NUM_THREADS=4\n" in out  # 8 CPUs / 2 processes
    assert "APPTAINERENV_PYTHONUNBUFFERED=1\n" in out
    assert "APPTAINERENV_NCCL_SOCKET_IFNAME=^docker,lo,veth\n" in out
    assert "SINGULARITYENV_FI_PROVIDER=efa\n" in out


@pytest.mark.parametrize("script", ["apptainer_multinode", "pyxis_multinode"])
def test_tasks_get_only_the_variables_a_job_needs(slurm_conf: Path, script: str) -> None:
    """srun --export lists what the tasks (and the containers) get: the host's PYTHONPATH, conda's and
    a module's variables stay out; what slurm.pass_env (CTRAIN_PASS_ENV) and slurm.env name go in."""
    host = {"PYTHONPATH": "/home/alice/.local/lib", "PYTHONHOME": "/opt/conda", "LD_LIBRARY_PATH": "/opt/conda/lib",
            "CONDA_PREFIX": "/opt/conda", "MODULEPATH": "/etc/modules", "LMOD_CMD": "/usr/bin/lmod",
            "HF_TOKEN": "hf_x", "NCCL_DEBUG": "INFO", "WANDB_PROJECT": "p", "MYLAB_DATA": "/d", "MYLAB_X": "1",
            "EXTRA": "1", "OTHER": "1", "MY_SETTING": "v", "CTRAIN_PASS_ENV": "MYLAB_*,EXTRA",
            "CTRAIN_CONTAINER_ENV": "MY_SETTING"}  # fmt: skip
    words = srun_words(dry_run(script, env={**allocation(2), **host}, slurm_conf=slurm_conf).stdout)
    (export,) = [w.split("=", 1)[1] for w in words if w.startswith("--export=")]
    passed = set(export.split(","))
    assert {"HF_TOKEN", "NCCL_DEBUG", "WANDB_PROJECT", "MYLAB_DATA", "MYLAB_X", "EXTRA", "MY_SETTING", "PATH",
            "SLURM_JOB_ID", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR",
            "CTRAIN_PIDS", "CTRAIN_HEARTBEATS"} <= passed  # the task's .done files, the ranks' heartbeats  # fmt: skip
    assert not {"PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "CONDA_PREFIX", "MODULEPATH", "LMOD_CMD", "OTHER"} & passed
    assert "ALL" not in passed
    bad = dry_run(script, env={**allocation(2), "CTRAIN_PASS_ENV": "X;rm -rf ~"}, slurm_conf=slurm_conf, check=False)
    assert bad.returncode != 0 and "CTRAIN_PASS_ENV is 'X;rm -rf ~'; give variable names" in bad.stderr
    for hostile in ("$(touch /tmp/ctrain-pwned)", "A\nB", "A'B", 'A"B'):
        bad = dry_run(script, env={**allocation(2), "CTRAIN_PASS_ENV": hostile}, slurm_conf=slurm_conf, check=False)
        assert bad.returncode != 0 and "CTRAIN_PASS_ENV is " in bad.stderr, hostile
        assert not Path("/tmp/ctrain-pwned").exists()


def test_pyxis_container_options(slurm_conf: Path) -> None:
    env = {**allocation(2), "CTRAIN_EFA": "1", "IMAGE": "nvcr.io#nvidia/pytorch:24.10-py3"}
    words = srun_words(dry_run("pyxis_multinode", env=env, slurm_conf=slurm_conf).stdout)
    options = dict(w.split("=", 1) if "=" in w else (w, "") for w in words if w.startswith("--") and "container" in w)
    assert options["--container-image"] == "nvcr.io#nvidia/pytorch:24.10-py3"
    assert options["--container-workdir"] == "/workspace"
    assert options["--container-mounts"].split(",")[0] == "/project:/workspace"
    assert "--no-container-mount-home" in options and "--no-container-entrypoint" in options
    assert set(options["--container-env"].split(",")) >= {
        "PYTHONUNBUFFERED",
        "OMP_NUM_THREADS",
        "FI_PROVIDER",
        "NCCL_SOCKET_IFNAME",
    }
    assert "apptainer" not in words


def test_local_sqsh_becomes_an_absolute_path(slurm_conf: Path) -> None:
    """pyxis reads a relative path as a registry reference, so files are made absolute."""
    words = srun_words(
        dry_run("pyxis", env={**allocation(1), "IMAGE": "images/ctrain.sqsh"}, slurm_conf=slurm_conf).stdout
    )
    assert "--container-image=/project/images/ctrain.sqsh" in words


def test_outside_an_allocation_is_a_clear_error(slurm_conf: Path) -> None:
    result = dry_run("apptainer", env={}, slurm_conf=slurm_conf, check=False)
    assert result.returncode == 2
    assert "no Slurm allocation here: submit this script with sbatch" in result.stderr


def test_bad_launcher_is_a_clear_error(slurm_conf: Path) -> None:
    result = dry_run(
        "apptainer", env={**allocation(1), "CTRAIN_LAUNCHER": "deepspeed-pdsh"}, slurm_conf=slurm_conf, check=False
    )
    assert (
        result.returncode == 2
        and "CTRAIN_LAUNCHER is 'deepspeed-pdsh'; valid: torchrun, accelerate, deepspeed" in result.stderr
    )


# --- pyxis: every container flag is one pyxis documents -------------------------------------------


@pytest.mark.parametrize("mount_home", ["0", "1"])
@pytest.mark.parametrize("script", ["pyxis", "pyxis_multinode"])
def test_pyxis_flags_are_documented_pyxis_options(script: str, mount_home: str, slurm_conf: Path) -> None:
    documented = {name: argument != "-" for name, argument in golden_files.pyxis_options().items()}
    env = {
        **allocation(2),
        "CTRAIN_MOUNT_HOME": mount_home,
        "CTRAIN_EFA": "1",
        "CTRAIN_DATA": "/d",
        "CTRAIN_MOUNTS": "/a:/b",
    }
    words = srun_words(dry_run(script, env=env, slurm_conf=slurm_conf).stdout)
    srun_options = words[1 : words.index("sh")]
    used = [w for w in srun_options if "container" in w]
    assert used, "the pyxis script passes no container options"
    for word in used:
        name, has_value, value = word.removeprefix("--").partition("=")
        assert name in documented, f"--{name} is not a pyxis option"
        assert bool(has_value) == documented[name], (
            f"--{name}: value {'missing' if documented[name] else 'not allowed'}"
        )
        if name == "container-mounts":
            for mount in value.split(","):
                assert re.fullmatch(r"[./][^:]*:/[^:]*(:[a-z+]+)?", mount), mount  # SRC:DST[:FLAGS], FLAGS joined by +


def test_pyxis_option_list_cites_its_source() -> None:
    text = (GOLDEN / "pyxis-srun-options.txt").read_text()
    assert "github.com/NVIDIA/pyxis" in text and "container-env" in golden_files.pyxis_options()


# --- the scripts themselves -----------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_share_the_library(script: str) -> None:
    text = (SBATCH / f"{script}.sbatch").read_text()
    subprocess.run(["bash", "-n", str(SBATCH / f"{script}.sbatch")], check=True)
    from ctrain.jobs.submit import SOURCE_LINE

    assert SOURCE_LINE in text.splitlines()
    assert "#SBATCH --output=logs/%x-%j.out" in text
    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text
    body = text.split(SOURCE_LINE, 1)[1].strip().splitlines()
    assert body == [f'ctrain_main {script.split("_")[0]} "$@"'], (
        "scripts hold settings only; logic lives in the library"
    )


def test_single_and_multinode_differ_only_in_nodes_and_text() -> None:
    for runtime in ("apptainer", "pyxis"):
        one = (SBATCH / f"{runtime}.sbatch").read_text().splitlines()
        many = (SBATCH / f"{runtime}_multinode.sbatch").read_text().splitlines()
        differing = [(a, b) for a, b in zip(one, many) if a != b and not a.startswith("# ")]
        assert differing == [("#SBATCH --nodes=1", "#SBATCH --nodes=2")]


def lib_defaults() -> dict[str, list[str]]:
    """CTRAIN_* variables the library defaults with `: "${NAME:=default}"` (some per runtime)."""
    found: dict[str, list[str]] = {}
    for name, default in re.findall(r': "\$\{(CTRAIN_[A-Z_]+):=(.*?)\}"[\s;]', assemble(LIB)):
        found.setdefault(name, []).append(default)
    return found


def test_docs_list_every_setting_with_its_default() -> None:
    docs = (REPO / "docs" / "sbatch.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(CTRAIN_[A-Z_]+)` \| ([^|]*) \|", docs, re.MULTILINE)}
    defaults = lib_defaults()
    assert len(defaults) > 10 and len(defaults["CTRAIN_IMAGE"]) == 2
    for name, values in defaults.items():
        assert name in rows, f"docs/sbatch.md has no row for {name}"
        for value in values:
            assert f"`{value}`" in rows[name], (
                f"docs/sbatch.md: {name} defaults to {value!r} in the library, not {rows[name]!r}"
            )


def test_requeue_code_is_the_trainers() -> None:
    from ctrain.train.artifacts import PREEMPTED_EXIT_CODE

    assert lib_defaults()["CTRAIN_REQUEUE_EXIT"] == [str(PREEMPTED_EXIT_CODE)]


def test_first_node_hosts_the_store_until_every_launcher_is_done(slurm_conf: Path, tmp_path: Path) -> None:
    """The rendezvous store outlives the first node's launcher: a launcher on another node that is
    still in torchrun's exit barrier when the first one exits can still reach it (pytorch#69520).
    Two nodes' tasks, run here as their nodes would, with a launcher that talks to the store."""
    words = srun_words(dry_run("apptainer_multinode", env=allocation(2), slurm_conf=slurm_conf).stdout)
    task = words[words.index("ctrain-task") - 1]
    assert "--rdzv-conf=is_host=false" in words
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ("import sys, datetime, torch.distributed as d; "
              "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=20)); "
              "s.set('n' + sys.argv[2], 'x'); print('seen', s.get('n0').decode())")  # fmt: skip
    (tmp_path / "pids").mkdir()
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "CTRAIN_PIDS": "pids", "CTRAIN_RUN_DIR": "pids",
           "CTRAIN_STORE": f"127.0.0.1:{port}", "SLURM_STEP_NUM_NODES": "2"}  # fmt: skip

    def node(rank: int, *launcher: str) -> subprocess.Popen[str]:
        return subprocess.Popen(["sh", "-c", task, "ctrain-task", *launcher], cwd=tmp_path, text=True,
                                env={**env, "SLURM_NODEID": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip

    first = node(0, sys.executable, "-c", client, str(port), "0")
    deadline = time.monotonic() + 60
    while not (tmp_path / "pids/node-0.done").exists():  # the first launcher has exited
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.1)
    time.sleep(0.5)
    assert first.poll() is None, "the first node's task left before the other node was done"
    second = node(1, sys.executable, "-c", client, str(port), "1")
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0 and "seen x" in out, out  # the store was still there
    out, _ = first.communicate(timeout=30)
    assert first.returncode == 0 and "seen x" in out, out
    with socket.socket() as gone:  # and the store ended with the step
        assert gone.connect_ex(("127.0.0.1", port)) != 0


# --- a lost node or rank: the batch script's decisions, with Slurm's commands faked -------------


@pytest.fixture
def fake_slurm(tmp_path: Path, slurm_conf: Path) -> Path:
    """A bin/ directory of stand-ins for scontrol (``show hostnames|hostlist`` from the real one),
    sinfo, scancel and srun: what the library asks of Slurm goes to calls.log, answers come from files."""
    real = shutil.which("scontrol")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": f"""echo "scontrol $*" >>"$FAKE/calls.log"
case "$1 $2" in
    "show hostnames" | "show hostlist") exec {real} "$@" ;;
    "show job") [ ! -e "$FAKE/no-controller" ] || exit 1
        echo "JobId=4242 JobState=$(cat "$FAKE/jobstate" 2>/dev/null || echo RUNNING) Restarts=0" \
        "ExcNodeList=$(cat "$FAKE/excluded" 2>/dev/null || echo '(null)')" ;;
    "show config") echo "SlurmdPort              = $(cat "$FAKE/port")" ;;
    "show node") echo "NodeName=$4 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$4" ;;
esac""",
        "sinfo": 'echo "sinfo $*" >>"$FAKE/calls.log"; cat "$FAKE/sinfo"',
        "scancel": 'echo "scancel $*" >>"$FAKE/calls.log"',
        # A probe of a node named in $FAKE/dead hangs, as srun does for a node whose slurmd is gone;
        # one named in $FAKE/refused fails at once, as for a node whose slurmd port refuses; one named
        # in $FAKE/killed is SIGKILLed, as a probe is when the node it runs on is dying.
        "srun": 'echo "srun $*" >>"$FAKE/calls.log"; for a; do case $a in --nodelist=*) '
                '! grep -qx "${a#*=}" "$FAKE/refused" 2>/dev/null || exit 1; '
                '! grep -qx "${a#*=}" "$FAKE/killed" 2>/dev/null || kill -KILL $$; '
                '! grep -qx "${a#*=}" "$FAKE/dead" 2>/dev/null || exec sleep 60 ;; esac; done',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return tmp_path


def library(fake: Path, commands: str, slurm_conf: Path, prefix: tuple[str, ...] = (), **env: str
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run ``commands`` in bash with the library sourced, in a 4-node partition gpu[001-004] with a
    2-node job on gpu[001-002], and Slurm's commands faked (``fake_slurm``); ``prefix`` runs the bash."""
    base = {"PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE": str(fake), "SLURM_CONF": str(slurm_conf),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_JOB_PARTITION": "p",
            "CTRAIN_NNODES": "2", "CTRAIN_MAX_REQUEUES": "10", "CTRAIN_REQUEUE_EXIT": "75",
            "CTRAIN_PROJECT_DIR": str(fake), "CTRAIN_PIDS": "pids", "CTRAIN_RUN_DIR": "pids", "CTRAIN_STEP_GRACE": "1",
            "CTRAIN_BATCH_HOST": "gpu001", "CTRAIN_RUN": "4242", "CTRAIN_CONTINUE": "0"}  # fmt: skip
    return subprocess.run([*prefix, "bash", "-c", f'source "$0"; {commands}', LIB], env={**base, **env}, cwd=fake,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def calls(fake: Path, command: str) -> list[str]:
    log = fake / "calls.log"
    return [line for line in log.read_text().splitlines() if line.startswith(command)] if log.exists() else []


def test_lost_node_is_excluded_when_the_partition_has_enough_others(fake_slurm: Path, slurm_conf: Path) -> None:
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\ngpu004 down*\n")
    out = library(fake_slurm, "ctrain_requeue_without gpu002 && echo requeued=1 || echo requeued=", slurm_conf).stdout
    assert "ctrain: requeueing job 4242 (restart 1) without gpu002 (ExcNodeList)" in out
    assert "requeued=1" in out
    assert calls(fake_slurm, "scontrol requeue") == ["scontrol requeue 4242"]
    assert calls(fake_slurm, "scontrol update") == ["scontrol update JobId=4242 ExcNodeList=gpu002"]


def test_lost_nodes_add_up_and_too_few_left_ends_the_job(fake_slurm: Path, slurm_conf: Path) -> None:
    """A node excluded by an earlier requeue stays excluded; with too few nodes left the job ends,
    naming the node, instead of waiting PENDING for nodes that are down."""
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\ngpu004 drain\n")
    (fake_slurm / "excluded").write_text("gpu003")
    out = library(fake_slurm, "ctrain_requeue_without gpu002 && echo requeued=1 || echo requeued=", slurm_conf).stdout
    assert ("ctrain: not requeueing: partition p has 1 node(s) in service besides gpu[002-003], the job needs 2; "
            "submit it again once gpu002 is back (sinfo -n gpu002)") in out  # fmt: skip
    assert "requeued=\n" in out
    assert not calls(fake_slurm, "scontrol requeue") and not calls(fake_slurm, "scontrol update")


def test_lost_node_requeues_stop_at_the_limit(fake_slurm: Path, slurm_conf: Path) -> None:
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\n")
    out = library(fake_slurm, "ctrain_requeue_without gpu002", slurm_conf, SLURM_RESTART_COUNT="10").stdout
    assert "not requeueing: already restarted 10 times (CTRAIN_MAX_REQUEUES=10)" in out
    assert not calls(fake_slurm, "scontrol requeue")


def _silent_ranks(fake: Path) -> dict[str, str]:
    """Two ranks (one per node) that beat once, long ago, and no more: the watchdog's settings for it,
    with a silence check of 2 s and a stand-in for the step's srun."""
    beats = fake / "pids" / "heartbeat"
    beats.mkdir(parents=True, exist_ok=True)
    (fake / "pids" / "state").write_text("0 running\n")
    for rank, node in enumerate(("gpu001", "gpu002")):
        (beats / f"rank-{rank}").write_text(f"7 {node} {1000 + rank}\n")
    return {"CTRAIN_HEARTBEATS": "pids/heartbeat", "CTRAIN_NPROC_PER_NODE": "1", "CTRAIN_HANG_TIMEOUT": "600",
            "CTRAIN_NODE_CHECK": "2"}  # fmt: skip


def test_a_node_that_goes_silent_is_lost_and_the_step_ended(fake_slurm: Path, slurm_conf: Path) -> None:
    """No rank steps and gpu002's slurmd does not answer (cut off, frozen): after CTRAIN_NODE_CHECK
    seconds every node is asked; gpu002 is lost, the run is ending, and the step's srun is killed."""
    (fake_slurm / "refused").write_text("gpu002\n")
    commands = "sleep 60 & CTRAIN_STEP_PID=$!; ctrain_watchdog; wait $CTRAIN_STEP_PID; echo step=$?"
    started = time.monotonic()
    out = library(fake_slurm, commands, slurm_conf, **_silent_ranks(fake_slurm)).stdout
    assert time.monotonic() - started < 50, out  # a hang guard: without the check, the step's 60 s
    assert re.search(r"^ctrain: no finished step for [2-4]s, and gpu002 does not answer, asked twice \(frozen, or "
                     r"cut off the network\): ending the step$", out, re.MULTILINE), out  # fmt: skip
    assert "step=137" in out  # the step's srun, SIGKILLed
    assert (fake_slurm / "pids" / "lost").read_text() == "gpu002\n"
    assert (fake_slurm / "pids" / "state").read_text() == "0 ending\n"
    asked = sorted(call.split("--nodelist=")[1].split()[0] for call in calls(fake_slurm, "srun"))
    assert asked == ["gpu001", "gpu002", "gpu002"]  # every node, then the silent one again
    assert "hang:" not in out


def test_a_silence_while_the_controller_is_away_ends_nothing(fake_slurm: Path, slurm_conf: Path) -> None:
    """slurmctld restarting, or gone, during a long step: no probe could answer (srun needs it), so no
    node is asked and none is lost; the watchdog asks again once the controller is back."""
    (fake_slurm / "refused").write_text("gpu001\ngpu002\n")  # what the probes would say without a controller
    (fake_slurm / "no-controller").touch()
    commands = "ctrain_watchdog & watchdog=$!; sleep 5; pkill -P $watchdog; kill $watchdog; cat pids/state"
    out = library(fake_slurm, commands, slurm_conf, **_silent_ranks(fake_slurm)).stdout
    assert out == "0 running\n" and not (fake_slurm / "pids" / "lost").exists()
    assert not calls(fake_slurm, "srun") and calls(fake_slurm, "scontrol show job")


def test_a_silence_that_every_node_answers_is_left_alone(fake_slurm: Path, slurm_conf: Path) -> None:
    """A long step, evaluation or save: every node answers, so nothing is done, and the nodes are asked
    again only after another CTRAIN_NODE_CHECK seconds; a 1-node job is never asked (no other node)."""
    commands = "ctrain_watchdog & watchdog=$!; sleep 7; pkill -P $watchdog; kill $watchdog; cat pids/state"
    out = library(fake_slurm, commands, slurm_conf, **_silent_ranks(fake_slurm)).stdout
    assert out == "0 running\n" and not (fake_slurm / "pids" / "lost").exists()
    asked = [call for call in calls(fake_slurm, "srun") if "--nodelist=gpu002" in call]
    assert 1 <= len(asked) <= 3, asked  # at 2-3 s, 4-5 s (and 6-7 s) of silence, not every second
    (fake_slurm / "calls.log").unlink()
    out = library(fake_slurm, commands, slurm_conf, **_silent_ranks(fake_slurm), CTRAIN_NNODES="1").stdout
    assert out == "0 running\n" and not calls(fake_slurm, "srun")


def test_a_full_file_system_still_records_the_decision(fake_slurm: Path, slurm_conf: Path) -> None:
    """The project's file system fills mid-run (the run's directory on a 64 KiB tmpfs, filled): a
    preempted run that asked to be requeued (exit 75) is still decided and requeued; the run's state
    is rewritten in place, as a new file cannot be made. Before, no transition could be recorded, so
    no decision was made and the job just ended."""
    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "root and unshare (a tmpfs)")
    pids = fake_slurm / "pids"
    pids.mkdir()
    fill = ('mount -t tmpfs -o size=64k tmpfs "$FAKE/pids" && echo "0 running" >"$FAKE/pids/state" && '
            '{ dd if=/dev/zero of="$FAKE/pids/filler" bs=4k 2>/dev/null; true; } && exec "$@"')
    commands = "echo x 2>/dev/null >pids/probe && echo 'a new file fits'; ctrain_decide pids 75 exited; cat pids/state"
    out = library(fake_slurm, commands, slurm_conf, prefix=("unshare", "-m", "sh", "-c", fill, "sh"))
    assert out.returncode == 0, out.stderr
    assert "ctrain: requeueing job 4242 (restart 1)" in out.stdout, out.stdout + out.stderr
    assert out.stdout.endswith("0 requeued\n"), out.stdout
    assert calls(fake_slurm, "scontrol requeue") == ["scontrol requeue 4242"]
    assert "a new file fits" not in out.stdout  # the file system was full
    assert not list(pids.iterdir())  # the tmpfs is gone with its namespace


def test_a_failed_rank_is_retried_once_per_job(fake_slurm: Path, slurm_conf: Path) -> None:
    (fake_slurm / ".ctrain").mkdir()
    first = library(fake_slurm, "ctrain_retry_once", slurm_conf).stdout
    assert "ctrain: requeueing job 4242 once (restart 1)" in first
    assert (fake_slurm / ".ctrain" / "4242.retried").exists()
    second = library(fake_slurm, "ctrain_retry_once", slurm_conf, SLURM_RESTART_COUNT="1").stdout
    assert "not requeueing: the job was already retried once after a failed or hung rank" in second
    assert calls(fake_slurm, "scontrol requeue") == ["scontrol requeue 4242"]


def _step_left(fake: Path, done: dict[int, str], records: dict[int, str]) -> None:
    """What a step leaves for ctrain_decide: node-N.done files and the ranks' exit records, oldest first."""
    pids = fake / "pids"
    (pids / "exit").mkdir(parents=True)
    (pids / "state").write_text("0 running\n")
    (fake / ".ctrain").mkdir()
    stamp = time.time() - 100
    for node, line in done.items():
        (pids / f"node-{node}.done").write_text(line + "\n")
    for rank, line in records.items():
        path = pids / "exit" / f"rank-{rank}"
        path.write_text(line + "\n")
        stamp += 1
        os.utime(path, (stamp, stamp))


def test_a_ranks_own_record_that_a_retry_cannot_help_ends_the_job(fake_slurm: Path, slurm_conf: Path) -> None:
    """torchrun said 1 for node 1; rank 3's record says it stopped at a NaN (rank 1 only saw its peer
    go): the job ends at once, naming rank 3 and its own error line, and nothing is requeued."""
    _step_left(fake_slurm, {0: "1 gpu001", 1: "1 gpu002"},
               {1: "1 peer retry gpu001 RuntimeError: Connection reset by peer",
                3: "65 nonfinite end gpu002 step 5: loss nan; lower training.learning_rate"})  # fmt: skip
    out = library(fake_slurm, 'ctrain_decide pids 1 exited; [[ $(ctrain_state) == requeued ]] && echo requeued=1 || echo requeued=', slurm_conf).stdout
    assert out.splitlines() == [
        "ctrain: failure: rank 3 on gpu002 ended with 65 (nonfinite): step 5: loss nan; lower training.learning_rate",
        "ctrain: not requeueing: a nonfinite failure repeats on a retry; fix it and submit again",
        "requeued=",
    ]
    assert not calls(fake_slurm, "scontrol requeue")


def test_records_that_a_retry_can_help_leave_the_retry_once(fake_slurm: Path, slurm_conf: Path) -> None:
    """A peer's failed collective and a rank killed without a record: the failed rank is retried once."""
    _step_left(fake_slurm, {0: "1 gpu001", 1: "137 gpu002"},
               {0: "1 peer retry gpu001 RuntimeError: Connection reset by peer", 1: "0 done end gpu001"})  # fmt: skip
    out = library(fake_slurm, "ctrain_decide pids 1 exited", slurm_conf).stdout
    assert "ctrain: failure: a rank failed on a live node: gpu001's launcher exited with 1 first" in out
    assert "ctrain: requeueing job 4242 once (restart 1)" in out
    assert calls(fake_slurm, "scontrol requeue") == ["scontrol requeue 4242"]


def test_a_lost_node_outranks_the_records_of_the_ranks_it_took_down(fake_slurm: Path, slurm_conf: Path) -> None:
    """Survivors of a lost node may raise anything; the lost node is the cause, and it is requeued without."""
    _step_left(fake_slurm, {0: "1 gpu001"}, {0: "1 exception end gpu001 ValueError: odd batch after the loss"})
    (fake_slurm / "pids" / "lost").write_text("gpu002\n")
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\n")
    out = library(fake_slurm, "ctrain_decide pids 137 exited", slurm_conf).stdout
    assert out.startswith("ctrain: failure: node lost: gpu002 ")
    assert "ctrain: requeueing job 4242 (restart 1) without gpu002 (ExcNodeList)" in out
    assert "ended with" not in out


def test_a_ranks_message_is_printed_never_run(fake_slurm: Path, slurm_conf: Path) -> None:
    """The record is a file every rank can write: its words reach the log as text, not as shell."""
    hostile = "exception end gpu002 $(touch pwned) `touch pwned2` ; touch pwned3 \\ \"'"
    _step_left(fake_slurm, {1: "1 gpu002"}, {1: f"1 {hostile}"})
    out = library(fake_slurm, "ctrain_decide pids 1 exited", slurm_conf).stdout
    assert "ended with 1 (exception): $(touch pwned) `touch pwned2` ; touch pwned3 \\ \"'" in out, out
    assert not list(fake_slurm.glob("pwned*"))


def test_after_slurms_term_the_records_do_not_decide(fake_slurm: Path, slurm_conf: Path) -> None:
    """TERM came from Slurm (scancel, requeue, preemption): Slurm decides, whatever a rank recorded."""
    _step_left(fake_slurm, {0: "1 gpu001"}, {0: "1 exception end gpu001 KeyError: 'x'"})
    out = library(fake_slurm, "CTRAIN_SIGNAL=TERM; ctrain_decide pids 1 exited", slurm_conf).stdout
    assert "ended with" not in out and "SIGTERM came from Slurm" in out


def test_the_warning_requeues_at_once_a_command_that_cannot_checkpoint(fake_slurm: Path, slurm_conf: Path) -> None:
    """USR1 before the time limit: passed to the workers; a command of the user's own from which no
    heartbeat came (no opt-in) is requeued then and there, as it would only run into the limit; one
    that beats is left to checkpoint and exit 75; a recipe run always is."""
    (fake_slurm / "pids" / "heartbeat").mkdir(parents=True)
    commands = "CTRAIN_HEARTBEATS=pids/heartbeat; {} ctrain_forward USR1 && echo requeued=1 || echo requeued="
    out = library(fake_slurm, commands.format("CTRAIN_COMMAND=(train.py);"), slurm_conf).stdout
    assert "your command has not opted in to checkpoint at the signal" in out
    assert "ctrain: requeueing job 4242 (restart 1)" in out and "requeued=1" in out
    assert calls(fake_slurm, "scontrol requeue") == ["scontrol requeue 4242"]
    (fake_slurm / "calls.log").unlink()
    (fake_slurm / "pids" / "heartbeat" / "rank-0").write_text("12 gpu001 999\n")
    for setup in ("CTRAIN_COMMAND=(train.py);", "CTRAIN_COMMAND=();"):
        out = library(fake_slurm, commands.format(setup), slurm_conf).stdout
        assert "passing it to the training processes" in out and "requeued=\n" in out, out
    assert not calls(fake_slurm, "scontrol requeue")


# --- a run's life: the states, the one decision ------------------------------------------------------

DECIDED = {"requeued", "left", "finished", "ended"}


def _life_in_the_library() -> dict[tuple[str, str], str]:
    out = subprocess.run(["bash", "-c", 'source "$0"; for k in "${!CTRAIN_LIFE[@]}"; do echo "$k ${CTRAIN_LIFE[$k]}"; done',
                          LIB], capture_output=True, text=True, check=True).stdout  # fmt: skip
    table = {}
    for line in out.splitlines():
        key, to = line.split()
        state, event = key.split(":")
        table[(state, event)] = to
    return table


def _life_in_the_docs() -> dict[tuple[str, str], str]:
    text = (REPO / "docs" / "architecture.md").read_text().split("## A run's life")[1].split("\n## ")[0]
    rows = re.findall(r"^\| ([a-z-]+) \| ([a-z-]+) \| ([a-z-]+) \| .+ \|$", text, re.MULTILINE)
    return {(state, event): to for state, event, to in rows[2:]}  # (the header and its rule first)


def test_the_runs_life_is_the_documented_table_and_every_run_can_end() -> None:
    """docs/architecture.md's table is the library's; the decided states have no way out (so a second
    decider is refused); every state is reachable from `starting`, and every undecided one after
    `launched` can reach a decision."""
    table = _life_in_the_library()
    assert table == _life_in_the_docs()
    states = {s for s, _ in table} | set(table.values())
    assert DECIDED <= states and not {s for s, _ in table} & DECIDED

    def reachable(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            here = todo.pop()
            for (state, _), to in table.items():
                if state == here and to not in seen:
                    seen.add(to)
                    todo.append(to)
        return seen

    assert reachable("starting") == states
    for state in states - DECIDED - {"starting"}:
        assert reachable(state) & DECIDED, state


def test_every_transition_and_every_refusal(tmp_path: Path) -> None:
    """Each row moves the state file to its target; each other (state, event) pair is refused with a
    line that names both, and leaves the file as it was. A state file of another run counts as
    `starting`."""
    table = _life_in_the_library()
    states = sorted({s for s, _ in table} | set(table.values()))
    events = sorted({e for _, e in table})
    cases = [(state, event) for state in states for event in events]
    script = 'source "$0"; while read -r state event; do echo "$SLURM_RESTART_COUNT $state" >pids/state; ' \
             'out=$(ctrain_transition "$event"); echo "$state $event $? $(<pids/state) | $out"; done'
    (tmp_path / "pids").mkdir()
    result = subprocess.run(["bash", "-c", script, LIB], input="".join(f"{s} {e}\n" for s, e in cases),
                            env={"PATH": os.environ["PATH"], "CTRAIN_PROJECT_DIR": str(tmp_path), "CTRAIN_PIDS": "pids", "CTRAIN_RUN_DIR": "pids",
                                 "SLURM_RESTART_COUNT": "3"}, cwd=tmp_path, capture_output=True, text=True,
                            check=True)  # fmt: skip
    lines = result.stdout.splitlines()
    assert len(lines) == len(cases)
    for (state, event), line in zip(cases, lines, strict=True):
        if (state, event) in table:
            assert line == f"{state} {event} 0 3 {table[state, event]} | ", line
        else:
            assert line == (f"{state} {event} 1 3 {state} | ctrain: the run is {state}: '{event}' is not one of its "
                            f"transitions (CTRAIN_LIFE); nothing done"), line  # fmt: skip
    (tmp_path / "pids" / "state").write_text("2 deciding\n")  # the run before this one
    out = subprocess.run(["bash", "-c", 'source "$0"; ctrain_state; ctrain_transition launched; ctrain_state', LIB],
                         env={"PATH": os.environ["PATH"], "CTRAIN_PROJECT_DIR": str(tmp_path), "CTRAIN_PIDS": "pids", "CTRAIN_RUN_DIR": "pids",
                              "SLURM_RESTART_COUNT": "3"}, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.splitlines() == ["starting", "running"]


def test_a_decided_run_is_not_decided_again(fake_slurm: Path, slurm_conf: Path) -> None:
    """The batch script requeued the job; the sentinel, deciding late, is refused and touches nothing."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "pids" / "state").write_text("0 requeued\n")
    (fake_slurm / "dead").write_text("gpu001\ngpu002\n")
    out = library(fake_slurm, "ctrain_decide pids 137 batch-gone; echo rc=$?", slurm_conf).stdout
    assert out.splitlines() == ["ctrain: the run is requeued: 'batch-gone' is not one of its transitions (CTRAIN_LIFE); "
                                "nothing done", "rc=0"]  # fmt: skip
    assert not calls(fake_slurm, "scontrol requeue") and not calls(fake_slurm, "srun") and not calls(fake_slurm, "scancel")


def test_a_step_that_failed_with_no_cause_asks_every_node(fake_slurm: Path,
                                                                             slurm_conf: Path) -> None:  # fmt: skip
    """The batch host dying slowly: srun killed (137), no launcher reported, no record, no guard. The
    decision asks both nodes after CTRAIN_SETTLE; gpu001 (the batch host) does not answer, so it is the lost node, and
    with too few nodes left the job is ended by scancel (its end could not reach Slurm otherwise)."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "dead").write_text("gpu001\n")
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\n")
    out = library(fake_slurm, "ctrain_decide pids 137 exited; ctrain_state", slurm_conf).stdout
    assert out.splitlines() == [
        "ctrain: failure: node lost: gpu001 (its launcher never ended and its slurmd does not answer)",
        "ctrain: not requeueing: partition p has 1 node(s) in service besides gpu001, the job needs 2; submit it "
        "again once gpu001 is back (sinfo -n gpu001), or on fewer nodes; it resumes from the last checkpoint",
        "ctrain: ending job 4242 (scancel): its batch script was lost with gpu001",
        "ended",
    ]
    assert sorted(c.split("--nodelist=")[1].split()[0] for c in calls(fake_slurm, "srun")) == ["gpu001", "gpu002"]
    assert calls(fake_slurm, "scancel") == ["scancel 4242"]


def test_a_probe_killed_under_it_names_the_dying_batch_host_not_the_node_it_asked(fake_slurm: Path,
                                                                                  slurm_conf: Path) -> None:  # fmt: skip
    """The batch host dying slowly kills the decision's own probes: the probe of gpu002 is SIGKILLed
    at once, which says this node (gpu001) is going, not that gpu002 is."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "killed").write_text("gpu002\n")
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\n")
    out = library(fake_slurm, "ctrain_decide pids 137 exited", slurm_conf).stdout
    assert out.splitlines()[0] == "ctrain: failure: node lost: gpu001 (its launcher never ended and its slurmd does not answer)"
    assert calls(fake_slurm, "scontrol update") == ["scontrol update JobId=4242 ExcNodeList=gpu001"]


def test_a_dying_batch_host_that_does_not_answer_itself_names_only_itself(fake_slurm: Path,
                                                                          slurm_conf: Path) -> None:  # fmt: skip
    """The batch host (gpu001) is dying: its own probe finds its slurmd gone, and its probe of gpu002,
    sent from the dying node, fails too. Only gpu001 is named; gpu002 stays in service."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "dead").write_text("gpu001\ngpu002\n")
    (fake_slurm / "sinfo").write_text("gpu001 alloc\ngpu002 alloc\ngpu003 idle\n")
    out = library(fake_slurm, "ctrain_decide pids 137 exited", slurm_conf).stdout
    assert out.splitlines()[0] == "ctrain: failure: node lost: gpu001 (its launcher never ended and its slurmd does not answer)"
    assert calls(fake_slurm, "scontrol update") == ["scontrol update JobId=4242 ExcNodeList=gpu001"]


def test_a_step_that_failed_with_no_cause_on_live_nodes_is_retried_once(fake_slurm: Path, slurm_conf: Path) -> None:
    """Every node answers and nothing says why the step failed: never silent, retried once."""
    _step_left(fake_slurm, {}, {})
    out = library(fake_slurm, "ctrain_decide pids 137 exited; ctrain_state", slurm_conf).stdout
    assert out.splitlines() == [
        "ctrain: failure: the training step ended with 137 and no node or rank said why (its srun or launchers were "
        "killed, e.g. out of memory); every node answers",
        "ctrain: requeueing job 4242 once (restart 1); it resumes from the last checkpoint",
        "requeued",
    ]


def test_the_sentinel_decides_a_job_slurm_ended_before_its_batch_script_decided(fake_slurm: Path,
                                                                               slurm_conf: Path) -> None:  # fmt: skip
    """Slurm already requeued the job (PENDING, restart 1) with the run undecided, and the batch
    host's slurmd port refuses connections: the sentinel names the batch host, and, the partition
    having another node, only sets the excluded node of the job Slurm requeued."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "jobstate").write_text("PENDING")
    (fake_slurm / "sinfo").write_text("gpu001 down*\ngpu002 idle\ngpu003 idle\n")
    with socket.socket() as closed:  # a port nobody listens on: what a dead slurmd's port does
        closed.bind(("127.0.0.1", 0))
        (fake_slurm / "port").write_text(str(closed.getsockname()[1]))
    out = library(fake_slurm, "ctrain_sentinel gpu001 ''; ctrain_state", slurm_conf, SLURMD_NODENAME="gpu002").stdout
    lines = out.splitlines()
    assert re.fullmatch(r"ctrain: failure: node lost: gpu001 \(the batch host: the job left RUNNING undecided and "
                        r"its slurmd does not answer; seen from \S+\)", lines[0]), out  # fmt: skip
    assert lines[1:] == ["ctrain: requeueing job 4242 (restart 1) without gpu001 (ExcNodeList); it resumes from the "
                         "last checkpoint once Slurm has let go of the lost node", "requeued"]  # fmt: skip
    assert not calls(fake_slurm, "scontrol requeue")
    assert calls(fake_slurm, "scontrol update") == ["scontrol update JobId=4242 ExcNodeList=gpu001"]
    assert not calls(fake_slurm, "scancel 4242")


def test_the_last_nodes_sentinel_decides_when_the_first_two_nodes_are_lost(fake_slurm: Path,
                                                                          slurm_conf: Path) -> None:  # fmt: skip
    """A 3-node job loses gpu001 (the batch host) and gpu002 (the first sentinel) together: the
    sentinel on gpu003 sees the heartbeat stop, finds both silent, names both and, with too few
    nodes left, ends the job."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "refused").write_text("gpu001\ngpu002\n")
    (fake_slurm / "sinfo").write_text("gpu001 down*\ngpu002 down*\ngpu003 alloc\ngpu004 idle\n")
    out = library(fake_slurm, "ctrain_sentinel gpu001 ''; ctrain_state", slurm_conf, SLURMD_NODENAME="gpu003",
                  SLURM_JOB_NODELIST="gpu[001-003]", CTRAIN_NNODES="3").stdout  # fmt: skip
    lines = out.splitlines()
    assert lines[0] == ("ctrain: failure: node lost: gpu001 gpu002 (the batch host and gpu002: no heartbeat for 1s "
                        "and their slurmds do not answer; seen from gpu003)"), out  # fmt: skip
    assert lines[1].startswith("ctrain: not requeueing: partition p has 2 node(s) in service besides gpu[001-002], "
                               "the job needs 3"), out  # fmt: skip
    assert lines[2:] == ["ctrain: ending job 4242 (scancel): its batch script was lost with gpu001", "starting"]
    assert calls(fake_slurm, "scancel 4242") == ["scancel 4242"]
    assert not (fake_slurm / "pids").exists()  # no batch script is left to clear the run's files


def test_of_two_sentinels_one_decides(fake_slurm: Path, slurm_conf: Path) -> None:
    """Both sentinels of a 3-node job see the batch host go at the same moment: the first to claim
    the decision makes it, the other says nothing."""
    _step_left(fake_slurm, {}, {})
    (fake_slurm / "refused").write_text("gpu001\n")
    (fake_slurm / "sinfo").write_text("gpu001 down*\ngpu002 alloc\ngpu003 alloc\ngpu004 idle\n")
    both = ("SLURMD_NODENAME=gpu002 ctrain_sentinel gpu001 '' & SLURMD_NODENAME=gpu003 ctrain_sentinel gpu001 '' & "
            "wait")  # fmt: skip
    out = library(fake_slurm, both, slurm_conf, SLURM_JOB_NODELIST="gpu[001-003]", CTRAIN_NNODES="3").stdout
    assert out.count("ctrain: failure: node lost: gpu001 (the batch host: no heartbeat for 1s") == 1, out
    assert out.count("ctrain: requeueing job 4242 (restart 1) without gpu001") == 1, out
    assert calls(fake_slurm, "scontrol requeue") == ["scontrol requeue 4242"]


def test_the_sentinel_leaves_a_decided_run_and_slurms_term_alone(fake_slurm: Path, slurm_conf: Path) -> None:
    """The job left RUNNING, but the run was decided (or Slurm's TERM came: Slurm decides): the
    sentinel ends at once, saying and doing nothing."""
    for state in ("finished", "requeued", "terminating"):
        _step_left(fake_slurm, {}, {})
        (fake_slurm / "pids" / "state").write_text(f"0 {state}\n")
        (fake_slurm / "jobstate").write_text("COMPLETED")
        out = library(fake_slurm, "ctrain_sentinel gpu001 ''; echo rc=$?", slurm_conf).stdout
        assert out.splitlines() == ["rc=0"], (state, out)
        assert not calls(fake_slurm, "scontrol requeue") and not calls(fake_slurm, "scancel")
        shutil.rmtree(fake_slurm / "pids")
        shutil.rmtree(fake_slurm / ".ctrain")


def test_guard_ends_the_step_and_names_the_node_that_does_not_answer(fake_slurm: Path, slurm_conf: Path) -> None:
    """node 0's launcher failed, node 1 never reports and its probe hangs: after the grace the step is
    cancelled, srun killed, and gpu002 recorded as lost; a node whose launcher ended is never probed."""
    pids = fake_slurm / "pids"
    pids.mkdir()
    (pids / "step").write_text("0\n")
    (pids / "node-0.done").write_text("1 gpu001\n")
    (fake_slurm / "dead").write_text("gpu002\n")
    started = time.monotonic()
    out = library(fake_slurm, "sleep 300 & CTRAIN_STEP_PID=$!; ctrain_guard; wait $CTRAIN_STEP_PID; echo srun=$?",
                  slurm_conf).stdout  # fmt: skip
    took = time.monotonic() - started
    assert "ctrain: gpu001's launcher exited with 1; 1s later gpu002 had not ended, and gpu002 does not answer" in out
    assert "srun=137" in out  # the step's srun was SIGKILLed
    assert (pids / "lost").read_text() == "gpu002\n"
    assert calls(fake_slurm, "scancel") == ["scancel --signal=KILL 4242.0"]
    assert [c for c in calls(fake_slurm, "srun") if "--nodelist=gpu001" in c] == []
    assert took < 150, took  # a hang guard: without the guard, the step's 300 s


def test_guard_leaves_a_step_alone_whose_launchers_all_ended(fake_slurm: Path, slurm_conf: Path) -> None:
    """Every node reported (one failed): srun is ending the step by itself (--kill-on-bad-exit, Apptainer
    cleaning up), so nothing is probed or killed."""
    pids = fake_slurm / "pids"
    pids.mkdir()
    (pids / "node-0.done").write_text("0 gpu001\n")
    (pids / "node-1.done").write_text("1 gpu002\n")
    commands = ("sleep 30 & CTRAIN_STEP_PID=$!; ctrain_guard; kill -0 $CTRAIN_STEP_PID && echo running; "
                "kill $CTRAIN_STEP_PID; ctrain_failed_node pids")
    out = library(fake_slurm, commands, slurm_conf).stdout
    assert out.splitlines() == ["running", "1 gpu002"]
    assert not calls(fake_slurm, "srun") and not calls(fake_slurm, "scancel")


def test_image_cache_size_must_be_a_number(slurm_conf: Path) -> None:
    """It reaches shell arithmetic on every node: a newline, quotes or $(...) never get there."""
    for bad in ("1$(touch x)", "50\necho hi", "'5'", "-1"):  # (empty: the default, as for every setting)
        result = dry_run("apptainer", env={**allocation(1), "CTRAIN_IMAGE_CACHE_GB": bad}, slurm_conf=slurm_conf,
                         check=False)  # fmt: skip
        assert result.returncode == 2 and "CTRAIN_IMAGE_CACHE_GB is" in result.stderr, (bad, result.stderr)
        assert "+ srun" not in result.stdout


def test_preflight_settings_must_be_a_level_and_a_number(slurm_conf: Path) -> None:
    """CTRAIN_PREFLIGHT_TMP_MB reaches the nodes' shell arithmetic, CTRAIN_PREFLIGHT every task's
    environment: a newline, quotes or $(...) never get there."""
    for name, bad in (("CTRAIN_PREFLIGHT", "quick$(touch x)"), ("CTRAIN_PREFLIGHT", "full\necho hi"),
                      ("CTRAIN_PREFLIGHT", "'off'"), ("CTRAIN_PREFLIGHT_TMP_MB", "1$(touch x)"),
                      ("CTRAIN_PREFLIGHT_TMP_MB", "5\necho hi"), ("CTRAIN_PREFLIGHT_TMP_MB", "'5'")):  # fmt: skip
        result = dry_run("apptainer", env={**allocation(1), name: bad}, slurm_conf=slurm_conf, check=False)
        assert result.returncode == 2 and f"{name} is" in result.stderr, (name, bad, result.stderr)
        assert "+ srun" not in result.stdout


@pytest.mark.parametrize("driver,floor,unfit", [("570.86.15", "580.65.06", True), ("580.65.06", "580.65.06", False),
                                                ("590.1", "580.65.06", False), ("1000.1", "580.65.06", False),
                                                ("570.86.15", "", False)])  # fmt: skip
def test_a_node_whose_driver_is_older_than_the_images_floor_is_unfit(tmp_path: Path, driver: str, floor: str,
                                                                     unfit: bool) -> None:  # fmt: skip
    """The node checks on a GPU node (nvidia-smi stood in for): a driver older than the one the image's
    CUDA needs (CTRAIN_IMAGE_MIN_DRIVER, compared part by part: 1000 is newer than 580) is named."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\ncase "$*" in *driver_version*) echo {driver} ;; '
                                        '*ecc*) echo "0, 0" ;; *remapped*) echo "0, No" ;; esac\n')  # fmt: skip
    (bin_dir / "nvidia-smi").chmod(0o755)
    (tmp_path / ".ctrain").mkdir()
    (tmp_path / ".ctrain" / "4242.preflight").write_text("tok\n")
    program = REPO / "sbatch" / "lib" / "programs" / "node-checks.sh"
    out = subprocess.run(["sh", str(program), str(tmp_path), "tok", "1", "", "0", floor], capture_output=True, text=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "1",
                              "SLURMD_NODENAME": "gpu001", "TMPDIR": str(tmp_path)}, check=False)  # fmt: skip
    named = [line for line in out.stdout.splitlines() if line.startswith("unfit gpu001 driver ")]
    assert bool(named) == unfit, out.stdout + out.stderr
    if unfit:
        assert named == [f"unfit gpu001 driver NVIDIA driver {driver} is older than {floor}, the oldest the image's CUDA "
                         "runs on: ask for nodes with a newer driver (--exclude this one), or use an image built for an "
                         "older CUDA"]  # fmt: skip
    assert out.stdout.splitlines()[-1] == f"ok gpu001 TMPDIR {out.stdout.split('TMPDIR ')[1].split(' ')[0]} MiB free, 1 GPU(s), driver {driver}"


@pytest.mark.parametrize("value", ["580.65\n06", "580'", "$(id)", "580.65.06; reboot", "1.2.3.4.5"])
def test_a_driver_floor_that_is_not_a_version_is_refused(fake_slurm: Path, slurm_conf: Path, value: str) -> None:
    """CTRAIN_IMAGE_MIN_DRIVER reaches every node's checks as an argument: only a version passes."""
    out = library(fake_slurm, "CTRAIN_RUNTIME=apptainer; ctrain_defaults; ctrain_check_settings; echo went-on",
                  slurm_conf, CTRAIN_IMAGE_MIN_DRIVER=value)  # fmt: skip
    assert out.returncode == 2 and "went-on" not in out.stdout, out.stdout
    assert out.stderr.startswith("ctrain: error: CTRAIN_IMAGE_MIN_DRIVER is '"), out.stderr
