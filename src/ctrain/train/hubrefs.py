"""The hub repositories a job needs, and whether the Hugging Face cache it mounts holds them.

Compute nodes have no internet, so every model, tokenizer and data set a recipe (or a command, by
``--fetch``) names on the hub must be in the cache the job mounts at ``/hf_home`` before it is
queued. The check reads the cache's own index (``hub/models--ORG--NAME/refs/REVISION`` and its
``snapshots/COMMIT``), offline, without huggingface_hub; ``ctrain fetch`` fills it
(:mod:`ctrain.train.fetch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ctrain.errors import ConfigError
from ctrain.train.recipe import Recipe

Kind = Literal["model", "dataset"]
#: How a data set is named where a model could be meant: ``datasets/ORG/NAME`` (the hub's own URL form).
DATASET_PREFIX = "datasets/"
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
_REVISION = re.compile(r"^[\w][\w./-]{0,199}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubRef:
    """One hub repository a job needs: a model (also a tokenizer or a config) or a data set, at a
    revision (a branch, tag or commit; None: the default branch)."""

    kind: Kind
    name: str
    revision: str | None = None
    setting: str = field(default="", compare=False)  # what names it: model.path, data.source, fetch

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name) or ".." in self.name or self.name.endswith((".", "-")):
            raise ConfigError(f"{self.setting or 'a hub name'}: {self.name!r} is not a hub repository name "
                              "(ORG/NAME, letters, digits, '.', '_' and '-')")  # fmt: skip
        if self.revision is not None and (not _REVISION.fullmatch(self.revision) or ".." in self.revision):
            raise ConfigError(f"{self.setting or 'a hub name'}: revision {self.revision!r} is not a branch, tag "
                              "or commit")  # fmt: skip

    @property
    def shown(self) -> str:
        """The name as ``ctrain fetch`` takes it: ``datasets/ORG/NAME`` for a data set, ``@REVISION`` when pinned."""
        return (DATASET_PREFIX if self.kind == "dataset" else "") + self.name + (f"@{self.revision}" if self.revision else "")

    def folder(self, hub_cache: Path) -> Path:
        """The repository's folder in a hub cache (huggingface_hub's layout)."""
        return hub_cache / "--".join([f"{self.kind}s", *self.name.split("/")])


def parse(text: str, *, dataset: bool = False, revision: str | None = None, setting: str = "") -> HubRef:
    """``ORG/NAME``, ``ORG/NAME@REVISION`` or ``datasets/ORG/NAME[@REVISION]`` as typed for ``ctrain fetch``
    or ``--fetch``; ``dataset`` makes a bare name a data set."""
    name, at, pinned = text.partition("@")
    if at and revision and pinned != revision:
        raise ConfigError(f"{text}: names revision {pinned} and --revision {revision}: give one")
    kind: Kind = "dataset" if dataset or name.startswith(DATASET_PREFIX) else "model"
    return HubRef(kind, name.removeprefix(DATASET_PREFIX), pinned or revision, setting)


def recipe_refs(recipe: Recipe) -> list[HubRef]:
    """The hub repositories the recipe names: its model, tokenizer and config where they are hub names
    (not local paths), and its data set where ``data.source`` is one. Run in the project directory."""
    from ctrain.train.sources import BUILTIN_MODEL_TYPE, model_kind, resolve_source

    refs: list[HubRef] = []
    model = recipe.model
    tokenizer = recipe.tokenizer.path
    named = [(model.path, "model.path", model.revision),
             (tokenizer, "tokenizer.path", model.revision if tokenizer == model.path else None)]  # fmt: skip
    if model.config and not BUILTIN_MODEL_TYPE.match(model.config):
        named.append((model.config, "model.config", model.revision))
    for reference, setting, revision in named:
        if reference and model_kind(reference) == "hub":
            refs.append(HubRef("model", reference, revision, setting))
    if recipe.data.source and resolve_source(recipe.data).kind == "hub":
        refs.append(HubRef("dataset", recipe.data.source, recipe.data.revision, "data.source"))
    return list(dict.fromkeys(refs))


def cached_commit(hub_cache: Path, ref: HubRef) -> str | None:
    """The commit the cache holds for ``ref`` (its ``refs/REVISION`` file, or the commit itself), where
    that snapshot is there; None where it is not."""
    folder = ref.folder(hub_cache)
    revision = ref.revision or "main"
    commit = revision if _COMMIT.fullmatch(revision) else None
    if commit is None:
        pointer = folder / "refs" / revision
        try:
            commit = pointer.read_text(errors="replace")[:100].strip() if pointer.is_file() else None
        except OSError:
            return None
        if not commit or not _COMMIT.fullmatch(commit):
            return None
    return commit if (folder / "snapshots" / commit).is_dir() else None


def missing(hub_cache: Path, refs: list[HubRef]) -> list[HubRef]:
    """The refs the cache does not hold."""
    return [ref for ref in refs if cached_commit(hub_cache, ref) is None]


def fetch_line(refs: list[HubRef]) -> str:
    """The one command that fetches ``refs``."""
    import shlex

    return "ctrain fetch " + " ".join(shlex.quote(ref.shown) for ref in dict.fromkeys(refs))


def check_cached(hf_home: Path, refs: list[HubRef]) -> None:
    """Refuse, with the one ``ctrain fetch`` line that fixes it, a job whose hub repositories are not in
    the Hugging Face cache it mounts (``hf_home``, the job's /hf_home): its nodes cannot download them."""
    absent = missing(hf_home / "hub", refs)
    if absent:
        named = ", ".join(f"{ref.setting} {ref.shown}" if ref.setting else ref.shown for ref in absent)
        raise ConfigError(f"{named} not in the Hugging Face cache the job mounts ({hf_home}), and compute nodes "
                          f"have no internet: run {fetch_line(absent)} first (on a login node, or with --cluster)")  # fmt: skip
