"""The job's script, rendered: the chosen ``sbatch/`` script with its ``#SBATCH`` header from the
settings (:mod:`ctrain.jobs.options`), a settings block (the ``CTRAIN_*`` exports each field declares,
quoted, and the script's arguments) and the library it sources inlined
(:func:`ctrain.jobs.library.assemble`) between two marker lines; and the settings as the library
resolves them from that block (bash decides every default, Python restates none).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from ctrain import proc, resources
from ctrain.config import ProjectConfig
from ctrain.errors import ConfigError
from ctrain.files import control_problem, shorten
from ctrain.image.checks import image_setting
from ctrain.jobs.library import LIB, SOURCE_LINE, read_script
from ctrain.jobs.options import render_header
from ctrain.jobvalues import Setting, env_name_problem
from ctrain.slurmconfig import SETTINGS, SlurmConfig

# A line only scripts `ctrain submit` rendered hold: the one kind of file --write-script may replace.
RENDERED_MARK = "# --- settings from ctrain.yaml and the command line (ctrain submit) ---"
# The lines around the inlined library.
INLINED = f"# --- {LIB}, inlined by ctrain submit ---"
INLINED_END = f"# --- end of {LIB} ---"
_MAIN_LINE = re.compile(r"^ctrain_main (\w+) \"\$@\"$", re.MULTILINE)


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


def library_path(template: Path, project: Path) -> Path:
    """The library a script sources: the one beside it (sbatch/lib/), else the project's or ctrain's."""
    lib = template.parent / "lib" / LIB.name
    return lib if lib.is_file() else scripts_dir(project) / "lib" / LIB.name


def settings_env(c: SlurmConfig, config: ProjectConfig, project: Path, runtime: str) -> dict[str, str]:
    """The CTRAIN_* variables the config sets (each field's declared variable; slurm.env's own variables
    before CTRAIN_CONTAINER_ENV, which names them), as the scripts read them."""
    env: dict[str, str] = {}
    for name, declared in SETTINGS.items():
        value = getattr(c, name)
        if isinstance(value, dict):
            env.update(value)
        text = _image_variable(c, config, runtime) if name == "image" else _variable(name, value, declared, config,
                                                                                      project)  # fmt: skip
        if declared.variable and text is not None:
            env[declared.variable] = text
    return env


def _variable(name: str, value: object, declared: Setting, config: ProjectConfig, project: Path) -> str | None:
    """A setting's value as its CTRAIN_* variable holds it; None when it is not set."""
    if value is None or value == [] or value == {}:
        return None
    if declared.place == "project":
        return str(inside_project(config.resolve(str(value)), project, f"slurm.{name}"))
    if declared.place == "host" and isinstance(value, list):
        return ",".join(_mount(mount, config, f"slurm.{name}[{i}]") for i, mount in enumerate(value))
    if declared.place == "host":
        return str(host_path(str(value), config, f"slurm.{name}"))
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, dict)):
        return ",".join(value)
    return str(value)


def _image_variable(c: SlurmConfig, config: ProjectConfig, runtime: str) -> str | None:
    """slurm.image made absolute, or checked as the runtime's reference; else, unless the environment names one
    (the job sees CTRAIN_IMAGE and IMAGE too), what `ctrain convert` writes for image.name:image.tag."""
    if c.image:
        return image_setting(c.image, config.root, runtime)
    if os.environ.get("CTRAIN_IMAGE") or os.environ.get("IMAGE"):
        return None
    from ctrain.image.convert import default_output

    suffix = "sif" if runtime == "apptainer" else "sqsh"
    return str(default_output(config.resolve(config.convert.output_dir), config.image.ref, suffix))


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


def inside_project(path: Path, project: Path, what: str) -> Path:
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
) -> tuple[dict[str, str], list[str]]:
    """CTRAIN_* values as the script library resolves them from ``env`` and ``arguments``, and the recipe
    overrides it takes from the arguments (CTRAIN_OVERRIDES: which argument is the recipe is its rule)."""
    snippet = (
        'source "$0" && ctrain_settings "$@" && '
        'for v in "${!CTRAIN_@}"; do [[ $v == CTRAIN_OVERRIDES ]] || printf "S%s=%s\\0" "$v" "${!v}"; done && '
        'for o in "${CTRAIN_OVERRIDES[@]}"; do printf "O%s\\0" "$o"; done'
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
    items = [item for item in out.stdout.split("\0") if item]
    pairs = [item[1:].partition("=") for item in items if item.startswith("S")]
    return {key: value for key, _, value in pairs}, [item[1:] for item in items if item.startswith("O")]


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
        INLINED,
        *lib_text.rstrip("\n").splitlines(),
        INLINED_END,
    ]
    body = body[:comment_start] + inlined + body[source_at + 1 :]
    return "\n".join(header + settings + body) + "\n", options


def inlined_library(text: str) -> str:
    """The library a rendered script holds (the lines between :data:`INLINED` and :data:`INLINED_END`)."""
    lines = text.splitlines()
    start, end = lines.index(INLINED), lines.index(INLINED_END)
    return "\n".join(lines[start + 1 : end]) + "\n"
