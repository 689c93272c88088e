"""What the values of a job's settings may be: sbatch's options as ctrain knows them (the values each
takes, which may hold spaces), the declaration of one ``slurm:`` setting (:class:`Setting`, through
:func:`setting`, from which ``ctrain submit`` derives its ``#SBATCH`` lines, its settings block, its
checks and its flags), and what ``slurm.env`` may hold.

An option a field declares (``setting(sbatch="qos", pattern=..., what=...)``) is known here once the
field is: its values are then checked the same way in ``slurm.qos``, ``--qos`` and ``slurm.sbatch_args``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ctrain.errors import ConfigError
from ctrain.files import shorten

# What slurm.env, slurm.mounts may hold: variable names (none that looks like a secret: the values
# are written into the job script) and HOST:CONTAINER[:ro|rw] bind mounts.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PASS_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
# A name is a secret's when one of its _-separated words is one of these (HF_TOKEN, AWS_SECRET_ACCESS_KEY) or two
# neighbours are (WANDB_API_KEY): whole words, so TOKENIZERS_PARALLELISM and MAX_TOKENS are no secrets. A name that
# ends in one of _NOT_SECRET (HF_TOKEN_PATH) names where a secret is, not the secret.
_SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "ACCESSKEY", "CREDENTIAL",
                           "CREDENTIALS", "PRIVATEKEY"})  # fmt: skip
_SECRET_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY")})
_NOT_SECRET = frozenset({"PATH", "FILE", "DIR", "HOME"})
MOUNT = re.compile(r"[^:,]+:/[^:,]*(?::(?:ro|rw))?")
# Variables bash or the dynamic loader act on (a file sourced at every bash start, options, functions,
# the trace prompt's command substitutions, libraries loaded into every program): set in the job script,
# or in the bash that resolves its settings at submit, they would run code of their own. PATH and
# LD_LIBRARY_PATH stay allowed: jobs need them, and ctrain resolves the settings without them.
_SHELL_ENV = {"ENV": "a file every POSIX shell sources", "SHELLOPTS": "bash's options",
              "PS4": "the trace prompt, expanded as shell", "IFS": "how bash splits words",
              "PROMPT_COMMAND": "a command bash runs", "CDPATH": "where cd looks",
              "GLOBIGNORE": "how bash expands file names", "BASHOPTS": "bash's options"}  # fmt: skip
_SHELL_ENV_PREFIXES = {
    "BASH_": "bash's own variables (BASH_ENV: a file bash sources at every start; BASH_FUNC_*: functions)",
    "LD_": "the dynamic loader's variables (LD_PRELOAD: a library in every program)",
}
_ENV_ALLOWED = ("LD_LIBRARY_PATH",)

# The options that size a job's memory and CPUs: sbatch takes one of each group.
MEMORY_OPTIONS = ("mem", "mem-per-cpu", "mem-per-gpu")
CPU_OPTIONS = ("cpus-per-task", "cpus-per-gpu")
# sbatch's one-letter options, by their long names (sbatch --help): sbatch_args take the long form only; a
# setting's flag takes its option's letter.
SHORT_OPTIONS = {"A": "account", "b": "begin", "C": "constraint", "c": "cpus-per-task", "D": "chdir",
                 "d": "dependency", "e": "error", "G": "gpus", "H": "hold", "i": "input", "J": "job-name",
                 "k": "no-kill", "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks",
                 "o": "output", "O": "overcommit", "p": "partition", "q": "qos", "Q": "quiet", "S": "core-spec",
                 "s": "oversubscribe", "t": "time", "W": "wait", "w": "nodelist", "x": "exclude"}  # fmt: skip
SHORT = {option: letter for letter, option in SHORT_OPTIONS.items()}
_SBATCH_ARG = re.compile(r"--?([A-Za-z][A-Za-z0-9-]*)(?:=(.*))?", re.DOTALL)
# What an #SBATCH line's value may hold: what Slurm's names, lists, constraints, sizes and times are
# made of. Never whitespace, quotes, $, `, ;, <, >, \ or control characters: sbatch splits the line
# at whitespace, and a newline would end it and start a command of the job script.
_CHARSET = r"A-Za-z0-9_.,:@+%&|!()\[\]*=/~^{}"
_DIRECTIVE_CHARS = "letters, digits and _.,:@+%&|!()[]*=/~^{}-"


@dataclass(frozen=True)
class Option:
    """What ctrain knows of one sbatch option's value: its form (a pattern, and what it must be, for the
    error), whether it may hold spaces (its #SBATCH line quotes it), characters beyond :data:`_CHARSET`."""

    pattern: re.Pattern[str] | None = None
    what: str = ""
    spaced: bool = False
    extra: str = ""


# Options ctrain reads or checks by their value, whether from a setting or from slurm.sbatch_args; the
# settings' own options join them as SlurmConfig is declared (:func:`setting`).
KNOWN: dict[str, Option] = {}


def known(option: str, pattern: str | None = None, what: str = "", *, spaced: bool = False, extra: str = "",
          ignore_case: bool = False) -> None:  # fmt: skip
    """Declare what sbatch's ``--OPTION`` takes (a second declaration must say the same)."""
    new = Option(re.compile(pattern, re.IGNORECASE if ignore_case else 0) if pattern else None, what, spaced, extra)
    if KNOWN.setdefault(option, new) != new:
        raise ValueError(f"--{option} is declared twice, differently")


# Slurm's memory sizes (--mem, --mem-per-cpu, --mem-per-gpu): megabytes, or a number with K, M, G or T, which
# may be followed by B (64GB), in either case.
MEMORY = r"[0-9]{1,15}(?:[KMGTkmgt][Bb]?)?"
SIZE = "a size in megabytes, or a number with K, M, G or T (an optional B after it: 64GB)"
COUNT = r"[0-9]{1,9}"
_GPUS = r"(?:[A-Za-z0-9_.-]+:)?[0-9]{1,9}"
known("gpus", _GPUS, "a number of GPUs for the job, or TYPE:NUMBER (h100:16)")
known("gres", r"[A-Za-z0-9_./:-]+(?:,[A-Za-z0-9_./:-]+)*", "a list of NAME[:TYPE][:COUNT] (gpu:8, gpu:h100:8)")
known("cpus-per-gpu", COUNT, "a number of CPUs")
known("mem-per-cpu", MEMORY, f"{SIZE} (4G)")
known("mem-per-gpu", MEMORY, f"{SIZE} (80G)")
known("comment", spaced=True)


@dataclass(frozen=True)
class Setting:
    """What one ``slurm:`` setting is to ``ctrain submit``, declared with the field (:func:`setting`)."""

    help: str = ""  # the flag's help, and what the setting is
    sbatch: str | None = None  # the sbatch option it becomes (#SBATCH --OPTION=VALUE)
    form: str = "{}"  # how its value is written there (signal_lead: B:USR1@{})
    zero_is_unset: bool = False  # 0 asks for none: no #SBATCH line (gpus_per_node)
    variable: str | None = None  # the CTRAIN_* variable of the settings block it becomes
    place: Literal["host", "project"] | None = None  # a path on this machine (mounted), or in the project
    shell: bool = False  # reaches the job's shell (quoted there): no control characters
    least: int | None = None  # an integer's least value, and most
    most: int | None = None
    flags: tuple[str, ...] = ()  # the commands with a flag for it (submit, preflight)


SETTING = "ctrain.setting"
BOTH = ("submit", "preflight")


def setting(default: Any = None, *, factory: Any = None, pattern: str | None = None, what: str = "",
            spaced: bool = False, extra: str = "", ignore_case: bool = False, flags: tuple[str, ...] | None = None,
            **declared: Any) -> Any:  # fmt: skip
    """A SlurmConfig field with its :class:`Setting`. With ``sbatch=OPTION``, the option's values (``pattern``,
    ``what``, ``spaced``, ``extra``, ``ignore_case``) become known (:data:`KNOWN`), and the field a flag of submit
    and preflight unless ``flags`` says otherwise."""
    if declared.get("sbatch"):
        known(declared["sbatch"], pattern, what, spaced=spaced, extra=extra, ignore_case=ignore_case)
    flags = BOTH if flags is None and declared.get("sbatch") else flags or ()
    metadata = {SETTING: Setting(flags=flags, **declared)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def env_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a variable of slurm.env (:data:`_SHELL_ENV`), else None."""
    if name in _ENV_ALLOWED:
        return None
    if name in _SHELL_ENV:
        return f"is read by bash ({_SHELL_ENV[name]})"
    prefix = next((p for p in _SHELL_ENV_PREFIXES if name.startswith(p)), None)
    return f"is one of {_SHELL_ENV_PREFIXES[prefix]}" if prefix else None


def secret_name(name: str) -> bool:
    """Whether variable ``name`` looks like a secret's (:data:`_SECRET_WORDS`), compared word by word."""
    words = [word for word in name.upper().split("_") if word]
    if not words or words[-1] in _NOT_SECRET:
        return False
    return any(word in _SECRET_WORDS for word in words) or any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


def short_option_problem(arg: str) -> str | None:
    """Why ``arg`` (an sbatch_args entry) must be written out, with its long form; None for a long option.
    ``-N4`` would be rendered ``#SBATCH --N4`` and escape the checks of --nodes."""
    if arg.startswith("--") or not arg.startswith("-") or len(arg) < 2:
        return None
    long = SHORT_OPTIONS.get(arg[1])
    if long is None:
        return "is a short option: write its long form (sbatch --help lists them), e.g. --qos=high"
    value = arg[2:].lstrip("=")
    return f"is a short option: write the long form, --{long}{'=' + value if value else ''}"


def option_value_problem(option: str, value: str | None) -> str | None:
    """Why ``value`` is not one sbatch takes for ``option`` (those with a form: :data:`KNOWN`), else None."""
    known_option = KNOWN.get(option)
    if known_option is None or known_option.pattern is None:
        return None
    if value is None:
        return f"needs a value: {known_option.what}"
    if not known_option.pattern.fullmatch(value):
        return f"is not {known_option.what}"
    if option == "gres":
        try:
            gres_gpus(value)
        except ConfigError as exc:
            return str(exc)
    return None


def gres_gpus(value: str) -> int | None:
    """GPUs per node a ``--gres`` list asks for (``gpu``, ``gpu:8``, ``gpu:h100:8``, beside other resources), as
    sbatch reads it; None when it asks for none. A ConfigError for a ``gpu`` entry sbatch would not read."""
    total = None
    for item in value.split(","):
        parts = item.removeprefix("gres/").split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) == 1 or (len(parts) == 2 and not re.fullmatch(COUNT, parts[1])):
            count = "1"  # gpu, gpu:TYPE: one
        else:
            count = parts[-1] if len(parts) <= 3 else ""
        if not re.fullmatch(COUNT, count):
            raise ConfigError(f"--gres entry {shorten(item)!r} is not gpu[:TYPE][:COUNT] (gpu:8, gpu:h100:8)")
        total = (total or 0) + int(count)
    return total


def sbatch_arg(arg: str) -> tuple[str, str | None] | None:
    """An sbatch_args entry as (option, value), with one pair of double quotes around the value removed as sbatch
    removes them (``--comment="my run"``); None when it is no ``--option[=value]``."""
    match = _SBATCH_ARG.fullmatch(arg)
    if not match:
        return None
    value = match[2]
    if value is not None and len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return match[1], value


def spaced_options() -> tuple[str, ...]:
    """The options whose values may hold spaces: their #SBATCH line writes such a value in double quotes, which
    sbatch reads as one value and removes. Never a quote inside: sbatch would end the value."""
    return tuple(option for option, known_option in KNOWN.items() if known_option.spaced)


def directive_problem(value: str, option: str | None = None) -> str | None:
    """Why ``value`` cannot be the value of an ``#SBATCH --OPTION=VALUE`` line, else None; spaces only for
    :func:`spaced_options`, which the line quotes."""
    known_option = KNOWN.get(option or "", Option())
    extra = re.escape(known_option.extra)
    allowed = re.compile(f"[{_CHARSET}{extra}{' ' if known_option.spaced else ''}-]+")
    if allowed.fullmatch(value) and value.strip():
        return None
    if '"' in value:
        return 'contains a double quote ("), which sbatch reads as quoting: write the value without it'
    bad = next((char for char in value if not allowed.fullmatch(char)), "")
    if bad == " ":
        return f"contains a space; only {', '.join('--' + o for o in spaced_options())} take values with spaces"
    return f"contains {bad!r}; an sbatch option's value here may hold {_DIRECTIVE_CHARS} only" if bad else "is empty"
