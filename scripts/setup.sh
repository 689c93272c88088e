#!/usr/bin/env bash
# Set up this machine for ctrain: a virtual environment (.venv) with ctrain and its extras, and
# the host packages the chosen workflows need (Slurm testbed, Apptainer, image tools).
# Usage: scripts/setup.sh [GROUP...]   (groups from ctrain.system.PACKAGES; default: all)
# Run as root on Debian/Ubuntu to install host packages; without root only the venv is made.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "python3-venv is missing: apt-get install python3-venv" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch first, pinned: an unpinned torch would pull the multi-GB CUDA build onto a login node.
.venv/bin/pip install -q -c containers/constraints.txt torch
# ctrain installs as ctrain-slurm; an environment made when it was called ctrain drops that first.
.venv/bin/pip uninstall -q -y ctrain 2>/dev/null || true
.venv/bin/pip install -q -c containers/constraints.txt -e ".[train,test,aws,plot]"
# deepspeed's sdist imports torch while building, so it builds against the torch installed above.
.venv/bin/pip install -q -c containers/constraints.txt --no-build-isolation deepspeed
# bitsandbytes (QLoRA) beside the environment, not in it: tests/qlora puts it on its path
# (scripts/test.sh). Its import pulls in torch's compiler, ~4 s on every ctrain start.
.venv/bin/pip install -q -c containers/constraints.txt --no-deps --upgrade --target .venv/qlora bitsandbytes

if [ "$(id -u)" = 0 ]; then
    # No group named: every group of ctrain.system.PACKAGES (the one list of them).
    .venv/bin/python -c 'import sys; from ctrain import system; system.ensure(*(sys.argv[1:] or system.PACKAGES))' "$@"
fi
echo "ctrain is set up: $(.venv/bin/ctrain --version)"
