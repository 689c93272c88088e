"""Which optional parts of the training stack a recipe's run imports.

transformers, TRL and accelerate import PEFT and DeepSpeed whenever they are installed (both are
in the image), about a second of every process's start on a CPU and more on a GPU node, where
DeepSpeed probes its accelerator. A recipe that trains no adapters and shards with no DeepSpeed
config never uses them, so :func:`hide` makes them look absent to this process before the
stack is imported: a ``None`` in ``sys.modules`` is Python's own way to say "not installed"
(``importlib.util.find_spec`` answers None, an import raises ImportError).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from ctrain import install_hint, resources
from ctrain.errors import ToolNotFound
from ctrain.train.model import ADAPTER_CONFIG
from ctrain.train.recipe import Recipe, expand_path


def unused(recipe: Recipe) -> list[str]:
    """The optional packages this recipe's training run never imports on purpose."""
    names = []
    path = None if recipe.model.path is None else expand_path(recipe.model.path)
    # A hub name may be an adapter, which transformers loads through PEFT: only a new model or a
    # local directory without an adapter's config is known to need no PEFT.
    local_base = path is None or (path.is_dir() and not (path / ADAPTER_CONFIG).exists())
    if not recipe.peft.enabled and local_base:
        names.append("peft")
    if not recipe.training.deepspeed and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        names.append("deepspeed")
    return names


def hide(names: list[str]) -> list[str]:
    """Make ``names`` unimportable in this process, unless already imported; returns those hidden."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    return hidden


#: What ``ctrain train``, ``prepare``, ``eval`` and ``bench`` import: the ``train`` extra, which the
#: image has and a login node or laptop needs not.
REQUIRED = ("torch", "transformers", "trl", "datasets", "accelerate")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def install_line() -> str:
    """The install that gives the image's versions of the training stack here (CPU torch, pinned): the
    one line every message that asks for the stack gives."""
    pins = resources.path("containers", "constraints.txt")
    return f"{install_hint('train')} -c {pins} --extra-index-url {CPU_TORCH_INDEX}"


def require(command: str) -> None:
    """One error (exit 3) naming what is missing and the install that gives the image's versions,
    instead of a ModuleNotFoundError from deep inside the first import."""
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if not missing:
        return
    raise ToolNotFound(
        f"`ctrain {command}` needs the training stack, and {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not installed here: run it in the image (the sbatch scripts and "
        f"`ctrain submit` do), or install the image's versions (CPU torch): {install_line()}"
    )
