"""Self-check of the training image: the stack imports, and every pinned package is installed at
its pin (/opt/ctrain/pins.txt, written by install.sh). Apptainer's %test runs it; so can you:

    apptainer exec IMAGE.sif python /opt/ctrain/build/check.py

Prints one JSON object (versions of the stack and ctrain); exits 1 when something is off.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import re
import sys

PINS = "/opt/ctrain/pins.txt"
# distribution -> module to import
STACK = {
    "torch": "torch",
    "transformers": "transformers",
    "trl": "trl",
    "peft": "peft",
    "datasets": "datasets",
    "accelerate": "accelerate",
    "deepspeed": "deepspeed",
    "ctrain-slurm": "ctrain",  # the distribution ctrain installs under (src/ctrain/__init__.py: DISTRIBUTION)
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str = PINS) -> dict[str, str]:
    found = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            found[norm(name)] = version.strip()
    return found


def main() -> int:
    problems = []
    installed = {norm(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}
    for name, want in pins().items():
        have = installed.get(name)
        if have is not None and have.split("+", 1)[0] != want:
            problems.append(f"{name} is {have}, pinned {want}")
    versions = {}
    for dist, module in STACK.items():
        try:
            importlib.import_module(module)
            versions[dist] = md.version(dist)
        except Exception as exc:  # report every broken import, not only the first
            problems.append(f"import {module} failed: {type(exc).__name__}: {exc}")
    print(json.dumps({"python": sys.version.split()[0], "versions": versions, "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
