#!/usr/bin/env bash
# Set up everything and run the whole test suite: unit tests, then integration tests against
# real tools (a Slurm testbed, Apptainer, buildah, a local registry). Run as root.
#   scripts/test.sh           the whole suite (what CI runs)
#   scripts/test.sh --quick   unit tests and one job on the testbed: the edit-test loop (minutes)
#   scripts/test.sh ARGS      pytest ARGS (e.g. scripts/test.sh tests/unit -k recipe)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# A missing prerequisite fails the run instead of skipping tests.
export CTRAIN_STRICT=1
# Two pytest-xdist workers: the tests that use the testbed run in one of them, in order (one
# xdist group, tests/conftest.py), while the other runs the rest, so the testbed's waiting (Slurm,
# grace periods, fault timers) overlaps with the tests that compute.
PARALLEL=(-n 2 --dist loadgroup)
# QLoRA's 4-bit layers are tested in a process of their own with bitsandbytes (.venv/qlora,
# scripts/setup.sh) on its path, so that the other tests run as they would without it.
if [ "${1:-}" = --quick ]; then
    shift
    set -- "${PARALLEL[@]}" tests/unit "tests/integration/test_sbatch.py::test_single_node_apptainer" --durations=10 "$@"
elif [ "$#" -eq 0 ]; then
    # tests/qlora (about a minute of compiling) beside the main run; its report follows the main
    # one, and one line after both adds them up.
    logs=$(mktemp -d)
    PYTHONPATH=.venv/qlora .venv/bin/python -m pytest -p no:cacheprovider tests/qlora >"$logs/qlora" 2>&1 &
    qlora=$!
    status=0
    .venv/bin/python -m pytest "${PARALLEL[@]}" tests/unit tests/integration --durations=30 | tee "$logs/main" ||
        status=${PIPESTATUS[0]}
    qlora_status=0
    wait "$qlora" || qlora_status=$?
    echo "== tests/qlora (with bitsandbytes on the path)"
    cat "$logs/qlora"
    count() { tail -n 3 "$logs/main" "$logs/qlora" | grep -o "[0-9]* $1" | awk '{ n += $1 } END { print n + 0 }'; }
    echo "tests: $(count passed) passed, $(($(count failed) + $(count error))) failed"
    rm -rf "$logs"
    [ "$status" -ne 0 ] || status=$qlora_status
    exit "$status"
fi
exec .venv/bin/python -m pytest "$@"
