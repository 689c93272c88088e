#!/usr/bin/env bash
# The README's first command, as root on a fresh Debian 12 or Ubuntu machine: install what is
# missing, then the main job (scripts/demo.sh): build the CPU training image, convert it to SIF,
# start a 2-node Slurm testbed on this machine, train the demo recipe on 2 nodes x 2 processes
# inside the container, and print the trained model's accuracy (fails below 0.9). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh testbed apptainer image
exec scripts/demo.sh
