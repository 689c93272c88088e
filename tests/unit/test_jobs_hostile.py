"""Hostile input to `ctrain submit`, `logs` and `status`: settings that would run code at submit, values
that crashed the checks, scripts and logs that are not what they seem, files --write-script must not
replace. Each is one clear ConfigError (or is handled), and nothing is lost."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ctrain import slurm
from ctrain.config import SlurmConfig, load_config
from ctrain.errors import ConfigError, CtrainError
from ctrain.jobs import submit
from tests.unit.test_settings import within

REPO = Path(__file__).resolve().parents[2]
SIF = b"#!/usr/bin/env run-singularity\n\0SIF_MAGIC0\x01"


def project(root: Path, yaml: str = "") -> Path:
    """A project at ``root`` (the shipped sbatch/ scripts), its ctrain.yaml holding ``yaml``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "ctrain.yaml").write_text(yaml)
    return root


def prepare(root: Path, **changes: object) -> submit.Job:
    return submit.prepare(load_config(root / "ctrain.yaml"), recipe="recipes/demo-addition.yaml", **changes)


def one_line(error: pytest.ExceptionInfo[BaseException], *says: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for part in says:
        assert part in message, (part, message)


# --- 3. settings that bash or the loader act on --------------------------------------------------


@pytest.mark.parametrize("name", ["BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "PROMPT_COMMAND",
                                  "CDPATH", "GLOBIGNORE", "BASH_FUNC_ls", "LD_PRELOAD", "LD_AUDIT"])  # fmt: skip
def test_slurm_env_refuses_variables_bash_or_the_loader_run_code_from(name: str) -> None:
    with pytest.raises(ConfigError) as error:
        SlurmConfig(env={name: "/tmp/evil.sh"}).validate()
    one_line(error, f"slurm.env: {name} ", "remove it")
    with pytest.raises(ConfigError, match="not an environment variable name"):
        SlurmConfig(env={"BASH_FUNC_ls%%": "() { id; }"}).validate()
    SlurmConfig(env={"PATH": "/opt/bin:/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", "NCCL_DEBUG": "INFO"}).validate()


@pytest.mark.parametrize("source", ["config", "environment"])
def test_resolving_the_settings_at_submit_runs_no_code_of_the_configs_or_the_environments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """The settings are resolved by bash on this machine: the config's PATH and LD_LIBRARY_PATH (allowed,
    for the job) or an inherited BASH_ENV must not make it run anything."""
    evil = tmp_path / "evil"
    evil.mkdir()
    canary = tmp_path / "ran"
    for tool in ("id", "dirname", "realpath", "readlink"):  # what the library runs; `: >` is a builtin
        (evil / tool).write_text(f"#!/bin/sh\n: > {canary}\necho 0\n")
        (evil / tool).chmod(0o755)
    (evil / "env.sh").write_text(f": > {canary}\n")
    if source == "environment":
        monkeypatch.setenv("BASH_ENV", str(evil / "env.sh"))
        monkeypatch.setenv("ENV", str(evil / "env.sh"))
        root = project(tmp_path / "p")
    else:
        root = project(tmp_path / "p", f"slurm:\n  env:\n    PATH: {evil}\n    LD_LIBRARY_PATH: {evil}\n")
    job = prepare(root)
    assert not canary.exists(), f"resolving the settings ran code from the {source}"
    assert source == "environment" or f"export PATH={evil}" in job.text  # the job still gets it


def test_a_setting_the_library_refuses_is_its_reason_in_one_line(tmp_path: Path) -> None:
    root = project(tmp_path, "slurm:\n  env:\n    CTRAIN_PREFLIGHT: bogus\n")
    with pytest.raises(ConfigError) as error:
        prepare(root)
    one_line(error, "CTRAIN_PREFLIGHT is 'bogus'; valid: off, quick, full")


# --- 2. and 6. values the checks read ------------------------------------------------------------


def job(**options: str) -> submit.Job:
    return submit.Job(Path("x.sbatch"), "apptainer", "", Path("/p"), {}, [], dict(options))


@pytest.mark.parametrize("options, says", [
    ({"nodes": "2-4"}, "--nodes=2-4 is a range"),
    ({"nodes": "four"}, "--nodes=four is not a number"),
    ({"gpus-per-node": "foo"}, "--gpus-per-node=foo is not a number"),
    ({"gpus-per-node": "h100:x"}, "--gpus-per-node=h100:x is not a number"),
    ({"ntasks-per-node": "²"}, "--ntasks-per-node=² is not a number"),
])  # fmt: skip
def test_a_world_size_that_cannot_be_known_is_said(options: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as error:
        job(**options).world_size
    one_line(error, says)


def test_world_size_reads_what_slurm_reads() -> None:
    assert job(nodes="3-3", **{"gpus-per-node": "h100:2"}).world_size == 6
    assert job(nodes="2", **{"ntasks-per-node": "4"}).world_size == 8
    assert submit._cpus_per_gpu({"gpus-per-node": "h100:4", "cpus-per-task": "8"}) == 2
    with pytest.raises(ConfigError, match="--gpus-per-node=a:b is not a number"):
        submit._cpus_per_gpu({"gpus-per-node": "a:b", "cpus-per-task": "8"})


@pytest.mark.parametrize("settings, says", [
    ({"sbatch_args": ["--gpus-per-node=foo"]}, "--gpus-per-node is not a number of GPUs"),
    ({"sbatch_args": ["--nodes=x"]}, "--nodes is not a number of nodes"),
    ({"sbatch_args": ["--nodes"]}, "--nodes needs a value"),
    ({"sbatch_args": ["--mem=-1"]}, "--mem is not a size"),
    ({"sbatch_args": ["--time=4h"]}, "is not a Slurm time limit"),
    ({"sbatch_args": ["-N4"]}, "is a short option: write the long form, --nodes=4"),
    ({"sbatch_args": ["-p=gpu"]}, "is a short option: write the long form, --partition=gpu"),
    ({"sbatch_args": ["-Z"]}, "is a short option: write its long form"),
    ({"mem": "abc"}, "slurm.mem (--mem) 'abc' is not a size"),
    ({"mem": "-1"}, "slurm.mem (--mem) '-1' is not a size"),
])  # fmt: skip
def test_sbatch_values_ctrain_reads_are_checked_as_slurm_reads_them(settings: dict, says: str) -> None:
    with pytest.raises(ConfigError) as error:
        SlurmConfig(**settings).validate()
    one_line(error, says)


def test_good_sbatch_values_pass_and_a_zero_time_is_no_limit(tmp_path: Path) -> None:
    for mem in ("0", "1024", "500G", "64g"):
        SlurmConfig(mem=mem, sbatch_args=["--nodes=2-4", "--gpus-per-node=h100:8"]).validate()
    SlurmConfig(sbatch_args=["--nodes=2-4", "--gpus-per-node=h100:8", "--mem-per-cpu=4G"]).validate()
    assert slurm.time_seconds("0") is None and slurm.time_seconds("0:0") is None
    submit.check_signal(prepare(project(tmp_path), time="0").options)  # Slurm: no limit, so no warning to place


# --- 2. scripts and libraries that are not text ---------------------------------------------------


def test_a_script_or_library_that_is_not_utf8_is_one_error(tmp_path: Path) -> None:
    root = project(tmp_path)
    (root / "binary.sbatch").write_bytes(b"#!/bin/bash\n\xff\xfe\0\0")
    with pytest.raises(ConfigError) as error:
        prepare(root, script="binary.sbatch")
    one_line(error, "binary.sbatch line 2: byte 0xff is not UTF-8")
    shutil.copytree(REPO / "sbatch", root / "sbatch")
    with (root / "sbatch/lib/ctrain.sh").open("ab") as handle:
        handle.write(b"\xff")
    with pytest.raises(ConfigError) as error:
        prepare(root)
    one_line(error, "the sbatch library", "is not UTF-8")


def test_a_script_that_is_no_ctrain_script_is_one_line(tmp_path: Path) -> None:
    root = project(tmp_path)
    (root / "passwd.sbatch").write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ConfigError) as error:
        prepare(root, script="passwd.sbatch")
    one_line(error, "is not a ctrain sbatch script", 'ctrain_main RUNTIME "$@"')


# --- 4. mounted directories with the mount lists' separators -------------------------------------


@pytest.mark.parametrize("name", ["my:proj", "my,proj"])
def test_a_project_directory_with_a_mount_separator_is_refused_at_submit(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError) as error:
        prepare(project(tmp_path / name))
    one_line(error, f"the project directory {tmp_path / name} contains ',' or ':'", "rename or move the directory")


def test_a_hugging_face_cache_with_a_mount_separator_is_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("HF_HOME", "/shared/hf:cache")
    with pytest.raises(ConfigError) as error:
        prepare(project(tmp_path))
    one_line(error, "the Hugging Face cache", "/shared/hf:cache")


# --- 5. --write-script replaces only a script ctrain wrote ----------------------------------------


def test_write_script_never_replaces_a_file_it_did_not_write(tmp_path: Path) -> None:
    root = project(tmp_path)
    rendered = prepare(root)
    recipe = root / "recipe.yaml"
    recipe.write_text("model:\n  name: mine\n")
    fifo = root / "fifo"
    os.mkfifo(fifo)
    link = root / "link.sbatch"
    link.symlink_to(recipe)
    for path, says in [(recipe, "is not a script ctrain wrote"), (fifo, "is not a regular file"),
                       (link, "is a symbolic link")]:  # fmt: skip
        with within(5), pytest.raises(ConfigError) as error:
            submit.write_script(rendered, path)
        one_line(error, f"--write-script {path}", says)
    assert recipe.read_text() == "model:\n  name: mine\n" and fifo.is_fifo() and link.is_symlink()
    script = root / "job.sbatch"
    submit.write_script(rendered, script)
    submit.write_script(prepare(root, time="20"), script)  # its own script: replaced
    assert "#SBATCH --time=20" in script.read_text()


# --- 1. logs that are devices, FIFOs or huge -------------------------------------------------------


class NoController(slurm.Local):
    """This machine, with a controller that no longer knows any job: logs are found in logs/."""

    def run(self, args, **_: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        return subprocess.CompletedProcess(list(args), 1, "", "slurm_load_jobs error: Invalid job id specified")

    def has(self, tool: str) -> bool:
        return False


def test_a_log_that_is_a_device_or_a_fifo_is_not_read(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    os.mkfifo(logs / "x-5.out")
    (logs / "x-6.out").symlink_to("/dev/null")
    client = slurm.Slurm(NoController())
    for job_id in ("5", "6"):
        with within(5):
            with pytest.raises(CtrainError, match="is not a regular file"):
                client.read_log(job_id, search=[logs])
            assert client.job_events(slurm.Job(job_id, "x", "FAILED"), search=[logs]) == []


def test_logs_prints_the_end_of_a_huge_log_and_says_so(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "x-7.out"
    with log.open("wb") as handle:  # sparse: 3 x READ_LIMIT of NULs, then the last lines
        handle.truncate(3 * slurm.READ_LIMIT)
        handle.seek(0, os.SEEK_END)
        handle.write(b"\nstep 99\nthe end\n")
    assert len(slurm.Local().read(log) or b"") == slurm.READ_LIMIT
    text = slurm.Slurm(NoController()).read_log("7", search=[logs])
    assert text.startswith(f"[ctrain: the end of {log} only") and text.endswith("step 99\nthe end\n")
    assert len(text) <= slurm.READ_LIMIT + 200


# --- values Slurm takes that ctrain refused, and GPUs, CPUs and memory asked for sbatch's other ways ----------


class Cluster(slurm.Local):
    """sinfo of a cluster whose nodes have 128 CPUs, 1031000 MB and 8 GPUs, for any partition."""

    def has(self, tool: str) -> bool:
        return tool == "sinfo"

    def run(self, args, **_: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        shape = "%c|%m|%G" in " ".join(args)
        return subprocess.CompletedProcess(list(args), 0, "128|1031000|gpu:h100:8\n" if shape else "gpu:h100:8\n", "")


NODE = [slurm.NodeShape(128, 1031000, 8)]


def test_memory_sizes_with_a_b_after_the_unit_are_taken() -> None:
    """Slurm reads 64GB (and 64gb) as 64G."""
    for size in ("64GB", "64gb", "512MB", "1TB", "64G", "0"):
        SlurmConfig(mem=size).validate()
        SlurmConfig(sbatch_args=[f"--mem={size}"]).validate()
        SlurmConfig(sbatch_args=[f"--mem-per-gpu={size}"]).validate()
    for bad in ("64B", "64BG", "64GBB", "GB"):
        with pytest.raises(ConfigError) as error:
            SlurmConfig(mem=bad).validate()
        one_line(error, f"slurm.mem (--mem) {bad!r} is not a size", "64GB")


def test_secret_names_are_told_by_whole_words_and_a_path_to_one_is_none() -> None:
    """TOKEN in TOKENIZERS_PARALLELISM is no word of its own; HF_TOKEN_PATH names where a token is."""
    for name in ("TOKENIZERS_PARALLELISM", "MAX_TOKENS", "HF_TOKEN_PATH", "NUM_TOKENS", "SECRETS_DIR",
                 "MY_PASSWORD_FILE", "KEY_FIELD"):  # fmt: skip
        SlurmConfig(env={name: "false"}).validate()
    for name in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "hf_token", "AWS_ACCESS_KEY_ID",
                 "MLFLOW_TRACKING_PASSWORD", "OPENAI_APIKEY", "DB_PASSWD"):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            SlurmConfig(env={name: "x"}).validate()
        one_line(error, f"slurm.env: {name} looks like a secret")


def test_automatic_sizing_adds_no_second_memory_or_cpu_option() -> None:
    """sbatch refuses --mem beside --mem-per-gpu (or --mem-per-cpu), and --cpus-per-task beside --cpus-per-gpu."""
    for option in ("--mem-per-gpu=80G", "--mem-per-cpu=4G"):
        half = SlurmConfig(gpus_per_node=4, sbatch_args=[option])
        assert submit.gpu_resources(half, NODE)[0] == {"cpus_per_task": 64}
        whole, _ = submit.gpu_resources(SlurmConfig(gpus_per_node=8, sbatch_args=[option]), NODE)
        assert "mem" not in whole, whole
    per_gpu = SlurmConfig(gpus_per_node=4, sbatch_args=["--cpus-per-gpu=16"])
    assert submit.gpu_resources(per_gpu, NODE)[0] == {"mem": "515500M"}
    assert submit.gpu_resources(SlurmConfig(gpus_per_node=8, sbatch_args=["--cpus-per-gpu=16"]), NODE)[0] == {
        "mem": "1031000M"
    }
    assert submit.gpu_resources(SlurmConfig(gpus_per_node=8, sbatch_args=["--cpus-per-gpu=16", "--mem-per-gpu=8G"]),
                                NODE)[0] == {}  # fmt: skip


def test_a_job_with_its_own_memory_or_cpus_per_gpu_renders_what_sbatch_takes(tmp_path: Path) -> None:
    root = project(tmp_path, "slurm:\n  gpus_per_node: 4\n  sbatch_args: ['--mem-per-gpu=80G', '--cpus-per-gpu=2']\n")
    job = prepare(root, client=slurm.Slurm(Cluster()))
    assert "mem" not in job.options and "cpus-per-task" not in job.options, job.options
    assert "#SBATCH --mem-per-gpu=80G" in job.text and "#SBATCH --cpus-per-gpu=2" in job.text
    assert any(n.startswith("warning: 2 CPUs per GPU (--cpus-per-gpu=2)") for n in job.notes), job.notes
    for settings, says in [("mem: 10G\n  sbatch_args: ['--mem-per-gpu=80G']", "--mem and --mem-per-gpu are both set"),
                           ("cpus_per_task: 8\n  sbatch_args: ['--cpus-per-gpu=2']",
                            "--cpus-per-task and --cpus-per-gpu are both set")]:  # fmt: skip
        with pytest.raises(ConfigError) as error:
            load_config(project(tmp_path, f"slurm:\n  {settings}\n") / "ctrain.yaml")
        one_line(error, says, "sbatch takes only one of")


@pytest.mark.parametrize("options, gpus", [
    ({"gres": "gpu:8"}, 8), ({"gres": "gpu:h100:8"}, 8), ({"gres": "nvme:1,gpu:h100:4,shard:2"}, 4),
    ({"gres": "gpu"}, 1), ({"gres": "gpu:a100"}, 1), ({"gres": "nvme:1"}, None), ({"gpus-per-node": "h100:2"}, 2),
    ({"gpus": "16", "nodes": "2"}, 8), ({"gpus": "h100:4", "nodes": "1"}, 4),
])  # fmt: skip
def test_gpus_per_node_are_read_from_each_of_sbatchs_ways(options: dict[str, str], gpus: int | None) -> None:
    assert submit.node_gpus(options) == gpus
    nodes = {"nodes": "3", **options}
    assert job(**nodes).world_size == int(nodes["nodes"]) * (gpus or 1)


def test_a_gpu_total_that_does_not_divide_among_the_nodes_is_one_error() -> None:
    with pytest.raises(ConfigError) as error:
        submit.node_gpus({"gpus": "16", "nodes": "3"})
    one_line(error, "--gpus=16 is the job's total", "--nodes=3", "slurm.gpus_per_node (--gpus-per-node)")
    with pytest.raises(ConfigError) as error:
        SlurmConfig(sbatch_args=["--gres=gpu:h100:x"]).validate()
    one_line(error, "--gres", "'gpu:h100:x' is not gpu[:TYPE][:COUNT]")


@pytest.mark.parametrize("arg", ["--gres=gpu:8", "--gres=gpu:h100:8", "--gpus-per-node=8"])
def test_gpus_asked_for_in_sbatch_args_are_sized_and_checked(tmp_path: Path, arg: str) -> None:
    root = project(tmp_path / "p", f"slurm:\n  sbatch_args: ['{arg}']\n")
    shutil.copytree(REPO / "recipes", root / "recipes")
    job = prepare(root, client=slurm.Slurm(Cluster()))
    assert "exclusive" in job.options and job.options["mem"] == "0", job.options  # all 8 GPUs: whole nodes
    assert submit.check_gpus(job, slurm.Slurm(Cluster())) == []  # no "training runs on CPU"
    assert job.world_size == 8
    with pytest.raises(ConfigError, match=r"global_batch_size \(64\) does not divide among 5 processes"):
        submit.check_job_recipe(prepare(root, sbatch_args=[arg.replace("8", "5")]))


def test_values_with_spaces_or_quotes_are_written_as_sbatch_reads_them(tmp_path: Path) -> None:
    """sbatch reads #SBATCH --comment="my run" as one value and removes the quotes."""
    root = project(tmp_path, 'slurm:\n  job_name: "Llama 8B"\n  sbatch_args: [\'--constraint="a100|h100"\', '
                             "'--comment=my run', '--reservation=\"big\"']\n")  # fmt: skip
    job = prepare(root)
    for line in ('#SBATCH --job-name="Llama 8B"\n', '#SBATCH --comment="my run"\n', "#SBATCH --constraint=a100|h100\n",
                 "#SBATCH --reservation=big\n"):  # fmt: skip
        assert line in job.text, line
    assert job.options["job-name"] == "Llama 8B" and job.options["comment"] == "my run"
    assert prepare(root, job_name="a b c").options["job-name"] == "a b c"
    SlurmConfig(sbatch_args=['--comment="my run"']).validate()
    header, options = submit.render_header(['#SBATCH --job-name="my job"', "#SBATCH -J x"], [])
    assert options["job-name"] == "x" and header == ['#SBATCH --job-name="my job"', "#SBATCH -J x"]
    assert submit.render_header(['#SBATCH --job-name="my job"'], [])[1] == {"job-name": "my job"}
    for settings, says in [({"sbatch_args": ["--comment=a\nb"]}, "contains '\\n'"), ({"job_name": "a\tb"}, "'\\t'")]:
        with pytest.raises(ConfigError) as error:
            SlurmConfig(**settings).validate()  # type: ignore[arg-type]
        one_line(error, says)


@pytest.mark.parametrize("settings, says", [
    ({"sbatch_args": ['--comment=say "hi"']}, "contains a double quote"),
    ({"sbatch_args": ['--comment="a"b"']}, "contains a double quote"),
    ({"sbatch_args": ["--partition=a b"]}, "contains a space; only --comment, --job-name, --constraint"),
    ({"sbatch_args": ['--comment=" "']}, "its value is empty"),
    ({"job_name": 'say "hi"'}, "contains a double quote"),
    ({"account": "my lab"}, "contains a space"),
])  # fmt: skip
def test_quotes_inside_a_value_and_spaces_elsewhere_are_refused(settings: dict, says: str) -> None:
    with pytest.raises(ConfigError) as error:
        SlurmConfig(**settings).validate()
    one_line(error, says)


def test_mount_sources_and_host_directories_are_expanded_at_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:  # fmt: skip
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CTRAIN_TEST_USER", "me")
    root = project(tmp_path / "p", "slurm:\n  mounts: ['~/datasets:/datasets', 'rel:/rel:ro']\n"
                                   "  hf_cache: /scratch/$CTRAIN_TEST_USER/hf\n  outputs: ${HOME}/out\n"
                                   "  data: ~/data\n")  # fmt: skip
    job = prepare(root)
    home, project_dir = tmp_path / "home", tmp_path / "p"
    assert f"export CTRAIN_MOUNTS={home}/datasets:/datasets,{project_dir}/rel:/rel:ro\n" in job.text
    assert "export CTRAIN_HF_CACHE=/scratch/me/hf\n" in job.text
    assert f"export CTRAIN_OUTPUTS={home}/out\n" in job.text and f"export CTRAIN_DATA={home}/data\n" in job.text
    monkeypatch.delenv("CTRAIN_TEST_USER")
    with pytest.raises(ConfigError) as error:
        prepare(root)
    one_line(error, "slurm.hf_cache /scratch/$CTRAIN_TEST_USER/hf names $CTRAIN_TEST_USER, which is not set here")
    root = project(tmp_path / "q", "slurm:\n  mounts: ['${CTRAIN_NO_SUCH}/d:/d']\n")
    with pytest.raises(ConfigError) as error:
        prepare(root)
    one_line(error, "slurm.mounts[0]", "names $CTRAIN_NO_SUCH, which is not set here")
    monkeypatch.setenv("CTRAIN_TEST_USER", "a,b")
    with pytest.raises(ConfigError) as error:
        prepare(project(tmp_path / "r", "slurm:\n  mounts: ['/x/$CTRAIN_TEST_USER:/d']\n"))
    one_line(error, "slurm.mounts[0]", "/x/a,b contains ',' or ':'")


def test_an_output_dir_the_job_would_refuse_is_refused_at_submit(tmp_path: Path) -> None:
    """What the job says as it starts (a file there, files of no ctrain run), said before it waits in the queue."""
    root = project(tmp_path / "p")
    shutil.copytree(REPO / "recipes", root / "recipes")
    (root / "images").mkdir()
    (root / "images" / "ctrain-latest.sif").write_bytes(SIF)
    for output_dir, says in [
        ("/dev/null", "training.output_dir /dev/null cannot be written: /dev/null is a file, not a directory"),
        ("recipes", "training.output_dir recipes holds files no ctrain run wrote (demo-addition"),
        ("/workspace/recipes", "recipes holds files no ctrain run wrote"),
        ("/", "training.output_dir / holds files no ctrain run wrote"),
        ("/proc/1", "training.output_dir /proc/1 holds files no ctrain run wrote"),
    ]:
        with pytest.raises(ConfigError) as error:
            submit.check(prepare(root, overrides=(f"training.output_dir={output_dir}",)), slurm.Slurm(NoController()))
        one_line(error, says)
    run = root / "outputs" / "run"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: run\n")
    (run / "checkpoint-5").mkdir()
    for output_dir in ("outputs/run", "outputs/new", "/outputs/anything", "$HOME/later", "/data/x"):
        submit.check_job_recipe(prepare(root, overrides=(f"training.output_dir={output_dir}",)))
