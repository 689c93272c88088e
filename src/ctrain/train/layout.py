"""The batch layout: how ``training.global_batch_size`` divides into per-device micro-batches and
gradient accumulation on a given number of processes (torch-free, so a login node can check it)."""

from __future__ import annotations

from ctrain.errors import ConfigError
from ctrain.train.recipe import TrainingSettings


def batch_layout(training: TrainingSettings, world_size: int, cap: int | None = None) -> tuple[int, int]:
    """(per-device batch, gradient accumulation steps) giving ``global_batch_size`` on ``world_size`` processes.

    Each process takes an equal share of the global batch, in micro-batches of at most
    ``max_per_device_batch_size`` (and ``cap``) rows; accumulation makes up the rest. The global
    batch, hence the schedule and the result, stays the same from one process to 16 nodes.
    """
    total = training.global_batch_size
    if world_size < 1:
        raise ConfigError(f"world size {world_size} is not a number of processes")
    if total % world_size:
        raise ConfigError(
            f"training.global_batch_size ({total}) does not divide among {world_size} processes: "
            f"make it a multiple of {world_size}"
        )
    share = total // world_size
    limit = min(x for x in (share, training.max_per_device_batch_size, cap) if x is not None)
    per_device = max(d for d in _divisors(share) if d <= limit)
    return per_device, share // per_device


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in small]
