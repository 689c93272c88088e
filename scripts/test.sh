#!/usr/bin/env bash
# Set up everything and run the whole test suite: unit tests, then integration tests against
# real tools (a Slurm testbed, Apptainer, buildah, a local registry). Run as root.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -k recipe).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# A missing prerequisite fails the run instead of skipping tests.
export CTRAIN_STRICT=1
# Fast unit tests first, so a broken build fails in minutes; then the integration tests. QLoRA's
# 4-bit layers are tested in a process of their own with bitsandbytes (.venv/qlora, scripts/setup.sh)
# on its path, so that the other tests run as they would without it.
if [ "$#" -eq 0 ]; then
    PYTHONPATH=.venv/qlora .venv/bin/python -m pytest tests/qlora
    set -- tests/unit tests/integration --durations=20
fi
exec .venv/bin/python -m pytest "$@"
