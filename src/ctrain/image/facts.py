"""What an image is, stated in it: ctrain's, torch's and CUDA's versions and the oldest NVIDIA driver
that CUDA runs on, written into the image as it is built (``python -m ctrain.image.facts``, from
containers/install.sh) at :data:`FACTS_PATH`, the same file in a SIF and an enroot squashfs. ``ctrain
convert`` and ``ctrain submit`` read it from the image file (unsquashfs) and say it, so a cluster whose
driver is older learns it before the first job, not from it."""

from __future__ import annotations

import json
import sys
from typing import Any

FACTS_PATH = "opt/ctrain/image.json"
MAX_FACTS_BYTES = 64 * 1024
#: The oldest driver each CUDA major version runs on, through its minor-version compatibility
#: (NVIDIA's CUDA compatibility guide: 11.x from 450.80.02, 12.x from 525.60.13, 13.x from 580).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def min_driver(cuda: str | None) -> str | None:
    """The oldest driver that runs CUDA ``cuda`` (``"13.0"``); None for a CPU build or a CUDA this does not know."""
    if not cuda:
        return None
    try:
        return MIN_DRIVER.get(int(cuda.split(".")[0]))
    except ValueError:
        return None


def gather() -> dict[str, Any]:
    """This environment's facts (run inside the image being built)."""
    import torch

    from ctrain import __version__

    cuda = torch.version.cuda
    return {"ctrain": __version__, "torch": torch.__version__, "cuda": cuda,
            "min_driver": min_driver(cuda), "python": sys.version.split()[0]}  # fmt: skip


def describe(facts: dict[str, Any]) -> str:
    """The facts as one line: ``ctrain 0.1.0, torch 2.9.1, CUDA 13.0 (NVIDIA driver 580.65.06 or newer)``."""
    words = [f"ctrain {facts.get('ctrain', '?')}", f"torch {facts.get('torch', '?')}"]
    if facts.get("cuda"):
        driver = facts.get("min_driver")
        words.append(f"CUDA {facts['cuda']}" + (f" (NVIDIA driver {driver} or newer on the nodes)" if driver else ""))
    else:
        words.append("CPU only")
    return ", ".join(words)


def parse(raw: bytes) -> dict[str, Any] | None:
    """The facts file's content, or None where it is not one (an image built before it was written)."""
    try:
        data = json.loads(raw[:MAX_FACTS_BYTES].decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {key: data[key] for key in ("ctrain", "torch", "cuda", "min_driver", "python")
            if key in data and isinstance(data[key], (str, type(None)))}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(gather(), indent=1))
