"""Check a final model `ctrain train` saved against the run's last checkpoint and the base it started from.

    python scripts/final-check.py FINAL BASE CHECKPOINT

Prints one JSON line: the dtype config.json names and the dtypes the weights are in, the bytes on
disk, whether the tensor names are the base's (the base's layers cut to the final config's count),
and how many tensors equal the checkpoint's weights rounded to the final's dtype, which is what
``model.save_dtype`` promises. The checkpoint is an unsharded one (``model.safetensors``) or a
sharded one (``pytorch_model_fsdp_0/``, torch.distributed.checkpoint), read without a process group.
Exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def tensors(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    found: dict[str, Any] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def names(directory: Path) -> set[str]:
    from safetensors import safe_open

    found: set[str] = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            found.update(handle.keys())
    return found


def checkpoint_weights(checkpoint: Path, wanted: list[str]) -> dict[str, Any]:
    """The checkpoint's tensor for each wanted name (matched by suffix in a sharded checkpoint)."""
    if (checkpoint / "model.safetensors").is_file():
        return tensors(checkpoint)
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0"))
    stored = reader.read_metadata().state_dict_metadata
    chosen: dict[str, str] = {}
    for name in wanted:
        matches = [key for key in stored if key == name or key.endswith("." + name)]
        if len(matches) == 1:
            chosen[name] = matches[0]
    state = {
        key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype) for key in chosen.values()
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {name: state[key] for name, key in chosen.items()}


def main(final: Path, base: Path, checkpoint: Path) -> int:
    import torch

    config = json.loads((final / "config.json").read_text())
    layers = config.get("num_hidden_layers")
    expected = {
        n for n in names(base) if not n.startswith("model.layers.") or layers is None or int(n.split(".")[2]) < layers
    }
    saved = tensors(final)
    masters = checkpoint_weights(checkpoint, sorted(saved))
    equal = sum(torch.equal(t, masters[n].to(t.dtype)) for n, t in saved.items() if n in masters)
    report = {
        "config_dtype": config.get("dtype"),
        "weight_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in saved.values()}),
        "gib_on_disk": round(sum(p.stat().st_size for p in final.glob("*.safetensors")) / 2**30, 2),
        "tensors": len(saved),
        "names_are_the_bases": set(saved) == expected,
        "checkpoint_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in masters.values()}),
        "equal_to_checkpoint_rounded": f"{equal}/{len(saved)}",
    }
    print(json.dumps(report))
    ok = report["names_are_the_bases"] and equal == len(saved) and [config.get("dtype")] == report["weight_dtypes"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*(Path(a) for a in sys.argv[1:4])))
