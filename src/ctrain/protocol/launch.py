"""The launch rules both sides apply: the processes a job runs and what the launcher adds to a recipe's
overrides (ctrain.protocol). The library applies them on the nodes (``ctrain_allocation``,
``ctrain_launcher``); ``ctrain submit`` checks a recipe against them before the job is queued, with no
allocation to run the library in. tests/unit/test_protocol.py runs the library beside each rule."""

from __future__ import annotations

DEEPSPEED_KEY = "training.deepspeed"  # the recipe key the deepspeed launcher sets


def processes_per_node(gpus_on_node: int, tasks_per_node: int) -> int:
    """One worker per GPU Slurm gave the node, else one per task it placed there."""
    return gpus_on_node if gpus_on_node > 0 else tasks_per_node


def world_size(nodes: int, gpus_on_node: int, tasks_per_node: int) -> int:
    """The job's training processes: every node runs the same number."""
    return nodes * processes_per_node(gpus_on_node, tasks_per_node)


def launcher_overrides(launcher: str, deepspeed_config: str, own_command: bool) -> list[str]:
    """What the launcher appends to a recipe's overrides: DeepSpeed's config under the deepspeed
    launcher, as a default (``?=``: a recipe's own config, or one given as an override, wins); a
    command of your own takes its config in its own arguments."""
    return [f"{DEEPSPEED_KEY}?={deepspeed_config}"] if launcher == "deepspeed" and not own_command else []
