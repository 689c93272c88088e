"""``ctrain submit``: one of the scripts in ``sbatch/``, with the project's settings, rendered into a
self-contained job script, checked, and queued.

The rendered script is the chosen script with its ``#SBATCH`` lines updated from ctrain.yaml and
the command line, a settings block (``CTRAIN_*`` exports and the recipe arguments), and the
library it sources inlined, so what runs does not change when the checkout does (a requeued job
runs the same text). ``--dry-run`` prints exactly that text and the sbatch command; a submitted
job's copy is kept as ``logs/NAME-JOBID.sbatch`` beside its log.

Settings the scripts default themselves are resolved by the script library itself (bash), so
Python never restates a default.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ctrain import install_hint, proc, resources, slurm
from ctrain.config import (CPU_OPTIONS, MEMORY_OPTIONS, ProjectConfig, SlurmConfig, env_name_problem, gres_gpus,
                           sbatch_arg)  # fmt: skip
from ctrain.errors import ConfigError, CtrainError
from ctrain.files import atomic_write_text, control_problem, read_text_bounded, shorten
from ctrain.image import reference
from ctrain.jobs.library import (LIB, MAX_SCRIPT_BYTES, SOURCE_LINE, assemble, library_notes,  # noqa: F401
                                 library_version, read_script)  # fmt: skip
from ctrain.settings import override

if TYPE_CHECKING:
    from ctrain.train.recipe import Recipe

# A line only scripts `ctrain submit` rendered hold: the one kind of file --write-script may replace.
RENDERED_MARK = "# --- settings from ctrain.yaml and the command line (ctrain submit) ---"
_MAIN_LINE = re.compile(r"^ctrain_main (\w+) \"\$@\"$", re.MULTILINE)

# sbatch options ctrain.yaml can set (field -> option); short forms users write in their own scripts.
OPTIONS = {
    "job_name": "job-name",
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "time": "time",
    "nodes": "nodes",
    "gpus_per_node": "gpus-per-node",
    "ntasks_per_node": "ntasks-per-node",
    "cpus_per_task": "cpus-per-task",
    "mem": "mem",
    "exclusive": "exclusive",
    "constraint": "constraint",
    "signal_lead": "signal",
}
_SHORT = {"J": "job-name", "p": "partition", "A": "account", "q": "qos", "t": "time", "N": "nodes",
          "c": "cpus-per-task", "C": "constraint", "o": "output", "e": "error"}  # fmt: skip
_SBATCH_LINE = re.compile(r'^#SBATCH\s+(-{1,2})([A-Za-z][\w-]*)(?:[=\s]\s*("[^"\n]*"|\S+))?')


# Container image references.
_URI_SCHEMES = (
    "docker://",
    "oras://",
    "library://",
    "shub://",
    "http://",
    "https://",
    "docker-archive:",
    "oci-archive:",
)
IMAGE_SUFFIXES = (".sif", ".sqsh", ".squashfs")


# --- settings checks (also run when ctrain.yaml is loaded) -----------------------------------------


# --- the job --------------------------------------------------------------------------------------


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

    def describe(self) -> str:
        """The sbatch command and the script, as --dry-run prints them (a shell here-document)."""
        command = shlex.join(slurm.sbatch_command([]))
        return f"# in {self.project}:\n{command} <<'CTRAIN_SCRIPT'\n{self.text}CTRAIN_SCRIPT\n"

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
        gpus = node_gpus(self.options)
        return int(match[1]) * (gpus or option_count(self.options, "ntasks-per-node") or 1)

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


def scripts_dir(project: Path) -> Path:
    """``sbatch/`` of the project (``ctrain init`` copies it there), else the one ctrain ships."""
    if (project / LIB).is_file():
        return project / "sbatch"
    return resources.path("sbatch")


def choose_script(c: SlurmConfig, project: Path, nodes: int | None) -> Path:
    """The script named by the config/command line, else RUNTIME (1 node) or RUNTIME_multinode."""
    name = c.script or (c.runtime if (nodes or 1) == 1 else f"{c.runtime}_multinode")
    if "/" in name or name.endswith(".sbatch"):
        path = Path(name) if Path(name).is_absolute() else project / name
    else:
        path = scripts_dir(project) / f"{name}.sbatch"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.sbatch")) if path.parent.is_dir() else []
        raise ConfigError(f"no sbatch script {path}" + (f"; available: {', '.join(known)}" if known else ""))
    return path


def _option_value(c: SlurmConfig, name: str) -> str | None:
    value = getattr(c, name)
    if name == "signal_lead":
        return f"B:USR1@{value}"
    if name == "exclusive":
        return None
    return str(value)


def sbatch_options(c: SlurmConfig) -> list[tuple[str, str | None]]:
    """(option, value) pairs the config sets; value None for a flag."""
    pairs: list[tuple[str, str | None]] = []
    for name, option in OPTIONS.items():
        value = getattr(c, name)
        if value is None or value is False or (name == "gpus_per_node" and value == 0):
            continue
        pairs.append((option, _option_value(c, name)))
    for arg in c.sbatch_args:
        parsed = sbatch_arg(arg)
        if parsed is None:  # SlurmConfig.validate refuses it first
            raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r} must be an sbatch option like --qos=high")
        pairs.append(parsed)
    return pairs


def _parse_header_line(line: str) -> tuple[str, str | None] | None:
    match = _SBATCH_LINE.match(line)
    if not match:
        return None
    dashes, option, value = match.groups()
    if dashes == "-":
        option, value = _SHORT.get(option[0], option[0]), value or (option[1:] or None)
    if value is not None and len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]  # sbatch removes the quotes
    return option, value


def directive(option: str, value: str | None) -> str:
    """The ``#SBATCH`` line for an option; a value with spaces (config.SPACED_OPTIONS) in double quotes, which
    sbatch reads as one value (the value holds none: SlurmConfig.validate)."""
    if value is None:
        return f"#SBATCH --{option}"
    return f'#SBATCH --{option}="{value}"' if " " in value else f"#SBATCH --{option}={value}"


def render_header(lines: list[str], pairs: list[tuple[str, str | None]]) -> tuple[list[str], dict[str, str | None]]:
    """Header lines with each option's #SBATCH line replaced (or added after the last one)."""
    out = list(lines)
    last = max((i for i, line in enumerate(out) if line.startswith("#SBATCH")), default=len(out) - 1)
    for option, value in pairs:
        new = directive(option, value)
        for i, line in enumerate(out):
            parsed = _parse_header_line(line)
            if parsed and parsed[0] == option:
                out[i] = new
                break
        else:
            last += 1
            out.insert(last, new)
    final = {}
    for line in out:
        parsed = _parse_header_line(line)
        if parsed:
            final[parsed[0]] = parsed[1]
    return out, final


def settings_env(c: SlurmConfig, config: ProjectConfig, project: Path, runtime: str) -> dict[str, str]:
    """CTRAIN_* (and the config's own ``env``) values the config sets, as the scripts read them."""
    env: dict[str, str] = {}
    if c.image:
        env["CTRAIN_IMAGE"] = _image_setting(c.image, config, runtime)
    elif not (os.environ.get("CTRAIN_IMAGE") or os.environ.get("IMAGE")):
        # What `ctrain convert` writes for this project's image.name:image.tag.
        from ctrain.image.convert import default_output

        suffix = "sif" if runtime == "apptainer" else "sqsh"
        env["CTRAIN_IMAGE"] = str(default_output(config.resolve(config.convert.output_dir), config.image.ref, suffix))
    if c.launcher:
        env["CTRAIN_LAUNCHER"] = c.launcher
    for name, var in (
        ("deepspeed_config", "CTRAIN_DEEPSPEED_CONFIG"),
        ("accelerate_config", "CTRAIN_ACCELERATE_CONFIG"),
    ):
        value = getattr(c, name)
        if value is not None:
            env[var] = str(_inside(config.resolve(value), project, f"slurm.{name}"))
    for name, var in (("data", "CTRAIN_DATA"), ("hf_cache", "CTRAIN_HF_CACHE"), ("outputs", "CTRAIN_OUTPUTS")):
        value = getattr(c, name)
        if value is not None:
            env[var] = str(host_path(str(value), config, f"slurm.{name}"))
    if c.mounts:
        env["CTRAIN_MOUNTS"] = ",".join(_mount(mount, config, f"slurm.mounts[{i}]") for i, mount in enumerate(c.mounts))
    for name, var in (("mount_home", "CTRAIN_MOUNT_HOME"), ("efa", "CTRAIN_EFA")):
        value = getattr(c, name)
        if value is not None:
            env[var] = "1" if value else "0"
    if c.max_requeues is not None:
        env["CTRAIN_MAX_REQUEUES"] = str(c.max_requeues)
    if c.hang_timeout is not None:
        env["CTRAIN_HANG_TIMEOUT"] = str(c.hang_timeout)
    if c.node_check is not None:
        env["CTRAIN_NODE_CHECK"] = str(c.node_check)
    if c.preflight is not None:
        env["CTRAIN_PREFLIGHT"] = c.preflight
    env.update(c.env)
    if c.env:
        env["CTRAIN_CONTAINER_ENV"] = ",".join(c.env)
    if c.pass_env:
        env["CTRAIN_PASS_ENV"] = ",".join(c.pass_env)
    return env


_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def host_path(value: str, config: ProjectConfig, what: str) -> Path:
    """A host directory of the settings as this machine (the login node, where jobs are submitted) names it:
    ``$VAR`` and ``${VAR}`` from this environment, then ``~``, then relative to the project config. The script
    quotes it, so nothing is expanded later: an unset variable is a ConfigError, not a directory named ``$VAR``."""

    def variable(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in os.environ:
            raise ConfigError(
                f"{what} {shorten(value)} names ${name}, which is not set here: ctrain expands variables when the "
                f"job is submitted, on this machine; set it (export {name}=...) or write the path out"
            )
        return os.environ[name]

    expanded = _VARIABLE.sub(variable, value)
    problem = control_problem(expanded)
    if problem:
        raise ConfigError(f"{what} {shorten(value)} is {shorten(expanded)!r} here, which {problem}: write the path out")
    return config.resolve(expanded)


def _mount(mount: str, config: ProjectConfig, what: str) -> str:
    """A slurm.mounts entry (SRC:DST[:ro]) with its source made absolute as :func:`host_path` does."""
    source, _, rest = mount.partition(":")
    host = str(host_path(source, config, what))
    if "," in host or ":" in host:
        raise ConfigError(
            f"{what} {shorten(mount)!r}: its source {shorten(host)} contains ',' or ':', which separate the "
            "container's mounts: use a path without them (a symbolic link to it will do)"
        )
    return f"{host}:{rest}"


def image_is_file(image: str, project: Path) -> bool:
    """Whether an image setting names a file, else a registry reference: a path (``/``, ``./``,
    ``../``, ``~/``), a name ending .sif, .sqsh or .squashfs, or something that exists in the
    project directory; never a URI. Users copy references from registries (nvcr.io/nvidia/pytorch:TAG),
    so a ``/`` alone does not make a path. The same rule in bash is ``ctrain_image_is_file`` in
    sbatch/lib/ctrain.sh (for jobs queued with plain sbatch); a test keeps the two in agreement."""
    if not image:
        return False
    if image.startswith(("/", "./", "../", "~/")) or image in (".", ".."):
        return True
    if "://" in image:
        return False
    if image.endswith(IMAGE_SUFFIXES):
        return True
    return os.path.lexists(project / image)


def _image_path(image: str, project: Path) -> Path:
    path = Path(image).expanduser()
    return path if path.is_absolute() else project / path


def _image_setting(image: str, config: ProjectConfig, runtime: str) -> str:
    """A file made absolute against the config; a registry reference checked, and for pyxis written
    the way enroot reads it."""
    if image_is_file(image, config.root):
        return str(_image_path(image, config.root))
    return _image_reference(image, runtime, config.root)


def _image_reference(image: str, runtime: str, project: Path) -> str:
    """A registry reference as the runtime takes it (a ConfigError when it cannot)."""
    first = image.split("/", 1)[0]
    if "/" in image and "://" not in image and "#" not in image and not reference.is_domain(first):
        folder = project / first
        if folder.is_dir():
            inside = sorted(p.name for p in folder.iterdir() if p.name.endswith(IMAGE_SUFFIXES))
            hint = f" (it holds {', '.join(inside[:3])})" if inside else ""
            raise ConfigError(
                f"image {project / image} does not exist, and {first}/ is a directory here{hint}: fix the file's name, "
                f"or make it (ctrain convert); for Docker Hub's image {image} write docker.io/{image}"
            )
    if runtime == "pyxis":
        return reference.enroot(image, "the image")
    if image.startswith(("docker://", "oras://")):
        reference.parse(image.split("://", 1)[1], f"the image {image!r}:", example=f"docker://{reference.EXAMPLE}")
        return image
    if image.startswith(_URI_SCHEMES):
        return image
    as_docker = image.replace("#", "/", 1)
    if reference.problem(as_docker) is None:
        raise ConfigError(
            f"the image {image!r} is a registry reference, which Apptainer pulls through a URI: use "
            f"docker://{as_docker} (each node then converts it when the job starts), or make a SIF once "
            "(ctrain convert --to sif) and give its path"
        )
    raise ConfigError(
        f"the image {image!r} is neither an image file (.sif, or a path starting with / or ./) nor a "
        f"registry URI (docker://{reference.EXAMPLE}); for Apptainer make one with ctrain convert --to sif"
    )


def _inside(path: Path, project: Path, what: str) -> Path:
    """``path`` relative to the project directory, which the container sees as /workspace."""
    try:
        return path.resolve().relative_to(project.resolve())
    except ValueError:
        raise ConfigError(
            f"{what} {path} is outside the project directory {project}, the part of this machine's files the "
            "container sees (as /workspace): copy it into the project directory and name it from there"
        ) from None


def resolve_settings(
    lib: Path, runtime: str, arguments: list[str], env: dict[str, str], project: Path
) -> dict[str, str]:
    """CTRAIN_* values as the script library resolves them from ``env`` and ``arguments``."""
    snippet = (
        'source "$0" && ctrain_settings "$@" && '
        'for v in "${!CTRAIN_@}"; do [[ $v == CTRAIN_OVERRIDES ]] || printf "%s=%s\\0" "$v" "${!v}"; done'
    )
    # The job sees the submitting shell's environment (sbatch exports it), then the rendered exports;
    # here without what would run code in this bash: BASH_ENV, ENV, functions (also inherited), and
    # the config's PATH and LD_* (allowed for the job, which needs them).
    inherited = {k: v for k, v in os.environ.items() if k == "LD_LIBRARY_PATH" or not env_name_problem(k)}
    added = {k: v for k, v in env.items() if k != "PATH" and not k.startswith("LD_")}
    argv = [proc.which("bash") or "/bin/bash", "-c", snippet, str(lib), runtime, *arguments]
    out = subprocess.run(argv, env={**inherited, **added, "SLURM_SUBMIT_DIR": str(project)}, cwd=project, check=False,
                         capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)  # fmt: skip
    if out.returncode != 0:
        said = [line.removeprefix("ctrain: error: ") for line in out.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(said) if "CTRAIN_" in line), said[-1] if said else "")
        raise ConfigError(f"the job's settings are refused by {lib}: {shorten(reason, 300)} (from slurm.env, "
                          "ctrain.yaml or your environment)")  # fmt: skip
    pairs = [item.partition("=") for item in out.stdout.split("\0") if item]
    return {key: value for key, _, value in pairs}


# The host directories the scripts mount (SRC:DST,...), with where each is set.
_MOUNTED = {"CTRAIN_PROJECT_DIR": "the project directory", "CTRAIN_OUTPUTS": "the outputs directory (slurm.outputs)",
            "CTRAIN_HF_CACHE": "the Hugging Face cache (slurm.hf_cache, else $HF_HOME)",
            "CTRAIN_DATA": "the data directory (slurm.data)"}  # fmt: skip
_LINK = "; or set it to a path without them (a symbolic link to it will do)"


def check_mount_sources(settings: dict[str, str]) -> None:
    """Refuse a mounted directory with ',' or ':' in its path: the runtimes split their mount lists at
    them, so every job would fail as its container starts (ctrain.yaml's own paths are checked as
    they are read; the project directory and what derives from it only here)."""
    for name, what in _MOUNTED.items():
        value = settings.get(name, "")
        if "," in value or ":" in value:
            raise ConfigError(
                f"{what} {shorten(value, 120)} contains ',' or ':', which separate the container's mounts, so the "
                f"job could not start: rename or move the directory{'' if name == 'CTRAIN_PROJECT_DIR' else _LINK}"
            )


def script_runtime(template: Path) -> str:
    """The runtime a ctrain script runs (its `ctrain_main RUNTIME "$@"` line)."""
    text = read_script(template, "the sbatch script")
    main = _MAIN_LINE.search(text)
    if SOURCE_LINE not in text.splitlines() or not main:
        raise ConfigError(
            f"{template} is not a ctrain sbatch script: it needs the line `{SOURCE_LINE}` and a line "
            '`ctrain_main RUNTIME "$@"` (see sbatch/apptainer.sbatch)'
        )
    return main.group(1)


def split_script(text: str) -> tuple[list[str], list[str]]:
    """A script's header (the comment lines up to the first blank line or command: where sbatch reads
    #SBATCH lines) and the rest."""
    lines = text.splitlines()
    body_start = next((i for i, line in enumerate(lines) if line and not line.startswith("#") or not line.strip()),
                      len(lines))  # fmt: skip
    return lines[:body_start], lines[body_start:]


def render(template: Path, lib_text: str, header_pairs: list[tuple[str, str | None]], env: dict[str, str],
           arguments: list[str]) -> tuple[str, dict[str, str | None]]:  # fmt: skip
    """The self-contained script and its final #SBATCH options."""
    header, body = split_script(read_script(template, "the sbatch script"))
    header, options = render_header(header, header_pairs)
    source_at = body.index(SOURCE_LINE)
    comment_start = source_at
    while comment_start > 0 and body[comment_start - 1].startswith("#"):
        comment_start -= 1
    settings = ["", RENDERED_MARK]
    settings += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    settings.append(shlex.join(["set", "--", *arguments]))
    inlined = [
        f"# --- {LIB}, inlined by ctrain submit ---",
        *lib_text.rstrip("\n").splitlines(),
        f"# --- end of {LIB} ---",
    ]
    body = body[:comment_start] + inlined + body[source_at + 1 :]
    return "\n".join(header + settings + body) + "\n", options


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


def prepare(
    config: ProjectConfig, *, recipe: str | None = None, overrides: tuple[str, ...] = (),
    command: tuple[str, ...] | None = None, client: slurm.Slurm | None = None, **changes: object,
) -> Job:  # fmt: skip
    """Render the job for ``config.slurm`` with command-line ``changes`` on top: ``slurm:`` keys (nodes=,
    time=, image=, ...), checked as in ctrain.yaml; None leaves a setting as configured. A GPU job
    that names no CPUs or memory gets them from what ``client``'s sinfo says the nodes have.
    ``command``: the user's own program instead of a recipe (the words after ``--``)."""
    c = override(config.slurm, changes, where="slurm")
    project = config.root
    template = choose_script(c, project, c.nodes)
    runtime = script_runtime(template)
    # The options as the script's header and the settings give them, before any are derived.
    _, asked = render_header(split_script(read_script(template, "the sbatch script"))[0], sbatch_options(c))
    shapes = None
    if node_gpus(asked) and client is not None and client.runner.has("sinfo"):
        shapes = client.node_shapes(asked.get("partition"))
    derived, notes = gpu_resources(c, shapes, asked)
    if derived:
        c = override(c, derived, where="slurm")
    lib = template.parent / "lib" / LIB.name
    if not lib.is_file():
        lib = scripts_dir(project) / "lib" / LIB.name
    notes += library_notes(lib)
    env = settings_env(c, config, project, runtime)
    if command is not None:
        arguments = command_arguments(command, recipe, overrides)
    else:
        arguments = recipe_arguments(c, recipe, overrides)
    text, options = render(template, assemble(lib), sbatch_options(c), env, arguments)
    settings = resolve_settings(lib, runtime, arguments, env, project)
    check_mount_sources(settings)
    job = Job(template, runtime, text, project, settings, arguments, options, notes)
    per_gpu = _cpus_per_gpu(options)
    if per_gpu is not None and per_gpu < MIN_CPUS_PER_GPU:
        said = (f"--cpus-per-gpu={options['cpus-per-gpu']}" if options.get("cpus-per-gpu") is not None else
                f"--cpus-per-task={options['cpus-per-task']} for {node_gpus(options)} GPUs per node, one task per "
                "node")  # fmt: skip
        job.notes.append(
            f"warning: {per_gpu:g} CPUs per GPU ({said}): data loading and the launcher will "
            f"starve the GPUs; ask for at least {MIN_CPUS_PER_GPU} per GPU or --exclusive"
        )
    return job


def recipe_arguments(c: SlurmConfig, recipe: str | None, overrides: tuple[str, ...]) -> list[str]:
    """The script's arguments for a recipe: the recipe (else ``slurm.recipe``), then KEY=VALUE overrides."""
    recipe_arg = recipe or (str(c.recipe) if c.recipe else None)
    for item in [*([recipe] if recipe else []), *overrides]:
        problem = control_problem(item)
        if problem:
            raise ConfigError(f"the argument {shorten(item)!r} {problem}: a recipe path or key=value override is one line")
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. training.max_steps=100)")
    if recipe_arg and "=" in recipe_arg:
        raise ConfigError(f"the recipe comes first, then key=value overrides; got {recipe_arg!r} as the recipe")
    return [*([recipe_arg] if recipe_arg else []), *overrides]


def command_arguments(command: tuple[str, ...], recipe: str | None, overrides: tuple[str, ...]) -> list[str]:
    """The script's arguments for a command of the user's own: ``--`` and its words, each one line."""
    if recipe or overrides:
        given = " ".join([*([recipe] if recipe else []), *overrides])
        raise ConfigError(f"give a recipe or a command after --, not both (got {shorten(given)!r} before --)")
    if not command:
        raise ConfigError("nothing after --: give the command to run, e.g. ctrain submit -- train.py --lr 1e-4")
    for item in command:
        problem = control_problem(item)
        if problem:
            raise ConfigError(f"the command's word {shorten(item)!r} {problem}: each word is one line")
    return ["--", *command]


def command_script(command: list[str]) -> str | None:
    """The Python file a command runs (``train.py ...``, ``python -u train.py ...``), None for ``-m``
    and other programs: it must be in the project, which is the job's working directory."""
    words = command[1:] if Path(command[0]).name.startswith("python") else command
    for word in words:
        if word == "-m" or not word.startswith("-"):
            return word if word.endswith(".py") else None
    return None


def _cpus_per_gpu(options: dict[str, str | None]) -> float | None:
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


# --- checks before queueing -----------------------------------------------------------------------


def from_here(recipe: str | None, root: Path) -> str | None:
    """A recipe path as typed, relative to the working directory as for ``ctrain train``, made
    relative to the project directory ``root``, where the job runs (``recipes/x.yaml`` typed in the
    project's ``recipes/`` as ``x.yaml``). A path that names no file from here, or one typed outside
    the project (``ctrain --config PROJECT/ctrain.yaml submit``), stays relative to the project."""
    if recipe is None or "=" in recipe or Path(recipe).is_absolute():
        return recipe
    here = Path.cwd() / recipe
    try:
        inside = here.resolve().relative_to(root.resolve())
    except ValueError:
        return recipe
    return str(inside) if here.is_file() else recipe


class MissingImage(ConfigError):
    """The image file is not there (yet): an error for a job, a note for a dry run."""


def check(job: Job, client: slurm.Slurm | None = None, dry_run: bool = False) -> list[str]:
    """Everything that can be known wrong before the job waits in the queue; returns warnings.

    A dry run shows the script before an image exists (what ``ctrain init`` sends a new user to):
    a missing image file is then a warning, not an error."""
    warnings: list[str] = []
    s = job.settings
    check_signal(job.options)
    try:
        check_image(s["CTRAIN_IMAGE"], job.runtime, job.project)
    except MissingImage as missing:
        if not dry_run:
            raise
        warnings.append(f"{missing} (a job needs it; this dry run does not)")
    if s["CTRAIN_LAUNCHER"] == "deepspeed":
        _project_file(job, s["CTRAIN_DEEPSPEED_CONFIG"], "the DeepSpeed config (CTRAIN_DEEPSPEED_CONFIG)")
    if job.command is None:
        warnings += check_job_recipe(job)
    else:
        script = command_script(job.command)
        if script is not None and not script.startswith(_CONTAINER_TARGETS):
            _project_file(job, script, "the command's script")
    if s.get("CTRAIN_ACCELERATE_CONFIG"):
        _project_file(job, s["CTRAIN_ACCELERATE_CONFIG"], "the accelerate config (CTRAIN_ACCELERATE_CONFIG)")
    if s.get("CTRAIN_DATA") and not Path(s["CTRAIN_DATA"]).is_dir():
        raise ConfigError(f"the data directory {s['CTRAIN_DATA']} (CTRAIN_DATA, slurm.data) does not exist")
    warnings += check_gpus(job, client or slurm.Slurm())
    return warnings


def check_signal(options: dict[str, str | None]) -> None:
    """The time-limit warning must come after the job starts, or every run would stop at once."""
    limit = slurm.time_seconds(options["time"]) if options.get("time") else None
    lead = (options.get("signal") or "").rpartition("@")[2]
    if limit is not None and lead.isdigit() and int(lead) >= limit:
        raise ConfigError(
            f"the time-limit warning comes {lead}s before the end (--signal={options['signal']}), but the time "
            f"limit is {options['time']} ({limit}s): raise the time limit or lower slurm.signal_lead"
        )


def check_image(image: str, runtime: str, project: Path | None = None) -> None:
    """The image exists and suits the runtime: a readable file of the runtime's format, or a
    well-formed reference the runtime can pull."""
    project = project or Path.cwd()
    if not image_is_file(image, project):
        _image_reference(image, runtime, project)
        return
    path = _image_path(image, project)
    kind = _image_kind(path, runtime)
    if runtime == "pyxis" and kind != "squashfs":
        fix = "ctrain convert --to sqsh" + (", or submit with --runtime apptainer" if kind == "SIF" else "")
        raise ConfigError(
            f"pyxis needs an enroot squashfs, and {image} is {'a ' + kind if kind == 'SIF' else kind}: run "
            f"{fix}, and set slurm.image (or IMAGE) to the .sqsh"
        )
    if runtime == "apptainer" and kind == "squashfs":
        raise ConfigError(
            f"Apptainer needs a SIF, and {image} is a squashfs (enroot's format, for pyxis): run ctrain convert "
            "--to sif and give the .sif, or submit with --runtime pyxis"
        )
    if runtime == "apptainer" and kind not in ("SIF", "a sandbox directory"):
        raise ConfigError(
            f"Apptainer cannot run {image}: it is {kind} (expected a .sif from `ctrain convert --to sif`)"
        )


def _image_kind(path: Path, runtime: str) -> str:
    """SIF, squashfs, a sandbox directory (Apptainer), or a description of what else it is; a
    ConfigError for what is no image at all (missing, a plain directory, unreadable)."""
    make = "ctrain convert --to " + ("sqsh" if runtime == "pyxis" else "sif")
    if not path.exists():
        broken = " (a symbolic link to nothing)" if path.is_symlink() else ""
        raise MissingImage(
            f"image {path} does not exist{broken}: build and convert it (`ctrain build && {make}`), "
            "or set slurm.image / IMAGE to an existing image"
        )
    if path.is_dir():
        if runtime == "apptainer" and (path / ".singularity.d").is_dir():
            return "a sandbox directory"
        inside = sorted(p.name for p in path.iterdir() if p.name.endswith(IMAGE_SUFFIXES))
        hint = f" (it holds {', '.join(inside[:3])})" if inside else ""
        raise ConfigError(f"image {path} is a directory, not an image file{hint}: give the image file's path")
    if not path.is_file():
        raise ConfigError(f"image {path} is not a regular file (a device or pipe?): give the image file's path")
    from ctrain.image.convert import cut_short, file_format

    try:
        found = file_format(path)
        short = cut_short(path, found) if found is not None else None
    except OSError as exc:
        raise ConfigError(
            f"image {path} cannot be read ({exc.strerror}): make it readable by the job's user "
            f"(chmod a+r {path}) or copy it where they can read it"
        ) from exc
    if found is not None:
        if short is not None:
            raise ConfigError(
                f"image {path} is cut short ({short}): an interrupted copy or conversion, which would fail on "
                f"every node; make it again (`{make}`, then `ctrain push`) or copy it again"
            )
        return {"sqsh": "squashfs", "sif": "SIF"}[found]
    if path.stat().st_size == 0:
        return "an empty file (an interrupted copy?)"
    return "not a container image (neither SIF nor squashfs)"


# Where the container sees the project and the mounts (containers/Dockerfile): paths there
# cannot be checked from the login node.
_CONTAINER_TARGETS = ("/workspace", "/data", "/hf_home", "/outputs")


def check_job_recipe(job: Job) -> list[str]:
    """The recipe exists inside the project and validates with the overrides, as the job will run it
    (from the project directory, on nodes x processes per node), without torch; returns notes."""
    from ctrain.train.preflight import preflight as check_paths
    from ctrain.train.recipe import load_recipe

    path = _project_file(job, job.settings["CTRAIN_RECIPE"], "the recipe")
    overrides = job.arguments[1:] if job.arguments and "=" not in job.arguments[0] else list(job.arguments)
    if job.settings["CTRAIN_LAUNCHER"] == "deepspeed":
        overrides.append(f"training.deepspeed={job.settings['CTRAIN_DEEPSPEED_CONFIG']}")
    recipe = load_recipe(path, overrides)
    with _cwd(job.project):
        try:
            notes = check_paths(recipe, world_size=job.world_size)
        except ConfigError as exc:
            if not any(target in str(exc) for target in _CONTAINER_TARGETS):
                raise
            notes = [f"not checked from here (a path inside the container): {exc}"]
        check_output_dir(job, recipe)
    return notes


def _on_host(path: Path, job: Job) -> Path | None:
    """Where the job's ``path`` (as the container sees it) is on this machine: a relative path as it is (the job's
    working directory is the project's, and so is ours: :func:`_cwd`), the project for /workspace, CTRAIN_OUTPUTS
    for /outputs; None for the other mounts (/data, /hf_home), not checked here."""
    if not path.is_absolute():
        return path
    for target, host in (("/workspace", str(job.project)), ("/outputs", job.settings.get("CTRAIN_OUTPUTS"))):
        if path.is_relative_to(target):
            return Path(host) / path.relative_to(target) if host else None
    return None if any(path.is_relative_to(target) for target in _CONTAINER_TARGETS) else path


def check_output_dir(job: Job, recipe: Recipe) -> None:
    """Refuse at submit what the job would refuse as its training.output_dir once it starts: a file there (/dev/null),
    or a directory that holds files no ctrain run wrote (/, the project's recipes/): :func:`rundir.check_owned`, with
    the job's own message. A path with variables is the job's environment's to say, and is not checked."""
    from ctrain.files import check_directory
    from ctrain.train.artifacts import PREPARED_DIR
    from ctrain.train.recipe import expand_path
    from ctrain.train.rundir import check_owned

    value, prepared_value = recipe.training.output_dir, recipe.data.prepared_dir
    if not value or "$" in value or "$" in (prepared_value or ""):
        return
    output_dir = _on_host(recipe.output_dir, job)
    if output_dir is None:
        return
    prepared = _on_host(expand_path(prepared_value), job) if prepared_value else None
    if os.path.lexists(output_dir) and not output_dir.is_dir():
        check_directory(output_dir, "training.output_dir", "set training.output_dir to a directory you can write")
    with contextlib.suppress(OSError):  # a directory this user cannot list: the job's own checks say so
        check_owned(output_dir, prepared or output_dir / PREPARED_DIR)


@contextlib.contextmanager
def _cwd(directory: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def _project_file(job: Job, name: str, what: str) -> Path:
    path = Path(name) if Path(name).is_absolute() else job.project / name
    if not path.is_file():
        raise ConfigError(f"{what} {name} does not exist (paths are relative to the project directory {job.project})")
    _inside(path, job.project, what)
    return path


def check_gpus(job: Job, client: slurm.Slurm) -> list[str]:
    """Requested GPUs per node against what the partition's nodes have (sinfo)."""
    wanted = node_gpus(job.options)
    partition = job.options.get("partition")
    if not client.runner.has("sinfo"):
        return []
    have = client.partition_gpus(partition)
    where = f"partition '{partition}'" if partition else "this cluster"
    if wanted is not None:
        if have is not None and wanted > have:
            raise ConfigError(
                f"{wanted} GPUs per node requested, but the nodes of {where} have at most {have}"
                + ("; choose a GPU partition (slurm.partition, --partition)" if have == 0 else "")
            )
        return []
    if have:
        advice = "set slurm.gpus_per_node or --gpus-per-node"
        return [f"no GPUs requested although {where} has nodes with {have}: training runs on CPU ({advice})"]
    return []


# --- submit ---------------------------------------------------------------------------------------


def make_log_dir(job: Job) -> None:
    """The job's log directory, made and checked before anything is queued: Slurm does not create
    the --output directory, and a job that cannot write its log fails without a word."""
    from ctrain.files import creatable_dir_problem, make_dirs

    fix = "run from a project directory you can write, or point --output (#SBATCH) elsewhere"
    problem = creatable_dir_problem(job.log_dir)
    if problem:
        raise CtrainError(f"the job could not write its log: {problem}: {fix}")
    make_dirs(job.log_dir, fix)


def write_script(job: Job, path: Path) -> None:
    """The rendered script to ``path``, for ``sbatch FILE`` later; checked first, written whole. An
    existing file is replaced only when it is a script ctrain wrote: never a recipe typed in the
    wrong place, a device (/dev/null) or a FIFO, which the rename would turn into a plain file."""
    from ctrain.files import writable_dir_problem

    if path.is_dir():
        raise ConfigError(f"--write-script {path} is a directory: give a file name, e.g. {path}/job.sbatch")
    if os.path.lexists(path):
        if path.is_symlink() or not path.is_file():
            kind = "a symbolic link" if path.is_symlink() else "not a regular file (a device, pipe or socket)"
            raise ConfigError(f"--write-script {path} is {kind}: ctrain replaces only a script it wrote; give "
                              "a new file name")  # fmt: skip
        try:
            ours = RENDERED_MARK in read_script(path, "--write-script").splitlines()
        except ConfigError:
            ours = False
        if not ours:
            raise ConfigError(f"--write-script {path} exists and is not a script ctrain wrote: not replacing it; "
                              "give a new file name (or remove the file first)")  # fmt: skip
    problem = writable_dir_problem(path.parent.absolute())
    if problem:
        raise ConfigError(f"cannot write {path}: {problem}: give --write-script a path in a directory you can write")
    make_log_dir(job)
    atomic_write_text(path, job.text)


PREFLIGHT_COMMAND = ("-m", "ctrain.train.health")  # the rank checks alone, under the launcher


def preflight_job(config: ProjectConfig, *, quick: bool = False, client: slurm.Slurm | None = None,
                  **changes: object) -> Job:  # fmt: skip
    """A job that only checks its nodes (``ctrain preflight``): the node checks, then the rank checks as
    its command, at ``full`` length unless QUICK; a failure is reported, never requeued."""
    return prepare(config, command=PREFLIGHT_COMMAND, client=client, job_name="preflight",
                   preflight="quick" if quick else "full", max_requeues=0, **changes)  # fmt: skip


def submit(job: Job, client: slurm.Slurm | None = None) -> tuple[str, Path]:
    """Queue the job; returns its id and its log, beside which a copy of the script is kept (.sbatch)."""
    make_log_dir(job)
    client = client or slurm.Slurm()
    job_id = client.sbatch([], cwd=job.project, script=job.text)
    log = client.log_path(job_id, search=[job.log_dir])
    atomic_write_text(log.with_suffix(".sbatch"), job.text)  # replaces a link there, never writes through it
    return job_id, log
