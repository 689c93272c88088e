"""A job about to be queued (:class:`Job`: the rendered script, its final ``#SBATCH`` options, its
settings) and its sizing as sbatch reads it: the world size, the GPUs per node however they are
asked for, and the CPUs and memory a GPU job that names none gets (:func:`gpu_resources`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrain import protocol, slurm
from ctrain.errors import ConfigError
from ctrain.files import shorten
from ctrain.jobs.options import sbatch_options
from ctrain.jobvalues import CPU_OPTIONS, MEMORY_OPTIONS, gres_gpus
from ctrain.slurmconfig import OPTIONS, SlurmConfig


@dataclass
class Job:
    """A job about to be submitted: the rendered script and where and how it is queued."""

    template: Path  # the script in sbatch/
    runtime: str  # apptainer | pyxis, from the script's ctrain_main line
    text: str  # the rendered, self-contained script
    project: Path  # submit directory: /workspace in the container, logs/ and outputs/ here
    settings: dict[str, str]  # CTRAIN_* as the script resolves them (defaults included)
    arguments: list[str]  # recipe and KEY=VALUE overrides, or "--" and a command of the user's own
    options: dict[str, str | None] = field(default_factory=dict)  # final #SBATCH options
    notes: list[str] = field(default_factory=list)  # what ctrain chose for the user (resources), said once
    overrides: list[str] = field(default_factory=list)  # the recipe's KEY=VALUE overrides, as the library took them
    needs: list[str] = field(default_factory=list)  # hub names declared (ctrain.yaml's fetch:, --fetch)
    output_dir: Path | None = None  # the recipe's output directory on this machine, once checked (None: unknown)
    limit_seconds: int | None = None  # the time limit the job runs under, once checked (None: none or unknown)
    image_stated: dict[str, object] | None = None  # what the image says it is ({}: nothing); None: not read yet
    sweep: list[Any] | None = None  # a sweep's tasks (ctrain.jobs.sweep.Task), one job array; None: one job
    sweep_outputs: dict[int, Path] = field(default_factory=dict)  # each recipe task's output directory here

    def sweep_record(self) -> list[dict[str, object]] | None:
        """The sweep's tasks as the project's history keeps them (ctrain jobs, ctrain results)."""
        if not self.sweep:
            return None
        return [{"task": t.index, "name": t.name, "values": t.values,
                 "output": str(self.sweep_outputs[t.index]) if t.index in self.sweep_outputs else None}
                for t in self.sweep]  # fmt: skip

    def describe(self) -> str:
        """The sbatch command and the script, as --dry-run prints them (a shell here-document)."""
        command = shlex.join(slurm.sbatch_command([]))
        shown = f"# in {self.project}:\n{command} <<'CTRAIN_SCRIPT'\n{self.text}CTRAIN_SCRIPT\n"
        if self.sweep:
            from ctrain.jobs.sweep import describe

            shown += "".join(f"# {line}\n" for line in describe(self.sweep).splitlines())
        return shown

    @property
    def command(self) -> list[str] | None:
        """The user's own command (``ctrain submit ... -- COMMAND``), None for a recipe."""
        return self.arguments[1:] if self.arguments[:1] == ["--"] else None

    @property
    def world_size(self) -> int:
        """Training processes: nodes x (GPUs per node, however asked: :func:`node_gpus`, else tasks per node), as
        the scripts derive it (SLURM_GPUS_ON_NODE). A ConfigError for a node range (2-4): Slurm picks the count,
        so no one number of processes can be checked (the batch size must divide among them)."""
        nodes = self.options.get("nodes") or "1"
        match = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", nodes)
        if not match:
            raise ConfigError(f"--nodes={shorten(nodes)} is not a number of nodes (4): fix it where it is set "
                              "(slurm.sbatch_args, the #SBATCH lines of the script)")  # fmt: skip
        if match[2] is not None and int(match[2]) != int(match[1]):
            raise ConfigError(
                f"--nodes={nodes} is a range: the recipe is checked for one number of processes, and a range "
                "leaves it to Slurm: give one node count (slurm.nodes, --nodes)"
            )
        tasks = option_count(self.options, "ntasks-per-node") or 1
        return protocol.world_size(int(match[1]), node_gpus(self.options) or 0, tasks)

    @property
    def log_dir(self) -> Path:
        output = self.options.get("output") or "slurm-%j.out"
        return self.project / Path(output).parent


def option_count(options: dict[str, str | None], option: str) -> int | None:
    """The number an #SBATCH option's value says (gpus-per-node's TYPE:COUNT too), None when it is not
    set; a ConfigError naming it otherwise (a value from sbatch_args or the script's own header)."""
    value = options.get(option)
    if value is None:
        return None
    number = value.rsplit(":", 1)[-1] if option in ("gpus-per-node", "gpus") else value
    if not re.fullmatch(r"[0-9]{1,9}", number):
        example = "8 or h100:8" if option in ("gpus-per-node", "gpus") else "4"
        raise ConfigError(f"--{option}={shorten(value)} is not a number ({example}): fix it where it is set "
                          "(slurm.sbatch_args, the #SBATCH lines of the script)")  # fmt: skip
    return int(number)


def node_gpus(options: dict[str, str | None]) -> int | None:
    """GPUs per node the options ask for, in any of sbatch's ways: --gpus-per-node=[TYPE:]N, else --gres=gpu[:TYPE]:N
    (beside other resources), else --gpus=[TYPE:]N, a job's total, divided among its nodes; None when none does.
    A ConfigError for a total that does not divide among the nodes (each node runs one process per GPU)."""
    if options.get("gpus-per-node") is not None:
        return option_count(options, "gpus-per-node")
    if options.get("gres") is not None:
        found = gres_gpus(options["gres"] or "")
        if found is not None:
            return found
    total = option_count(options, "gpus")
    if total is None:
        return None
    nodes = options.get("nodes") or "1"
    match = re.fullmatch(r"([0-9]{1,9})(?:-\1)?", nodes)
    if not match or total % int(match[1]):
        raise ConfigError(
            f"--gpus={options['gpus']} is the job's total, which must divide evenly among --nodes={nodes} (each node "
            "runs one process per GPU): ask per node instead, slurm.gpus_per_node (--gpus-per-node)"
        )
    return total // int(match[1])


#: Fewer CPUs than this per GPU starve a GPU job's data loaders and launcher: a warning.
MIN_CPUS_PER_GPU = 4


def gpu_resources(c: SlurmConfig, shapes: list[slurm.NodeShape] | None,
                  options: dict[str, str | None] | None = None) -> tuple[dict[str, object], list[str]]:  # fmt: skip
    """CPUs and memory for a GPU job that names neither (``slurm:`` changes), and notes saying so.

    A GPU job runs one task per node (torchrun), and most sites give a task one CPU (or
    DefCpuPerGPU's worth) unless it asks: eight workers would share it. A job that takes every
    GPU of its nodes takes the whole nodes (``--exclusive``, ``--mem=0``: all their memory);
    one that takes some gets the same share of the node's CPUs and memory as of its GPUs. The
    node is the partition's kind with the fewest CPUs per GPU among those with enough GPUs.
    ``options``: the #SBATCH options before this (the script's and sbatch_args'), which may ask for
    the GPUs (--gres), the CPUs (--cpus-per-gpu) or the memory (--mem-per-gpu) another way: sbatch
    refuses a second option for the CPUs or the memory, so what they set stays the only one.
    """
    options = options if options is not None else dict(sbatch_options(c))
    gpus = node_gpus(options) or 0
    if not gpus or c.exclusive or "exclusive" in options:
        return {}, []
    cpus_set = c.cpus_per_task is not None or any(options.get(o) is not None for o in CPU_OPTIONS)
    mem_set = c.mem is not None or any(options.get(o) is not None for o in MEMORY_OPTIONS)
    fitting = [shape for shape in shapes or [] if shape.gpus >= gpus]
    if not fitting:
        if cpus_set:
            return {}, []
        return {}, [
            f"{gpus} GPUs per node and no CPUs asked for, and sinfo does not say what the nodes have: the site's "
            f"default applies (often 1 CPU for all {gpus} workers); set slurm.cpus_per_task, --cpus-per-task or "
            "--exclusive"
        ]
    node = min(fitting, key=lambda shape: (shape.cpus // shape.gpus, shape.memory_mb // shape.gpus))
    where = f"partition '{c.partition}'" if c.partition else "the cluster"
    if gpus == node.gpus and not cpus_set and not mem_set:
        return {"exclusive": True, "mem": "0"}, [
            f"--exclusive --mem=0: the job takes all {gpus} GPUs of each node, so it takes the whole nodes "
            f"({node.cpus} CPUs, {node.memory_mb // 1024} GiB each in {where}); set slurm.cpus_per_task or "
            "slurm.mem to ask for less"
        ]
    changes: dict[str, object] = {}
    if not cpus_set:
        changes["cpus_per_task"] = max(1, node.cpus // node.gpus * gpus)
    if not mem_set:
        changes["mem"] = f"{node.memory_mb // node.gpus * gpus}M"
    if not changes:
        return {}, []
    said = " ".join(f"--{OPTIONS[k]}={v}" for k, v in changes.items())
    return changes, [
        f"{said}: {gpus} of the {node.gpus} GPUs of a node in {where} ({node.cpus} CPUs, "
        f"{node.memory_mb // 1024} GiB), and the same share of its CPUs and memory; set slurm.cpus_per_task "
        "or slurm.mem to choose"
    ]


def cpus_per_gpu(options: dict[str, str | None]) -> float | None:
    """CPUs per GPU of the final options (--cpus-per-gpu, else --cpus-per-task over the GPUs of the node's one
    task); None when they do not say (no GPUs, no CPUs, whole nodes)."""
    if "exclusive" in options:
        return None
    per_gpu = option_count(options, "cpus-per-gpu")
    count = node_gpus(options)
    if not count:
        return None
    if per_gpu is not None:
        return per_gpu
    cpus = options.get("cpus-per-task")
    return int(cpus) / count if cpus and re.fullmatch(r"[0-9]{1,9}", cpus) else None


def cpu_warning(options: dict[str, str | None]) -> str | None:
    """A warning when the final options give a GPU fewer than :data:`MIN_CPUS_PER_GPU` CPUs, else None."""
    per_gpu = cpus_per_gpu(options)
    if per_gpu is None or per_gpu >= MIN_CPUS_PER_GPU:
        return None
    said = (f"--cpus-per-gpu={options['cpus-per-gpu']}" if options.get("cpus-per-gpu") is not None else
            f"--cpus-per-task={options['cpus-per-task']} for {node_gpus(options)} GPUs per node, one task per "
            "node")  # fmt: skip
    return (f"warning: {per_gpu:g} CPUs per GPU ({said}): data loading and the launcher will "
            f"starve the GPUs; ask for at least {MIN_CPUS_PER_GPU} per GPU or --exclusive")  # fmt: skip
