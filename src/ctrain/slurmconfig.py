"""The ``slurm:`` section of ``ctrain.yaml``: how ``ctrain submit`` runs training through the scripts in
``sbatch/`` (docs/sbatch.md). Each field declares what it is to a job (:class:`ctrain.jobvalues.Setting`:
its sbatch option, its ``CTRAIN_*`` variable, whether it reaches the job's shell, its flags), and the
``#SBATCH`` lines, the settings block, the checks and the flags of submit and preflight come from
that one declaration: adding an sbatch option is adding a field.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union, get_args, get_origin, get_type_hints

from ctrain.errors import ConfigError
from ctrain.files import control_problem, name_problem, shorten
from ctrain.jobvalues import (BOTH, COUNT, CPU_OPTIONS, ENV_NAME, MEMORY, MEMORY_OPTIONS, MOUNT, PASS_ENV, SETTING,
                              SIZE, Setting, directive_problem, env_name_problem, option_value_problem, sbatch_arg,
                              secret_name, setting, short_option_problem)  # fmt: skip
from ctrain.slurm import time_seconds

SUBMIT = ("submit",)
_NAME = r"[A-Za-z0-9_.-]+"
_JOB = r"[0-9]{1,12}(?:_[0-9]{1,9})?(?:\+[0-9]{1,9})?"  # a job (an array task), +MINUTES after it
_AFTER = rf"(?:singleton|(?:after|afterany|afterburstbuffer|aftercorr|afternotok|afterok):{_JOB}(?::{_JOB})*)"
# sbatch --mail-type's events (sbatch(1)).
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")  # fmt: skip
_MAIL_TYPE = "(?:{0})(?:,(?:{0}))*".format("|".join(sorted(MAIL_TYPES, key=len, reverse=True)))
_MAIL_USER = r"[A-Za-z0-9_.+%-]+(?:@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)?"


@dataclass
class SlurmConfig:
    """How ``ctrain submit`` runs training through the scripts in ``sbatch/`` (docs/sbatch.md).

    Unset values keep the script's own defaults, so ``sbatch sbatch/NAME.sbatch`` and ``ctrain submit``
    agree; set values become ``#SBATCH`` lines and ``CTRAIN_*`` variables of the submitted script.
    """

    runtime: Literal["apptainer", "pyxis"] = setting("apptainer", flags=BOTH,
                                                     help="Container runtime (default: slurm.runtime).")  # fmt: skip
    script: str | None = setting(shell=True, flags=SUBMIT, help="Script in sbatch/ (apptainer, apptainer_multinode, "
                                 "pyxis, pyxis_multinode) or a path (default: slurm.script, else RUNTIME for 1 node, "
                                 "RUNTIME_multinode for more).")  # fmt: skip
    recipe: Path | None = setting(shell=True, help="The recipe when the command line names none.")
    # sbatch options
    job_name: str | None = setting(sbatch="job-name", spaced=True, flags=SUBMIT,
                                   help="Job name (names the log: logs/NAME-JOBID.out).")  # fmt: skip
    partition: str | None = setting(sbatch="partition", help="Partition (queue).")
    account: str | None = setting(sbatch="account", help="Account to charge.")
    qos: str | None = setting(sbatch="qos", pattern=f"{_NAME}(?:,{_NAME})*", what="a QOS name (high)",
                              help="Quality of service (sacctmgr show qos lists them).")  # fmt: skip
    time: str | None = setting(sbatch="time", help="Time limit, e.g. 04:00:00 or 2-00:00:00.")
    nodes: int | None = setting(sbatch="nodes", least=1, pattern=rf"{COUNT}(?:-{COUNT})?",
                                what="a number of nodes (4) or a range (2-4)", help="Number of nodes.")  # fmt: skip
    gpus_per_node: int | None = setting(sbatch="gpus-per-node", least=0, zero_is_unset=True,
                                        pattern=rf"(?:[A-Za-z0-9_.-]+:)?{COUNT}",
                                        what="a number of GPUs, or TYPE:NUMBER (h100:8)",
                                        help="GPUs per node; one training process each.")  # fmt: skip
    ntasks_per_node: int | None = setting(sbatch="ntasks-per-node", least=1, pattern=COUNT, what="a number of tasks",
                                          help="Processes per node on nodes without GPUs.")  # fmt: skip
    cpus_per_task: int | None = setting(sbatch="cpus-per-task", least=1, pattern=COUNT, what="a number of CPUs",
                                        help="CPUs of each node's task (one per node with GPUs; default for GPU jobs: "
                                        "the GPUs' share of the node's CPUs, whole nodes when the job takes all "
                                        "their GPUs).")  # fmt: skip
    mem: str | None = setting(sbatch="mem", pattern=MEMORY, what=f"{SIZE} (500G; 0: all of a node's memory)",
                              help="Memory per node, e.g. 500G (0: all of it; default for GPU jobs: the GPUs' "
                              "share).")  # fmt: skip
    exclusive: bool = setting(False, sbatch="exclusive", help="Whole nodes: every CPU, no other job beside it.")
    constraint: str | None = setting(sbatch="constraint", spaced=True,
                                     help="Node features the job needs, e.g. h100 or 'a100|h100'.")  # fmt: skip
    # seconds before the time limit that USR1 warns the job
    signal_lead: int | None = setting(sbatch="signal", form="B:USR1@{}", least=0, most=65535, flags=(),
                                      help="Seconds before the time limit that USR1 warns the job.")  # fmt: skip
    dependency: str | None = setting(sbatch="dependency", pattern=f"{_AFTER}(?:,{_AFTER})*|{_AFTER}(?:[?]{_AFTER})+",
                                     extra="?", what="TYPE:JOBID[:JOBID...] (afterok:123) or singleton, several "
                                     "joined by , (all) or ? (any)",
                                     help="Start after other jobs, e.g. afterok:123 or singleton.")  # fmt: skip
    exclude: str | None = setting(sbatch="exclude", pattern=r"[A-Za-z0-9_.,/\[\]-]+",
                                  what="a list of nodes (node[01-04],gpu7), or a file that lists them",
                                  help="Nodes the job must not run on, e.g. node[01-04],gpu7.")  # fmt: skip
    reservation: str | None = setting(sbatch="reservation", pattern=f"{_NAME}(?:,{_NAME})*",
                                      what="a reservation's name (maint), or several joined by ,",
                                      help="Run in this reservation (scontrol show reservation).")  # fmt: skip
    mail_type: str | None = setting(sbatch="mail-type", pattern=_MAIL_TYPE, ignore_case=True,
                                    what=f"events joined by , from {', '.join(MAIL_TYPES)}",
                                    help="Mail when the job reaches these events, e.g. END,FAIL.")  # fmt: skip
    mail_user: str | None = setting(sbatch="mail-user", pattern=_MAIL_USER,
                                    what="a mail address or user name (me@lab.org)",
                                    help="Who gets the mail of --mail-type (default: you).")  # fmt: skip
    sbatch_args: list[str] = setting(factory=list, help="Further sbatch options (--qos=high).")
    # CTRAIN_* settings of the scripts
    image: str | None = setting(variable="CTRAIN_IMAGE", shell=True, flags=BOTH,
                                help="Image: a .sif/.sqsh path, or a registry reference (pyxis).")  # fmt: skip
    launcher: Literal["torchrun", "accelerate", "deepspeed"] | None = setting(
        variable="CTRAIN_LAUNCHER", flags=SUBMIT, help="Launcher (default: torchrun).")  # fmt: skip
    deepspeed_config: Path | None = setting(variable="CTRAIN_DEEPSPEED_CONFIG", place="project", shell=True)
    accelerate_config: Path | None = setting(variable="CTRAIN_ACCELERATE_CONFIG", place="project", shell=True)
    data: Path | None = setting(variable="CTRAIN_DATA", place="host", shell=True)
    hf_cache: Path | None = setting(variable="CTRAIN_HF_CACHE", place="host", shell=True)
    outputs: Path | None = setting(variable="CTRAIN_OUTPUTS", place="host", shell=True)
    mounts: list[str] = setting(factory=list, variable="CTRAIN_MOUNTS", place="host", shell=True)
    mount_home: bool | None = setting(variable="CTRAIN_MOUNT_HOME")
    efa: bool | None = setting(variable="CTRAIN_EFA")
    # false: the nodes reach the hub (a cloud cluster with a NAT): no check of the cache, the hub online
    hf_offline: bool | None = setting(variable="CTRAIN_HF_OFFLINE")
    max_requeues: int | None = setting(variable="CTRAIN_MAX_REQUEUES", least=0)
    # a lost node's run goes on at once as a new job on the healthy nodes (false: the job is requeued,
    # and waits for Slurm to let go of the lost node)
    continue_on_node_loss: bool | None = setting(variable="CTRAIN_CONTINUE")
    # seconds without a finished step before the job's watchdog ends it
    hang_timeout: int | None = setting(variable="CTRAIN_HANG_TIMEOUT", least=0)
    # seconds without a finished step before every node is asked (0: never)
    node_check: int | None = setting(variable="CTRAIN_NODE_CHECK", least=0)
    # the checks before each run's first step
    preflight: Literal["off", "quick", "full"] | None = setting(variable="CTRAIN_PREFLIGHT")
    # Variables of the job (exported in the settings block), which CTRAIN_CONTAINER_ENV names.
    env: dict[str, str] = setting(factory=dict, variable="CTRAIN_CONTAINER_ENV")
    # More host variables the container gets (names, or NAME_* prefixes), beyond those a job needs
    # (the sbatch library's CTRAIN_PASSED_ENV); others, PYTHONPATH and conda's among them, stay out.
    pass_env: list[str] = setting(factory=list, variable="CTRAIN_PASS_ENV")

    def validate(self) -> None:
        """Relations between settings that are wrong before anything is run."""
        check_options(self)
        check_shell(self)
        check_numbers(self)
        if self.gpus_per_node and self.ntasks_per_node:
            raise ConfigError(
                "slurm.gpus_per_node and slurm.ntasks_per_node are both set: with GPUs the scripts start one "
                "process per GPU, so leave ntasks_per_node (processes per node on CPU-only nodes) unset"
            )
        check_env(self)
        check_sbatch_args(self)


def settings() -> dict[str, Setting]:
    """Each SlurmConfig field's declaration, in the order of the fields."""
    return {f.name: f.metadata[SETTING] for f in dataclasses.fields(SlurmConfig)}


def value_type(name: str) -> type:
    """The type of a SlurmConfig field's values (its annotation without None; a Literal as it is)."""
    hint = get_type_hints(SlurmConfig)[name]
    if get_origin(hint) in (Union, types.UnionType):
        args = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


SETTINGS = settings()
# sbatch options ctrain.yaml can set (field -> option); those whose value is text (an #SBATCH line's, checked
# as sbatch reads it); the settings block's variables (field -> CTRAIN_*).
OPTIONS = {name: s.sbatch for name, s in SETTINGS.items() if s.sbatch}
DIRECTIVE_FIELDS = {name: option for name, option in OPTIONS.items() if value_type(name) is str}
VARIABLES = {name: s.variable for name, s in SETTINGS.items() if s.variable}


def check_options(c: SlurmConfig) -> None:
    """Each option's text as an #SBATCH line holds it, and as sbatch reads it; the time limit as Slurm reads it."""
    for name, option in DIRECTIVE_FIELDS.items():
        value = getattr(c, name)
        problem = None if value is None else directive_problem(value, option) or option_value_problem(option, value)
        if problem:
            raise ConfigError(f"slurm.{name} (--{option}) {shorten(value)!r} {problem}")
    if c.time:
        try:
            time_seconds(c.time)
        except ConfigError as exc:
            raise ConfigError(f"slurm.{exc}") from None
    if c.job_name is not None:
        problem = name_problem(c.job_name)
        if problem:
            raise ConfigError(f"the job name (slurm.job_name, --job-name) {shorten(c.job_name)!r} {problem}: it "
                              "names the job's log, logs/NAME-JOBID.out")  # fmt: skip


def check_shell(c: SlurmConfig) -> None:
    """Paths and words that reach the job script as quoted shell (exports, arguments): any text but control
    characters, which no file name needs and which would make the script lie when shown; a mounted directory
    without the mount lists' separators."""
    for name, declared in SETTINGS.items():
        value = getattr(c, name)
        if not declared.shell or value is None:
            continue
        items = [(f"{name}[{i}]", item) for i, item in enumerate(value)] if isinstance(value, list) else [(name, value)]
        for key, item in items:
            problem = control_problem(str(item))
            if problem:
                raise ConfigError(f"slurm.{key} {shorten(str(item))!r} {problem}")
    for name, declared in SETTINGS.items():
        value = getattr(c, name)
        if declared.place == "host" and isinstance(value, Path) and ("," in str(value) or ":" in str(value)):
            raise ConfigError(
                f"slurm.{name} {shorten(str(value))!r} contains ',' or ':', which separate the container's mounts: "
                "use a path without them (a symbolic link to it will do)"
            )
    for mount in c.mounts:
        if not MOUNT.fullmatch(mount):
            raise ConfigError(f"slurm.mounts entry {mount!r} must look like /host/dir:/container/dir[:ro]")


def check_numbers(c: SlurmConfig) -> None:
    for name, declared in SETTINGS.items():
        value = getattr(c, name)
        if value is None or isinstance(value, bool) or not isinstance(value, int):
            continue
        if declared.least is not None and value < declared.least:
            raise ConfigError(f"slurm.{name} must be at least {declared.least}, got {value}", key=f"slurm.{name}")
        if declared.most is not None and value > declared.most:
            raise ConfigError(f"slurm.{name} is {value}; Slurm allows at most {declared.most}", key=f"slurm.{name}")


def check_env(c: SlurmConfig) -> None:
    """slurm.env: variable names that run no code and hold no secret, values on one line; slurm.pass_env: names."""
    for name in c.env:
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"slurm.env: {shorten(name)!r} is not an environment variable name")
        problem = env_name_problem(name)
        if problem:
            raise ConfigError(f"slurm.env: {name} {problem}: it would run code of its own in the job and in ctrain; "
                              "remove it")  # fmt: skip
        if secret_name(name):
            raise ConfigError(
                f"slurm.env: {name} looks like a secret; ctrain writes these values into the job script and its "
                "copy in logs/. Export it in your shell instead and name it in slurm.pass_env (sbatch passes your "
                "environment to the job; the container gets what the job needs and what pass_env names), or "
                "log in once (`huggingface-cli login` stores the token in the mounted HF cache)"
            )
    for name in c.pass_env:
        if not PASS_ENV.fullmatch(name):
            raise ConfigError(f"slurm.pass_env: {shorten(name)!r} is not a variable name or NAME_* prefix "
                              "(e.g. MY_SETTING, MYLAB_*)")  # fmt: skip
    for name, value in c.env.items():
        problem = control_problem(value)
        if problem:
            raise ConfigError(f"slurm.env: the value of {name} {problem}: write it on one line")


def check_sbatch_args(c: SlurmConfig) -> None:
    """Each entry a long option whose value an #SBATCH line holds and sbatch takes; one option of each group
    that sizes memory and CPUs, with the settings."""
    given = {"mem": c.mem is not None, "cpus-per-task": c.cpus_per_task is not None}
    for arg in c.sbatch_args:
        parsed = sbatch_arg(arg)
        if not parsed:
            raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r} must be an sbatch option like --qos=high")
        problem = short_option_problem(arg)
        if problem:
            raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r} {problem}")
        option, value = parsed
        if option == "array":
            raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: an array of one recipe trains it that many "
                              "times into one output directory; a sweep is `ctrain submit RECIPE --sweep KEY=V1,V2` "
                              "(each task its own values and output directory, --max-parallel N)")  # fmt: skip
        problem = None if value is None else directive_problem(value, option)
        if problem:
            raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: its value {problem}")
        problem = option_value_problem(option, value)
        if problem:
            raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: --{option} {problem}")
        if option == "time" and value:
            try:
                time_seconds(value)
            except ConfigError as exc:
                raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: {exc}") from None
        given[option] = True
    for group in (MEMORY_OPTIONS, CPU_OPTIONS):
        both = [f"--{option}" for option in group if given.get(option)]
        if len(both) > 1:
            choices = ", ".join(f"--{option}" for option in group)
            raise ConfigError(
                f"slurm: {' and '.join(both)} are both set (slurm.{group[0].replace('-', '_')}, the command line "
                f"or slurm.sbatch_args), and sbatch takes only one of {choices}: keep one"
            )
