"""The ``#SBATCH`` header of a job: the options the settings set (:func:`sbatch_options`, from each
field's declared sbatch option, then ``slurm.sbatch_args``), each written as sbatch reads it
(:func:`directive`), replacing the script's own line for the option or added after the last one.
"""

from __future__ import annotations

import re

from ctrain.errors import ConfigError
from ctrain.files import shorten
from ctrain.jobvalues import SHORT_OPTIONS, sbatch_arg
from ctrain.slurmconfig import SETTINGS, SlurmConfig

_SBATCH_LINE = re.compile(r'^#SBATCH\s+(-{1,2})([A-Za-z][\w-]*)(?:[=\s]\s*("[^"\n]*"|\S+))?')


def sbatch_options(c: SlurmConfig) -> list[tuple[str, str | None]]:
    """(option, value) pairs the config sets, in the order of its fields, then sbatch_args; value None for a
    flag (a true bool)."""
    pairs: list[tuple[str, str | None]] = []
    for name, declared in SETTINGS.items():
        value = getattr(c, name)
        if not declared.sbatch or value is None or value is False or (declared.zero_is_unset and value == 0):
            continue
        pairs.append((declared.sbatch, None if value is True else declared.form.format(value)))
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
        option, value = SHORT_OPTIONS.get(option[0], option[0]), value or (option[1:] or None)
    if value is not None and len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]  # sbatch removes the quotes
    return option, value


def directive(option: str, value: str | None) -> str:
    """The ``#SBATCH`` line for an option; a value with spaces (jobvalues.spaced_options) in double quotes, which
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
