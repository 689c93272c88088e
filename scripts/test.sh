#!/usr/bin/env bash
# Set up everything and run the tests: unit tests, then integration tests against real tools (a
# Slurm testbed, Apptainer, buildah, pyxis and enroot, a local registry, sshd). Run as root.
#   scripts/test.sh --quick   unit tests and one job on the testbed: while editing (minutes)
#   scripts/test.sh           the CI tier (what CI runs): the unit and contract tests, every real
#                             component end to end and one testbed test for each class of fault
#   scripts/test.sh --full    the full tier: every test, the CI tier's included; before an issue that
#                             touches the supervisor, the library, the testbed or training is resolved
#   scripts/test.sh ARGS      pytest ARGS (e.g. scripts/test.sh tests/unit -k recipe)
# A test is in the full tier alone when it carries the `full` marker (pyproject.toml); its docstring
# names the CI-tier test that covers its claim, or says that only the full tier does.
set -euo pipefail
cd "$(dirname "$0")/.."
# .ci/run sets up and cleans the slate first, and says so (CTRAIN_SET_UP=1): no second set-up.
[ "${CTRAIN_SET_UP:-}" = 1 ] || scripts/setup.sh
# A missing prerequisite fails the run instead of skipping tests.
export CTRAIN_STRICT=1
# Two pytest-xdist workers: the tests that use the testbed run in one of them, in order (one
# xdist group, tests/conftest.py), while the other runs the rest, so the testbed's waiting (Slurm,
# grace periods, fault timers) overlaps with the tests that compute.
PARALLEL=(-n 2 --dist loadgroup)
# QLoRA's 4-bit layers are tested in a process of their own with bitsandbytes (.venv/qlora,
# scripts/setup.sh) on its path, so that the other tests run as they would without it.
tier=()
case "${1:-}" in
--quick)
    shift
    exec .venv/bin/python -m pytest "${PARALLEL[@]}" tests/unit "tests/integration/test_sbatch.py::test_single_node_apptainer" \
        --durations=10 "$@"
    ;;
--full)
    shift
    tier=(-m "")
    [ "$#" -eq 0 ] || { echo "scripts/test.sh --full takes no pytest arguments" >&2; exit 2; }
    ;;
"") ;;
*) exec .venv/bin/python -m pytest "$@" ;;
esac
# tests/qlora (about a minute of compiling) beside the main run; its report follows the main one,
# and one line after both adds them up.
logs=$(mktemp -d)
PYTHONPATH=.venv/qlora CTRAIN_SUITE_TIMES= .venv/bin/python -m pytest -p no:cacheprovider tests/qlora >"$logs/qlora" 2>&1 &
qlora=$!
status=0
.venv/bin/python -m pytest "${PARALLEL[@]}" "${tier[@]}" tests/unit tests/integration --durations=20 | tee "$logs/main" ||
    status=${PIPESTATUS[0]}
qlora_status=0
wait "$qlora" || qlora_status=$?
echo "== tests/qlora (with bitsandbytes on the path)"
cat "$logs/qlora"
count() { tail -n 3 "$logs/main" "$logs/qlora" | { grep -o "[0-9]* $1" || true; } | awk '{ n += $1 } END { print n + 0 }'; }
skipped=$(count skipped)
echo "tests: $(count passed) passed, $(($(count failed) + $(count error))) failed, $skipped skipped"
rm -rf "$logs"
[ "$status" -ne 0 ] || status=$qlora_status
# Strict mode turns a missing prerequisite into a failure, so a skip here is a test that did not run.
if [ "$skipped" -ne 0 ]; then
    echo "error: $skipped test(s) skipped; every test of a tier runs (the 'SKIPPED' lines above say why)" >&2
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
