"""The flags of ``ctrain submit`` and ``ctrain preflight`` for the ``slurm:`` settings, made from each
field's declaration (:data:`ctrain.slurmconfig.SETTINGS`): sbatch's own option names and one-letter
forms (``--nodes``/``-N``, ``--qos``/``-q``), the field's type (a number, a choice, ``--x/--no-x``) and
its help. A flag not given is None, which leaves the setting as ctrain.yaml has it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

import click

from ctrain.jobvalues import SHORT
from ctrain.slurmconfig import SETTINGS, value_type

F = TypeVar("F", bound=Callable[..., Any])


def flag_fields(command: str) -> list[str]:
    """The settings with a flag of ``command`` (submit, preflight), in the order of the fields."""
    return [name for name, declared in SETTINGS.items() if command in declared.flags]


def flag_names(name: str) -> list[str]:
    """A setting's flag and its one-letter form: its sbatch option's (``--cpus-per-task``, ``-c``), else its
    key's (``--image``)."""
    option = SETTINGS[name].sbatch or name.replace("_", "-")
    return [f"--{option}", *([f"-{SHORT[option]}"] if option in SHORT else [])]


def _option(name: str, help_text: str, default: object) -> Callable[[F], F]:
    kind = value_type(name)
    long, *short = flag_names(name)
    extra: dict[str, Any] = {"help": help_text}
    if default is not None:
        extra.update(default=default, show_default=True)
    if kind is bool:
        return click.option(f"{long}/--no-{long[2:]}", *short, name, default=None, **extra)
    if get_origin(kind) is Literal:
        return click.option(long, *short, name, type=click.Choice([str(v) for v in get_args(kind)]), **extra)
    return click.option(long, *short, name, type=int if kind is int else None, **extra)


def slurm_flags(command: str, helps: Mapping[str, str] | None = None,
                defaults: Mapping[str, object] | None = None) -> Callable[[F], F]:  # fmt: skip
    """The decorator that gives ``command`` a flag for each setting declared with it, each passed to the
    command as a keyword named as the setting (``nodes=``, ``time=``); ``helps`` and ``defaults`` say what
    differs for this command."""
    helps, defaults = helps or {}, defaults or {}

    def decorate(function: F) -> F:
        for name in reversed(flag_fields(command)):
            function = _option(name, helps.get(name, SETTINGS[name].help), defaults.get(name))(function)
        return function

    return decorate
