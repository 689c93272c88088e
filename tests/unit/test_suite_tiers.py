"""The suite's own rules, read from the test files (no test is run or imported here).

- The CI tier (``scripts/test.sh``) proves every real component end to end and each class of fault
  ctrain claims, at least once: :data:`CI_TIER` names the test that does, and none of them may be
  moved to the full tier.
- A test in the full tier alone (``@pytest.mark.full``, or a ``pytest.param`` marked so) says in its
  docstring which CI-tier test covers the same claim (``CI tier: test_name``), or that only the full
  tier does (``only the full tier``).
- No ``pytest.importorskip``: it skips under CI too; ``tests.conftest.require`` fails there.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# What the CI tier must hold, each with the test that proves it (issue: "every real component
# still proven at each landing"). One test may carry several.
CI_TIER = {
    "the image built from the real Dockerfile": "test_image_from_the_real_dockerfile",
    "the image converted to SIF, run by an unprivileged user": "test_sif_runs_the_pinned_stack_as_an_unprivileged_user",
    "the image converted to an enroot squashfs": "test_sqsh_holds_enroot_conventions",
    "the 2-node testbed demo trained to its accuracy bar": "test_quickstart_trains_the_demo_on_two_nodes_and_passes_the_bar",
    "a job through real pyxis and enroot": "test_through_pyxis_faults_behave_as_under_apptainer",
    "the registry push and pull": "test_push_to_a_registry_and_pull_back_the_same_digest",
    "the remote path over the real sshd": "test_push_and_submit_from_a_laptop_project",
    "the pcluster schema": "test_shipped_config_passes_parallelclusters_schema",
    "fault: a node lost": "test_through_pyxis_faults_behave_as_under_apptainer",
    "fault: a rank killed": "test_faults_in_turn_each_checkpoint_resume_or_end_the_run",
    "fault: a silent node": "test_faults_in_turn_each_checkpoint_resume_or_end_the_run",
    "fault: Slurm's TERM": "test_faults_in_turn_each_checkpoint_resume_or_end_the_run",
    "fault: the time-limit warning": "test_faults_in_turn_each_checkpoint_resume_or_end_the_run",
    "fault: a deterministic failure": "test_a_nan_loss_ends_the_job_at_once_with_the_ranks_own_error",
    "fault: a damaged checkpoint": "test_faults_in_turn_each_checkpoint_resume_or_end_the_run",
}
COVERED = re.compile(r"CI tier:\s+(test_\w+)")
ONLY_FULL = "only the full tier"


@dataclass(frozen=True)
class FoundTest:
    file: Path
    name: str
    docstring: str
    full: bool  # the whole test is in the full tier alone
    full_params: bool  # some of its parameters are


def _is_full_mark(node: ast.AST) -> bool:
    """``pytest.mark.full`` (with or without a call)."""
    node = node.func if isinstance(node, ast.Call) else node
    return isinstance(node, ast.Attribute) and node.attr == "full" and ast.unparse(node) == "pytest.mark.full"


def _marks_full(node: ast.AST) -> bool:
    """Whether ``node`` (a decorator, a ``pytestmark`` value, a ``marks=`` value) holds ``pytest.mark.full``."""
    return any(_is_full_mark(child) for child in ast.walk(node))


def _tests() -> list[FoundTest]:
    found = []
    for file in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(file.read_text(), str(file))
        module_full = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and _marks_full(n.value) for n in tree.body)  # fmt: skip
        # Parameter lists kept in module constants (COMPILE = [..., pytest.param(..., marks=pytest.mark.full)]).
        full_lists = {t.id for n in tree.body if isinstance(n, ast.Assign) and _marks_full(n.value)
                      for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]

        def partly_full(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
            """Some of its parameters (or of its fixture's) are in the full tier alone."""
            return any(_marks_full(d) or any(isinstance(n, ast.Name) and n.id in full_lists for n in ast.walk(d))
                       for d in node.decorator_list if not _is_full_mark(d))  # fmt: skip

        # A fixture some of whose parameters are full-tier: its docstring speaks for the tests using it.
        fixtures = {n.name: ast.get_docstring(n) or "" for n in functions if not n.name.startswith("test_")
                    and partly_full(n)}  # fmt: skip
        for node in functions:
            if node.name.startswith("test_"):
                full = module_full or any(_is_full_mark(d) for d in node.decorator_list)
                used = [fixtures[a.arg] for a in node.args.args if a.arg in fixtures]
                docstring = "\n".join([ast.get_docstring(node) or "", *used])
                found.append(FoundTest(file, node.name, docstring, full, partly_full(node) or bool(used)))
    return found


ALL = _tests()
BY_NAME = {test.name: test for test in ALL}


@pytest.mark.parametrize("claim", CI_TIER)
def test_the_ci_tier_keeps_each_real_component_and_fault_class(claim: str) -> None:
    name = CI_TIER[claim]
    assert name in BY_NAME, f"{claim}: no test named {name} in tests/"
    assert not BY_NAME[name].full, f"{claim}: {name} is in the full tier alone; the CI tier must prove this"


def test_a_full_tier_test_names_its_ci_tier_cover_or_says_there_is_none() -> None:
    missing, wrong = [], []
    for test in ALL:
        if not (test.full or test.full_params):
            continue
        named = COVERED.findall(test.docstring)
        if not named and ONLY_FULL not in " ".join(test.docstring.lower().split()):
            missing.append(f"{test.file.name}::{test.name}")
        for name in named:
            if name not in BY_NAME or (BY_NAME[name].full and name != test.name):
                wrong.append(f"{test.file.name}::{test.name} names {name}, which is not a CI-tier test")
    assert not missing, f"full-tier tests whose docstring names no 'CI tier: test_...' nor '{ONLY_FULL}': {missing}"
    assert not wrong, wrong


def test_the_rules_see_a_full_tier_test() -> None:
    """The reader above finds the marker where the suite puts it (else the rules would hold vacuously)."""
    assert any(test.full for test in ALL) and any(test.full_params for test in ALL)


def test_no_test_skips_a_missing_module_under_ci() -> None:
    used = [str(f.relative_to(TESTS)) for f in TESTS.rglob("*.py") if "pytest." + "importorskip(" in f.read_text()]
    assert not used, f"pytest.importorskip skips under CI too; use tests.conftest.require: {used}"
