"""Parsing Slurm's output, and `ctrain submit`'s rendering and checks (no cluster needed).

The texts below are what Slurm 22.05 prints for these commands (taken from the testbed)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import slurm
from ctrain.jobs import checks, library, render, submit
from ctrain.cli import main
from ctrain.config import SlurmConfig, load_config
from ctrain.errors import ConfigError, CtrainError, ParseError
from tests.unit.test_sbatch import NODE_COUNTS, REPO, golden

# --- Slurm output -------------------------------------------------------------------------------


def test_sbatch_parsable() -> None:
    assert slurm.parse_sbatch_parsable("1234\n") == "1234"
    assert slurm.parse_sbatch_parsable("sbatch: warning: memory limit ignored\n77;cluster2\n") == "77"
    with pytest.raises(ParseError) as err:
        slurm.parse_sbatch_parsable("Submitted batch job 12\n")
    assert "Submitted batch job 12" in str(err.value) and err.value.raw == "Submitted batch job 12\n"


def test_squeue_name_last_keeps_separators() -> None:
    raw = "42|RUNNING|1:02|1:00:00|2|node[1-2]|ctrain\n43_1|PENDING|0:00|10:00|16|(Resources)|odd|name\n"
    jobs = slurm.parse_squeue(raw)
    assert jobs[0] == slurm.Job("42", "ctrain", "RUNNING", "1:02", "1:00:00", "2", "node[1-2]", source="squeue")
    assert jobs[1].id == "43_1" and jobs[1].name == "odd|name" and jobs[1].where == "(Resources)"
    with pytest.raises(ParseError):
        slurm.parse_squeue("JOBID PARTITION NAME\n")


def test_sacct_states_and_exit_codes() -> None:
    raw = "7|CANCELLED by 1001|00:00:12|01:00:00|2|node[1-2]|0:15|0|ctrain\n8|COMPLETED|00:05:00|01:00:00|1|node1|0:0|1|x\n"
    jobs = slurm.parse_sacct(raw)
    assert [j.state for j in jobs] == ["CANCELLED", "COMPLETED"]
    assert jobs[0].exit_code == "0:15" and jobs[1].restarts == "1" and jobs[1].final
    with pytest.raises(ParseError):
        slurm.parse_sacct("7|COMPLETED\n")


SCONTROL = (
    "JobId=5 JobName=ctrain UserId=ctrain(1001) GroupId=ctrain(1001) MCS_label=N/A Priority=4294901756 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=1 BatchFlag=2 "
    "Reboot=0 ExitCode=0:0 RunTime=00:00:41 TimeLimit=01:00:00 TimeMin=N/A SubmitTime=2026-11-21T17:29:07 "
    "NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=4 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=4,mem=2G,node=2,billing=4 Socks/Node=* Command=/home/a b/sbatch/x.sbatch "
    "WorkDir=/home/a b StdErr=/home/a b/logs/ctrain-5.out StdIn=/dev/null StdOut=/home/a b/logs/ctrain-5.out Power="
)


def test_scontrol_record_values_with_spaces_and_equals() -> None:
    record = slurm.parse_scontrol_record(SCONTROL)
    assert record["StdOut"] == "/home/a b/logs/ctrain-5.out"
    assert record["TRES"] == "cpu=4,mem=2G,node=2,billing=4"
    assert record["Socks/Node"] == "*" and record["ReqB:S:C:T"] == "0:0:*:*" and record["Power"] == ""
    job = slurm.job_from_record(record)
    assert (job.id, job.state, job.where, job.restarts, job.nodes) == ("5", "RUNNING", "node[1-2]", "1", "2")
    with pytest.raises(ParseError):
        slurm.parse_scontrol_record("slurm_load_jobs error: Invalid job id specified")


def test_pending_job_shows_its_reason() -> None:
    record = slurm.parse_scontrol_record(
        SCONTROL.replace("JobState=RUNNING Reason=None", "JobState=PENDING Reason=BeginTime")
    )
    assert slurm.job_from_record(record).where == "BeginTime"


def test_gres_gpus() -> None:
    assert slurm.parse_gres_gpus("gpu:8") == 8
    assert slurm.parse_gres_gpus("gpu:h100:8(S:0-1)") == 8
    assert slurm.parse_gres_gpus("(null)") == 0
    assert slurm.parse_gres_gpus("gpu:a100:4,gpu:v100:2") == 6


def test_job_ids() -> None:
    assert slurm.check_job_id(" 123 ") == "123" and slurm.check_job_id("9_3") == "9_3"
    with pytest.raises(CtrainError, match="not a Slurm job id"):
        slurm.check_job_id("123; rm -rf /")


def test_job_ids_are_ascii_digits_in_every_form() -> None:
    """str.isdigit and a str pattern's \\d take Arabic-Indic (١٢٣) and full-width (３４) digits too;
    Slurm does not. One test (slurm.is_job_id) serves every command, with the forms each takes."""
    for bad in ("١٢٣", "３４", "12_٣", "١٢_3", "12.٣", "²"):
        assert not slurm.is_job_id(bad), bad
        with pytest.raises(ConfigError, match="is not a Slurm job id"):
            slurm.check_job_id(bad)
    assert slurm.is_job_id("12") and slurm.is_job_id("12_3.0") and slurm.is_job_id("12.batch")
    assert not slurm.is_job_id("12\n") and slurm.check_job_id("12\n") == "12"
    assert slurm.is_job_id("12_3", step=False) and not slurm.is_job_id("12.0", step=False)
    assert not slurm.is_job_id("12_3", array=False) and slurm.is_job_id("12", array=False, step=False)
    with pytest.raises(ConfigError, match="is not a Slurm job id"):
        slurm.check_job_id("12.0", step=False)
    with pytest.raises(ParseError):
        slurm.parse_sbatch_parsable("١٢٣\n")


def test_ctrain_report_takes_only_ascii_job_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `ctrain report ١٢٣` went looking for .ctrain/١٢٣.timeline; now one error line, exit 2."""
    (tmp_path / "ctrain.yaml").write_text("")
    monkeypatch.chdir(tmp_path)
    for bad in ("١٢٣", "３４_1", "12.0"):
        result = CliRunner().invoke(main, ["report", bad])
        assert result.exit_code == 2 and "is not a Slurm job id" in result.output, (bad, result.output)


def test_cancel_signals_are_the_names_scancel_knows() -> None:
    """Slurm's own table (sig_name2num in src/common/proc_args.c), with or without SIG, any case, or a
    number 1-64: a name the system has but scancel refuses (RTMIN, WINCH, PIPE) is refused before
    scancel runs, in one line that lists the names it takes."""
    for name in ("HUP", "INT", "QUIT", "ABRT", "KILL", "ALRM", "TERM", "USR1", "USR2", "URG", "CONT", "STOP", "TSTP",
                 "TTIN", "TTOU", "XCPU"):  # fmt: skip
        assert slurm.check_signal(name) == name and slurm.check_signal(f" sig{name.lower()}") == f"SIG{name}"
    assert [slurm.check_signal(n) for n in ("1", "10", "064")] == ["1", "10", "064"]
    for bad in ("RTMIN", "RTMIN+1", "SIGRTMAX-2", "WINCH", "SIGPIPE", "CHLD", "SIGSIGUSR1", "SIG", "0", "65", "١٠"):
        with pytest.raises(ConfigError, match="is not a signal scancel knows") as err:
            slurm.check_signal(bad)
        assert "HUP, INT," in str(err.value) and "XCPU" in str(err.value) and "\n" not in str(err.value), bad


def test_status_table_reads() -> None:
    text = slurm.status_table([slurm.Job("5", "ctrain", "RUNNING", "0:41", "1:00:00", "2", "node[1-2]", "0:0")])
    header, row = text.splitlines()
    assert header.split()[:3] == ["JOB", "NAME", "STATE"] and row.split()[:3] == ["5", "ctrain", "RUNNING"]


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30", 1800), ("30:15", 1815), ("04:00:00", 14400), ("2-00:00:00", 172800), ("1-12", 129600), ("1-0:30", 88200)],
)
def test_time_limits(value: str, seconds: int) -> None:
    assert slurm.time_seconds(value) == seconds


def test_time_limit_errors_say_the_formats() -> None:
    with pytest.raises(ConfigError, match="use MINUTES, HH:MM:SS, D-HH or D-HH:MM:SS"):
        slurm.time_seconds("4h")
    assert slurm.time_seconds("UNLIMITED") is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"time": "4h"}, "is not a Slurm time limit"),
        ({"gpus_per_node": 8, "ntasks_per_node": 8}, "leave ntasks_per_node"),
        ({"nodes": 0}, "slurm.nodes must be at least 1"),
        ({"mounts": ["/a"]}, "must look like /host/dir:/container/dir"),
        ({"env": {"1BAD": "x"}}, "not an environment variable name"),
        ({"env": {"HF_TOKEN": "hf_x"}}, "HF_TOKEN looks like a secret; .*Export it in your shell instead"),
        ({"env": {"WANDB_API_KEY": "x"}}, "looks like a secret"),
        ({"sbatch_args": ["qos=high"]}, "must be an sbatch option"),
        ({"hang_timeout": -1}, "slurm.hang_timeout must be at least 0"),
        ({"node_check": -5}, "slurm.node_check must be at least 0"),
    ],
)
def test_config_relations(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SlurmConfig(**settings).validate()


def test_unknown_slurm_key_lists_valid_ones(tmp_path: Path) -> None:
    (tmp_path / "ctrain.yaml").write_text("slurm:\n  gpus: 8\n")
    with pytest.raises(ConfigError, match="unknown key 'slurm.gpus'; valid keys under slurm: .*gpus_per_node"):
        load_config(tmp_path / "ctrain.yaml")


# --- rendering ------------------------------------------------------------------------------------


def project(tmp_path: Path, yaml: str) -> Path:
    (tmp_path / "ctrain.yaml").write_text(yaml)
    return tmp_path


GPU_CLUSTER = """\
slurm:
  runtime: pyxis
  partition: gpu
  account: proj42
  gpus_per_node: 8
  cpus_per_task: 96
  time: "2-00:00:00"
  signal_lead: 600
  image: nvcr.io#nvidia/pytorch:24.10-py3
  hf_cache: /fsx/hf_cache
  outputs: /fsx/outputs
  efa: true
  env:
    NCCL_DEBUG: WARN
"""


def golden_text(text: str) -> str:
    """A rendered script (or a dry run's output) as its golden holds it: the header, the settings block and the
    script's own lines as rendered, and in place of the inlined library one line naming its sha256 and length;
    that the library inlined is the assembled one is :func:`test_the_inlined_library_is_the_assembled_one`'s."""
    inlined = render.inlined_library(text)
    digest = hashlib.sha256(inlined.encode()).hexdigest()
    start = text.index(render.INLINED + "\n")
    end = text.index(render.INLINED_END + "\n") + len(render.INLINED_END) + 1
    line = f"{render.INLINED.removesuffix(' ---')}: sha256 {digest}, {inlined.count(chr(10))} lines ---\n"
    return text[:start] + line + text[end:]


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_rendered_script_golden(tmp_path: Path, nodes: int) -> None:
    config = load_config(project(tmp_path, GPU_CLUSTER) / "ctrain.yaml")
    job = submit.prepare(
        config, recipe="recipes/demo-addition.yaml", overrides=("training.max_steps=100",), nodes=nodes
    )
    golden(f"submit-pyxis-{nodes}node.sbatch", golden_text(job.text))
    assert job.template.name == ("pyxis.sbatch" if nodes == 1 else "pyxis_multinode.sbatch")
    assert job.options["nodes"] == str(nodes) and job.options["signal"] == "B:USR1@600"


def test_hang_timeout_reaches_the_script_and_defaults_there(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "slurm:\n  hang_timeout: 120\n") / "ctrain.yaml")
    assert submit.prepare(config, nodes=2).settings["CTRAIN_HANG_TIMEOUT"] == "120"
    config = load_config(project(tmp_path, "slurm:\n  nodes: 2\n") / "ctrain.yaml")
    assert submit.prepare(config, nodes=2).settings["CTRAIN_HANG_TIMEOUT"] == "600"  # the library's default


def test_node_check_reaches_the_script_and_defaults_there(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "slurm:\n  node_check: 0\n") / "ctrain.yaml")
    assert submit.prepare(config, nodes=2).settings["CTRAIN_NODE_CHECK"] == "0"
    config = load_config(project(tmp_path, "slurm:\n  nodes: 2\n") / "ctrain.yaml")
    assert submit.prepare(config, nodes=2).settings["CTRAIN_NODE_CHECK"] == "30"  # the library's default


def test_rendered_script_runs_as_the_library_says(tmp_path: Path) -> None:
    """Inlining changes nothing: the rendered script resolves the same settings as the library."""
    config = load_config(project(tmp_path, GPU_CLUSTER) / "ctrain.yaml")
    job = submit.prepare(config, nodes=2)
    assert job.settings["CTRAIN_IMAGE"] == "nvcr.io#nvidia/pytorch:24.10-py3"
    assert job.settings["CTRAIN_RECIPE"] == "recipes/demo-addition.yaml"  # the library's default
    assert job.settings["CTRAIN_EFA"] == "1" and job.settings["CTRAIN_CONTAINER_ENV"] == "NCCL_DEBUG"
    assert job.settings["CTRAIN_PROJECT_DIR"] == str(tmp_path)
    assert "source " not in job.text and 'ctrain_main pyxis "$@"' in job.text
    lib = library.assemble(REPO / "sbatch/lib/ctrain.sh")
    assert lib.strip() in job.text


@pytest.mark.parametrize("script, image", [("pyxis", None), ("apptainer_multinode", "docker://ghcr.io/org/ctrain:1")])
def test_the_inlined_library_is_the_assembled_one(tmp_path: Path, script: str, image: str | None) -> None:
    """What the goldens name by its hash: the text between the inline markers is, line for line, the library the
    job's script sources, assembled (ctrain.jobs.library.assemble), and nothing else of the script changed."""
    config = load_config(project(tmp_path, GPU_CLUSTER) / "ctrain.yaml")
    job = submit.prepare(config, script=script, image=image, nodes=2)
    lib = render.library_path(job.template, job.project)
    assert lib == REPO / "sbatch/lib/ctrain.sh"
    assert render.inlined_library(job.text) == library.assemble(lib).rstrip("\n") + "\n"
    before, after = job.text.split(render.INLINED + "\n")[0], job.text.split(render.INLINED_END + "\n")[1]
    template = job.template.read_text()
    assert after in template and library.SOURCE_LINE in template and library.SOURCE_LINE not in before + after


def test_header_lines_replaced_not_duplicated(tmp_path: Path) -> None:
    config = load_config(
        project(tmp_path, "slurm:\n  time: '10'\n  job_name: demo\n  sbatch_args: ['--qos=high', '--exclusive']\n")
        / "ctrain.yaml"
    )
    job = submit.prepare(config, nodes=2)
    header = [line for line in job.text.splitlines() if line.startswith("#SBATCH")]
    assert header.count("#SBATCH --time=10") == 1
    assert "#SBATCH --job-name=demo" in header and "#SBATCH --qos=high" in header and "#SBATCH --exclusive" in header
    assert job.log_dir == tmp_path / "logs"


def test_short_options_in_user_scripts_are_replaced(tmp_path: Path) -> None:
    own = tmp_path / "mine.sbatch"
    own.write_text((REPO / "sbatch/apptainer.sbatch").read_text().replace("#SBATCH --nodes=1\n", "#SBATCH --nodes=1\n#SBATCH -t 5\n"))
    config = load_config(project(tmp_path, "slurm:\n  script: mine.sbatch\n") / "ctrain.yaml")
    job = submit.prepare(config, time="20")
    assert "#SBATCH --time=20" in job.text and "#SBATCH -t 5" not in job.text


def test_config_paths_are_made_absolute_and_container_files_relative(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "z3.json").write_text("{}")
    config = load_config(
        project(tmp_path, "slurm:\n  image: images/c.sif\n  data: data\n  deepspeed_config: configs/z3.json\n")
        / "ctrain.yaml"
    )
    job = submit.prepare(config)
    assert f"export CTRAIN_IMAGE={tmp_path}/images/c.sif" in job.text
    assert f"export CTRAIN_DATA={tmp_path}/data" in job.text
    assert "export CTRAIN_DEEPSPEED_CONFIG=configs/z3.json" in job.text


def test_container_files_outside_the_project_are_refused(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "slurm:\n  deepspeed_config: /etc/z3.json\n") / "ctrain.yaml")
    with pytest.raises(ConfigError, match="outside the project directory .*copy it into the project directory"):
        submit.prepare(config)


def test_unknown_script_lists_the_scripts(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "slurm:\n  script: pyxis_multi\n") / "ctrain.yaml")
    with pytest.raises(ConfigError, match="available: apptainer, apptainer_multinode, pyxis, pyxis_multinode"):
        submit.prepare(config)


def test_overrides_must_be_key_value(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "") / "ctrain.yaml")
    with pytest.raises(ConfigError, match="must look like key=value"):
        submit.prepare(config, recipe="r.yaml", overrides=("max_steps",))
    with pytest.raises(ConfigError, match="the recipe comes first"):
        submit.prepare(config, recipe="a=1")


# --- checks before queueing -----------------------------------------------------------------------


def _image(tmp_path: Path, name: str, head: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(head + b"\0" * 64)
    return path


def test_image_checks(tmp_path: Path) -> None:
    sif = _image(tmp_path, "c.sif", b"#!/usr/bin/env run-singularity\n\0SIF_MAGIC0\x01")
    sqsh = _image(tmp_path, "c.sqsh", b"hsqs")
    text = _image(tmp_path, "c.txt", b"hello")
    submit.check_image(str(sif), "apptainer")
    submit.check_image(str(sqsh), "pyxis")
    submit.check_image("docker://ghcr.io/org/ctrain:1", "apptainer")
    submit.check_image("nvcr.io#nvidia/pytorch:24.10-py3", "pyxis")
    submit.check_image("nvcr.io/nvidia/pytorch:24.10-py3", "pyxis")  # written as enroot's form
    submit.check_image("ubuntu:24.04", "pyxis")
    with pytest.raises(ConfigError, match="pyxis needs an enroot squashfs.*ctrain convert --to sqsh"):
        submit.check_image(str(sif), "pyxis")
    with pytest.raises(ConfigError, match="Apptainer needs a SIF.*ctrain convert --to sif"):
        submit.check_image(str(sqsh), "apptainer")  # an enroot image lacks what Apptainer reads
    with pytest.raises(ConfigError, match="does not exist: build and convert it"):
        submit.check_image(str(tmp_path / "missing.sif"), "apptainer")
    with pytest.raises(ConfigError, match="neither SIF nor squashfs"):
        submit.check_image(str(text), "apptainer")


def test_dry_run_prints_the_exact_script_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project(tmp_path, GPU_CLUSTER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(submit, "check", lambda job, **_: [])  # the checks need the recipe and a cluster
    result = CliRunner().invoke(
        main, ["submit", "--dry-run", "--nodes", "16", "recipes/demo-addition.yaml", "training.max_steps=100"]
    )
    assert result.exit_code == 0, result.output
    expected = (REPO / "tests/golden/sbatch/submit-pyxis-16node.sbatch").read_text()
    shown = f"# in {tmp_path}:\nsbatch --parsable <<'CTRAIN_SCRIPT'\n{expected}CTRAIN_SCRIPT\n"
    assert golden_text(result.output) == shown
    assert not (tmp_path / "logs").exists()  # nothing written, nothing queued


def test_dry_run_output_is_a_runnable_heredoc(tmp_path: Path) -> None:
    """What --dry-run prints, run by bash with sbatch replaced by cat, hands over the script unchanged."""
    config = load_config(project(tmp_path, GPU_CLUSTER) / "ctrain.yaml")
    job = submit.prepare(config, nodes=2)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text('#!/bin/sh\ncat > "$CAPTURE"\n')
    (fake / "sbatch").chmod(0o755)
    import subprocess

    described = job.describe().split("\n", 1)[1]
    subprocess.run(["bash", "-c", described], env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
                   "CAPTURE": str(tmp_path / "got")}, check=True)  # fmt: skip
    assert (tmp_path / "got").read_text() == job.text


class Sinfo(slurm.Local):
    """A test double of a cluster's ``sinfo --format=%G``: the GRES lines given, for any partition.
    The real sinfo is run against the testbed (tests/integration/test_sbatch_commands.py)."""

    def __init__(self, gres: str) -> None:
        super().__init__()
        object.__setattr__(self, "gres", gres)
        object.__setattr__(self, "asked", [])

    def has(self, tool: str) -> bool:
        return True

    def run(self, args, **kwargs):  # type: ignore[no-untyped-def]
        if args[:3] == ["scontrol", "show", "partition"]:  # the partitions' time limits: not told
            return subprocess.CompletedProcess(args, 1, "", "slurm_load_partitions error: Unable to contact slurm controller")
        self.asked.append(list(args))
        assert args[0] == "sinfo"
        return subprocess.CompletedProcess(args, 0, self.gres, "")


def test_gpu_check_against_partition(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, GPU_CLUSTER) / "ctrain.yaml")
    job = submit.prepare(config, nodes=2)
    four = Sinfo("gpu:4(S:0)\ngpu:2\n")
    with pytest.raises(ConfigError, match="8 GPUs per node requested, but the nodes of partition 'gpu' have at most 4"):
        submit.check_gpus(job, slurm.Slurm(four))
    assert four.asked == [["sinfo", "--noheader", "--format=%G", "--partition=gpu"]]
    assert submit.check_gpus(job, slurm.Slurm(Sinfo("gpu:h100:8(S:0-1)\n"))) == []
    cpu_job = submit.prepare(config, nodes=2, gpus_per_node=0)
    assert "gpus-per-node" not in cpu_job.options
    warning = submit.check_gpus(cpu_job, slurm.Slurm(Sinfo("gpu:8\n")))
    assert "training runs on CPU (set slurm.gpus_per_node" in warning[0]


def test_scripts_dir_found_from_elsewhere(tmp_path: Path) -> None:
    assert submit.scripts_dir(tmp_path) == REPO / "sbatch"
    assert shutil.which("bash")


def test_default_image_is_what_ctrain_convert_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IMAGE", raising=False)
    monkeypatch.delenv("CTRAIN_IMAGE", raising=False)
    config = load_config(
        project(tmp_path, "image:\n  name: lab/trainer\n  tag: v3\nconvert:\n  output_dir: /shared/img\n")
        / "ctrain.yaml"
    )
    assert "export CTRAIN_IMAGE=/shared/img/trainer-v3.sif" in submit.prepare(config).text
    assert "export CTRAIN_IMAGE=/shared/img/trainer-v3.sqsh" in submit.prepare(config, script="pyxis").text
    monkeypatch.setenv("IMAGE", "/elsewhere/x.sif")  # the job sees IMAGE too; the script library decides
    job = submit.prepare(config)
    assert "export CTRAIN_IMAGE" not in job.text and job.settings["CTRAIN_IMAGE"] == "/elsewhere/x.sif"


def _demo_project(tmp_path: Path, yaml: str = "") -> Path:
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    if (REPO / "configs").is_dir():
        shutil.copytree(REPO / "configs", tmp_path / "configs")
    _image(tmp_path, "c.sif", b"#!/usr/bin/env run-singularity\n\0SIF_MAGIC0\x01")
    return project(tmp_path, "slurm:\n  image: c.sif\n" + yaml)


def test_recipe_checked_as_the_job_runs_it(tmp_path: Path) -> None:
    cpus = slurm.Slurm(Sinfo("(null)\n"))  # a cluster without GPUs
    config = load_config(_demo_project(tmp_path, "  ntasks_per_node: 2\n") / "ctrain.yaml")
    job = submit.prepare(config, recipe="recipes/demo-addition.yaml", nodes=2)
    assert job.world_size == 4
    submit.check(job, cpus)
    with pytest.raises(ConfigError, match="unknown key 'training.max_stepz'.*did you mean 'max_steps'"):
        submit.check(submit.prepare(config, recipe="recipes/demo-addition.yaml", overrides=("training.max_stepz=5",)), cpus)
    with pytest.raises(ConfigError, match=r"global_batch_size \(64\) does not divide among 6 processes"):
        submit.check(submit.prepare(config, recipe="recipes/demo-addition.yaml", nodes=3), cpus)
    with pytest.raises(ConfigError, match="the recipe recipes/nope.yaml does not exist"):
        submit.check(submit.prepare(config, recipe="recipes/nope.yaml"), cpus)


def test_signal_must_come_after_the_start(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "") / "ctrain.yaml")
    job = submit.prepare(config, time="4")  # the scripts warn 300 s before the end
    with pytest.raises(ConfigError, match=r"comes 300s before the end .* the time limit is 4 \(240s\)"):
        submit.check_signal(job.options)
    submit.check_signal(submit.prepare(config, time="6").options)


LOST_NODE_LOG = """\
0: [rank 0 host node1] 12:00:01 step 40/800, loss 2.31
ctrain: failure: a rank failed on a live node: node2's launcher exited with 1 first (a rank killed, e.g. out of memory, or an error in the training code)
ctrain: requeueing job 7 once (restart 1); it resumes from the last checkpoint
0: [rank 0 host node1] 12:03:01 resuming from /outputs/demo/checkpoint-200
0: [rank 0 host node1] 12:03:09 ctrain: failure: this is the trainer's text, not the batch script's
ctrain: node1's launcher exited with 1; 10s later node2 had not ended, and node2 does not answer: ending the step
ctrain: step exited with 137
ctrain: failure: node lost: node2 (its launcher never ended and its slurmd does not answer)
ctrain: not requeueing: partition debug has 1 node(s) in service besides node2, the job needs 2
"""


def test_status_events_are_the_last_failure_and_what_was_done_about_it(tmp_path: Path) -> None:
    assert slurm.events(LOST_NODE_LOG) == [
        "failure: node lost: node2 (its launcher never ended and its slurmd does not answer)",
        "not requeueing: partition debug has 1 node(s) in service besides node2, the job needs 2",
    ]
    first_run = LOST_NODE_LOG.split("0: [rank 0 host node1] 12:03:01")[0]
    assert slurm.events(first_run)[1] == "requeueing job 7 once (restart 1); it resumes from the last checkpoint"
    assert slurm.events("ctrain: requeueing job 7 (restart 1); it resumes\n") == [
        "requeueing job 7 (restart 1); it resumes"
    ]
    assert slurm.events("0: [rank 0 host node1] training\nctrain: step exited with 0\n") == []
    (tmp_path / "ctrain-7.out").write_text(LOST_NODE_LOG)
    job = slurm.Job("7", "ctrain", "FAILED")
    assert slurm.Slurm().job_events(job, search=[tmp_path])[0].startswith("failure: node lost: node2")
    assert slurm.Slurm().job_events(slurm.Job("8", "ctrain", "FAILED"), search=[tmp_path]) == []


def test_parse_node_states() -> None:
    assert slurm.parse_node_states("node1 idle\nnode2 down*\n\n") == {"node1": "idle", "node2": "down*"}
    with pytest.raises(ParseError) as err:
        slurm.parse_node_states("sinfo: error: Unable to contact slurm controller (connect failure)\n")
    assert "Unable to contact" in str(err.value)


def test_local_runner_reads_from_an_offset_or_the_end(tmp_path: Path) -> None:
    log = tmp_path / "job-5.out"
    log.write_bytes(b"one\ntwo\nthree\n")
    local = slurm.Local()
    assert local.read(log) == b"one\ntwo\nthree\n"
    assert local.read(log, 4) == b"two\nthree\n"
    assert local.read(log, -6) == b"three\n"
    assert local.read(log, -100) == b"one\ntwo\nthree\n"
    assert local.read(tmp_path / "missing.out") is None


def test_sinfo_node_shapes_are_parsed_and_unequal_groups_take_their_smallest() -> None:
    shapes = slurm.parse_node_shapes("128|1031000|gpu:h100:8(S:0-1)\n96+|512000+|gpu:4\n2|1900|(null)\n")
    assert shapes == [slurm.NodeShape(128, 1031000, 8), slurm.NodeShape(96, 512000, 4), slurm.NodeShape(2, 1900, 0)]
    with pytest.raises(ParseError, match="CPUS|MEMORY|GRES"):
        slurm.parse_node_shapes("lots|of|gpus\n")


NO_CPUS = GPU_CLUSTER.replace("  cpus_per_task: 96\n", "")


def _gpu_job(tmp_path: Path, sinfo: str | None, yaml: str = NO_CPUS, **changes: object) -> submit.Job:
    config = load_config(project(tmp_path, yaml) / "ctrain.yaml")
    client = slurm.Slurm(Sinfo(sinfo)) if sinfo is not None else None
    return submit.prepare(config, recipe="recipes/demo-addition.yaml", nodes=2, client=client, **changes)


def test_a_gpu_job_that_names_no_cpus_gets_whole_nodes_or_its_gpus_share(tmp_path: Path) -> None:
    """One torchrun per node: without --cpus-per-task most sites give it one CPU for every worker."""
    whole = _gpu_job(tmp_path, "128|1031000|gpu:h100:8\n")
    assert "exclusive" in whole.options and whole.options["mem"] == "0" and "cpus-per-task" not in whole.options
    assert "#SBATCH --exclusive" in whole.text and "#SBATCH --mem=0" in whole.text
    assert "--exclusive --mem=0: the job takes all 8 GPUs of each node" in whole.notes[0]
    half = _gpu_job(tmp_path, "128|1031000|gpu:8\n", gpus_per_node=4)
    assert half.options["cpus-per-task"] == "64" and half.options["mem"] == "515500M"
    assert "exclusive" not in half.options and "4 of the 8 GPUs of a node in partition 'gpu'" in half.notes[0]
    # Two kinds of node: the one with fewer CPUs per GPU decides, so the job fits either.
    mixed = _gpu_job(tmp_path, "128|1031000|gpu:8\n64|500000|gpu:8\n", gpus_per_node=2)
    assert mixed.options["cpus-per-task"] == "16"
    # What the user set stays; only the rest is derived.
    mine = _gpu_job(tmp_path, "128|1031000|gpu:8\n", gpus_per_node=4, mem="100G")
    assert mine.options["mem"] == "100G" and mine.options["cpus-per-task"] == "64"
    assert _gpu_job(tmp_path, "128|1031000|gpu:8\n", exclusive=True).options.get("mem") is None
    # No sinfo answer (a laptop's dry run): nothing invented, and the default is named.
    unknown = _gpu_job(tmp_path, None)
    assert "cpus-per-task" not in unknown.options and "exclusive" not in unknown.options
    assert "the site's default applies (often 1 CPU for all 8 workers)" in unknown.notes[0]


def test_too_few_cpus_per_gpu_is_a_warning_and_the_flags_reach_the_script(tmp_path: Path) -> None:
    starved = _gpu_job(tmp_path, "128|1031000|gpu:8\n", cpus_per_task=8)
    assert starved.options["cpus-per-task"] == "8"
    assert any(n.startswith("warning: 1 CPUs per GPU (--cpus-per-task=8 for 8 GPUs per node") for n in starved.notes)
    assert not [n for n in _gpu_job(tmp_path, None, GPU_CLUSTER).notes if n.startswith("warning:")]  # 96 for 8



def test_submit_takes_cpus_memory_and_whole_nodes_as_sbatch_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-c is --cpus-per-task, as for sbatch (--cluster has no short form)."""
    project(tmp_path, NO_CPUS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(submit, "check", lambda job, **_: [])  # the checks need the recipe and a cluster
    result = CliRunner().invoke(main, ["submit", "--dry-run", "--nodes", "2", "-c", "8", "--mem", "200G",
                                       "--exclusive", "recipes/demo-addition.yaml"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    for line in ("#SBATCH --cpus-per-task=8", "#SBATCH --mem=200G", "#SBATCH --exclusive"):
        assert line in result.stdout, line
    result = CliRunner().invoke(main, ["submit", "--dry-run", "-c", "2", "recipes/demo-addition.yaml"])
    assert "warning: 0.25 CPUs per GPU" in result.stderr


def test_pass_env_takes_names_and_prefixes_only(tmp_path: Path) -> None:
    config = load_config(project(tmp_path, "slurm:\n  pass_env: [MY_SETTING, MYLAB_*]\n") / "ctrain.yaml")
    assert config.slurm.pass_env == ["MY_SETTING", "MYLAB_*"]
    assert submit.settings_env(config.slurm, config, tmp_path, "apptainer")["CTRAIN_PASS_ENV"] == "MY_SETTING,MYLAB_*"
    for bad in ("A B", "X;ls", "*", "A*B", "$(id)", "A\nB", "A'B", 'A"B'):
        with pytest.raises(ConfigError, match=r"slurm.pass_env: .* is not a variable name or NAME_\* prefix"):
            load_config(project(tmp_path, f"slurm:\n  pass_env: [{json.dumps(bad)}]\n") / "ctrain.yaml")


# --- a command of the user's own: `ctrain submit ... -- COMMAND` -----------------------------------

COMMAND = ["python", "-u", "run_clm.py", "--model_name_or_path", "models/tiny", "--output_dir", "/outputs/clm",
           "--deepspeed", "configs/zero3.json", "--run_name", "a b's $(run)"]  # fmt: skip


def test_a_command_after_the_dashes_is_the_jobs_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script carries the command word for word (quoted for the shell), the golden file is the
    dry run a user sees, and the rendered script's own dry run starts it under torchrun."""
    from tests.golden_files import assert_golden

    project(tmp_path, GPU_CLUSTER)
    (tmp_path / "run_clm.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checks, "check_image", lambda *_: None)
    monkeypatch.setattr(checks, "check_gpus", lambda *_: [])
    monkeypatch.setattr(checks, "check_partition", lambda *_: None)
    result = CliRunner().invoke(main, ["submit", "--dry-run", "--nodes", "2", "--", *COMMAND])
    assert result.exit_code == 0, result.output
    assert_golden("sbatch", "submit-command-2node.sbatch",
                  golden_text(result.stdout.split("\n", 2)[2].rsplit("CTRAIN_SCRIPT", 1)[0]))  # fmt: skip
    assert f"set -- -- {shlex.join(COMMAND)}\n" in result.stdout
    job = submit.prepare(load_config(tmp_path / "ctrain.yaml"), command=tuple(COMMAND), nodes=2)
    assert job.command == COMMAND
    conf = tmp_path / "slurm.conf"  # enough for `scontrol show hostnames` offline
    conf.write_text("ClusterName=unit\nSlurmctldHost=localhost\nNodeName=gpu[001-002]\nPartitionName=p Nodes=ALL\n")
    allocation = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[001-002]",
                  "SLURM_GPUS_ON_NODE": "8", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_CONF": str(conf),
                  "CTRAIN_DRY_RUN": "1", "PATH": os.environ["PATH"], "HOME": str(tmp_path)}  # fmt: skip
    ran = subprocess.run(["bash", "-c", job.text], env=allocation, capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr
    launched = shlex.split(ran.stdout.split("\n+ srun ", 1)[1])
    assert launched[-len(COMMAND) - 1:] == ["--no-python", *COMMAND]


def test_a_command_is_checked_before_it_is_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project(tmp_path, GPU_CLUSTER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checks, "check_image", lambda *_: None)
    monkeypatch.setattr(checks, "check_gpus", lambda *_: [])
    monkeypatch.setattr(checks, "check_partition", lambda *_: None)
    cases = {
        ("recipes/demo-addition.yaml", "--", "train.py"): "give a recipe or a command after --, not both",
        ("--",): "nothing after --: give the command to run",
        ("--", "train.py", "--note", "two\nlines"): "the command's word 'two\\nlines' ",
        ("--", "python", "-u", "missing.py"): "the command's script missing.py does not exist (paths are relative "
                                              f"to the project directory {tmp_path})",
    }  # fmt: skip
    for words, message in cases.items():
        result = CliRunner().invoke(main, ["submit", "--nodes", "2", *words])
        assert result.exit_code == 2, (words, result.output)
        assert result.stderr.startswith("error: ") and message in result.stderr, (words, result.stderr)
    assert not (tmp_path / "logs").exists()
    for words in (["-m", "mylab.train", "--x"], ["./train.sh"], ["python", "/outputs/gen.py"]):
        job = submit.prepare(load_config(tmp_path / "ctrain.yaml"), command=tuple(words), nodes=2)
        assert submit.check(job) == [], words  # nothing here to look for: a module, a program, a container path


def test_the_preflight_job_runs_the_full_checks_and_never_requeues(tmp_path: Path) -> None:
    """`ctrain preflight`: the rank checks as the job's own command, at full length, no requeue."""
    config = load_config(project(tmp_path, "slurm:\n  preflight: quick\n  max_requeues: 5\n") / "ctrain.yaml")
    job = submit.preflight_job(config, nodes=2)
    assert job.settings["CTRAIN_PREFLIGHT"] == "full" and job.settings["CTRAIN_MAX_REQUEUES"] == "0"
    assert job.arguments == ["--", *submit.PREFLIGHT_COMMAND] and job.options["job-name"] == "preflight"
    assert submit.preflight_job(config, quick=True).settings["CTRAIN_PREFLIGHT"] == "quick"
    assert submit.prepare(config).settings["CTRAIN_PREFLIGHT"] == "quick"  # slurm.preflight reaches a job
    with pytest.raises(ConfigError, match="slurm.preflight"):
        load_config(project(tmp_path, "slurm:\n  preflight: sometimes\n") / "ctrain.yaml")


def test_ctrain_preflight_in_an_allocation_refuses_a_job_id_that_is_not_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(project(tmp_path, "slurm:\n  ntasks_per_node: 1\n"))
    for bad in ("1; reboot", "١٢٣", "12_3"):
        monkeypatch.setenv("SLURM_JOB_ID", bad)
        result = CliRunner().invoke(main, ["preflight", "--image", "docker://x/y:1"])
        assert result.exit_code == 2 and "not a job id: run ctrain preflight inside salloc" in result.output, bad


@pytest.mark.parametrize("bad", ["quick\nfull", "$(reboot)", "'quick'", "quick; reboot"])
def test_slurm_preflight_is_one_of_its_levels(tmp_path: Path, bad: str) -> None:
    text = f"slurm:\n  preflight: {json.dumps(bad)}\n"
    with pytest.raises(ConfigError, match="slurm.preflight"):
        load_config(project(tmp_path, text) / "ctrain.yaml")


# --- the time limit a job runs under ---------------------------------------------------------------

PARTITIONS = slurm.parse_partitions(
    "PartitionName=debug AllowGroups=ALL Default=YES QoS=N/A DefaultTime=04:00:00 DisableRootJobs=NO "
    "MaxNodes=UNLIMITED MaxTime=7-00:00:00 MinNodes=0 Nodes=node[1-2] State=UP\n"
    "PartitionName=gpu Default=NO DefaultTime=NONE MaxTime=2-00:00:00 Nodes=gpu[1-4] State=UP\n"
    "PartitionName=long Default=NO DefaultTime=NONE MaxTime=UNLIMITED Nodes=node[1-2] State=UP\n"
)


def test_partitions_are_read_from_scontrols_records() -> None:
    assert PARTITIONS[0] == slurm.Partition("debug", True, "04:00:00", "7-00:00:00")
    assert [(p.name, p.default) for p in PARTITIONS] == [("debug", True), ("gpu", False), ("long", False)]
    with pytest.raises(ParseError):
        slurm.parse_partitions("Name=x\n")


@pytest.mark.parametrize(("asked", "partition", "partitions", "note", "seconds"), [
    (None, None, PARTITIONS, "time limit 04:00:00: partition debug's DefaultTime (slurm.time or --time asks for "
     "another, up to its MaxTime 7-00:00:00)", 4 * 3600),
    (None, "gpu", PARTITIONS, "time limit 2-00:00:00: partition gpu's MaxTime (it sets no DefaultTime)", 2 * 86400),
    (None, "long", PARTITIONS, "time limit: none (partition long sets no DefaultTime and its MaxTime is UNLIMITED)",
     None),
    ("1-00:00:00", "gpu", PARTITIONS, "time limit 1-00:00:00 (slurm.time), within partition gpu's MaxTime 2-00:00:00",
     86400),
    ("30-00:00:00", "long", PARTITIONS, "time limit 30-00:00:00 (slurm.time), within partition long's MaxTime UNLIMITED",
     30 * 86400),
    (None, None, None, "time limit: the partition's default, as Slurm applies it (no Slurm here to read it from)", None),
    ("10", None, None, "time limit 10 (slurm.time)", 600),
])  # fmt: skip
def test_the_time_limit_a_job_gets_and_where_it_comes_from(asked, partition, partitions, note, seconds) -> None:  # type: ignore[no-untyped-def]
    assert checks.time_limit(asked, partition, partitions) == (note, seconds)


def _paced(output: Path, steps: int, seconds_per_step: float) -> None:
    """An earlier run's metrics in OUTPUT: a record every 10 steps up to STEPS, SECONDS_PER_STEP apart,
    after an older run's records at another pace."""
    output.mkdir(parents=True)
    lines = [{"run": "old", "step": s, "time": 1000.0 + s * 99, "loss": 1.0} for s in (10, 20)]
    lines += [{"run": "new", "step": s, "time": 5000.0 + s * seconds_per_step, "loss": 1.0} for s in range(10, steps + 1, 10)]
    lines.append({"run": "new", "step": steps, "time": 9e9, "eval_loss": 1.0})  # an eval record: no pace
    (output / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize(("max_steps", "limit", "requeues", "said"), [
    (10_000, 3600, "10", "note"),  # 9,000 steps x 6 s = 15 h under 1 h: 14 requeues, more than 10
    (10_000, 3600, "20", "note"),
    (1_500, 3600, "10", None),  # 500 steps x 6 s = 50 min: one run
    (10_000, None, "10", None),  # no limit: nothing to say
])  # fmt: skip
def test_the_requeues_a_resumed_run_needs_against_its_time_limit(tmp_path: Path, max_steps: int, limit: int | None,
                                                                  requeues: str, said: str | None) -> None:  # fmt: skip
    from ctrain.jobs.job import Job

    _paced(tmp_path / "out", 1_000, 6.0)
    job = Job(tmp_path / "sbatch" / "apptainer.sbatch", "apptainer", "", tmp_path, {"CTRAIN_MAX_REQUEUES": requeues},
              [], output_dir=tmp_path / "out", limit_seconds=limit)  # fmt: skip
    warnings = checks.requeues_needed(job, max_steps)
    told = warnings + [n for n in job.notes if "requeue" in n]
    if said is None:
        assert told == []
        return
    (line,) = told
    assert line.startswith("the run has about 15h00m00s to go (9000 steps at 6 s a step, as its last run in ")
    assert "its time limit is 1h00m00s: it needs at least 14 requeue(s)" in line
    if requeues == "10":
        assert warnings == [line] and "more than slurm.max_requeues (10) allows, so it would stop short" in line
    else:
        assert warnings == [] and line.endswith("within slurm.max_requeues (20)")


def test_a_run_never_trained_gets_no_estimate(tmp_path: Path) -> None:
    from ctrain.jobs.job import Job

    job = Job(tmp_path / "s.sbatch", "apptainer", "", tmp_path, {}, [], output_dir=tmp_path / "new", limit_seconds=60)
    assert checks.requeues_needed(job, 10_000) == [] and job.notes == []


@pytest.mark.parametrize(("asked", "partition", "error"), [
    ("3-00:00:00", "gpu", "time limit 3-00:00:00 (slurm.time, --time) is longer than partition gpu's MaxTime "
     "2-00:00:00: ask for at most 2-00:00:00"),
    ("UNLIMITED", None, "time limit UNLIMITED (slurm.time, --time) is longer than partition debug's MaxTime 7-00:00:00"),
    (None, "gpus", "partition 'gpus' does not exist here (did you mean 'gpu'?); the partitions: debug (default), gpu, "
     "long (slurm.partition, --partition)"),
])  # fmt: skip
def test_a_partition_that_is_not_there_or_a_limit_above_its_maximum_is_refused(asked, partition, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as caught:
        checks.time_limit(asked, partition, PARTITIONS)
    assert str(caught.value).startswith(error)


def test_no_script_of_ctrains_sets_a_time_limit() -> None:
    """With no slurm.time the partition's DefaultTime applies, not a limit the scripts invent."""
    for script in (REPO / "sbatch").glob("*.sbatch"):
        assert not [line for line in script.read_text().splitlines() if re.match(r"#SBATCH\s+(--time|-t)\b", line)], script


def test_the_images_driver_floor_reaches_the_script_for_the_node_checks(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An image that states the oldest driver its CUDA runs on: the script's settings carry it to every
    node's checks; one that states none (a CPU build, an image not ctrain's) leaves them unchecked."""
    config = load_config(project(tmp_path, "slurm:\n  nodes: 2\n") / "ctrain.yaml")
    monkeypatch.setattr(submit, "image_facts", lambda *_: {"cuda": "13.0", "min_driver": "580.65.06"})
    job = submit.prepare(config, nodes=2)
    assert job.settings["CTRAIN_IMAGE_MIN_DRIVER"] == "580.65.06"
    assert re.search(r"^(export )?CTRAIN_IMAGE_MIN_DRIVER=.?580\.65\.06", job.text, re.MULTILINE), job.text[:3000]
    assert job.image_stated == {"cuda": "13.0", "min_driver": "580.65.06"}
    monkeypatch.setattr(submit, "image_facts", lambda *_: None)
    job = submit.prepare(config, nodes=2)
    assert job.settings["CTRAIN_IMAGE_MIN_DRIVER"] == "" and not re.search(r"^(export )?CTRAIN_IMAGE_MIN_DRIVER=", job.text,
                                                                            re.MULTILINE)  # fmt: skip
