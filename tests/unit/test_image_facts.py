"""What an image says it is (ctrain.image.facts): the oldest driver each CUDA runs on, the line ctrain
prints, and a facts file that is not one."""

from __future__ import annotations

import json

import pytest

from ctrain.image import facts


@pytest.mark.parametrize(("cuda", "driver"), [
    ("13.0", "580.65.06"), ("12.8", "525.60.13"), ("11.8", "450.80.02"), (None, None), ("99.1", None), ("x", None),
])  # fmt: skip
def test_the_oldest_driver_a_cuda_runs_on(cuda: str | None, driver: str | None) -> None:
    assert facts.min_driver(cuda) == driver


def test_the_line_says_the_versions_and_the_driver_the_nodes_need() -> None:
    gpu = {"ctrain": "0.1.0", "torch": "2.9.1+cu130", "cuda": "13.0", "min_driver": "580.65.06"}
    assert facts.describe(gpu) == "ctrain 0.1.0, torch 2.9.1+cu130, CUDA 13.0 (NVIDIA driver 580.65.06 or newer on the nodes)"
    assert facts.describe({"ctrain": "0.1.0", "torch": "2.9.1+cpu", "cuda": None}) == "ctrain 0.1.0, torch 2.9.1+cpu, CPU only"


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"[1, 2]", b"{not json", b""])
def test_a_file_that_is_no_facts_file_says_nothing(raw: bytes) -> None:
    assert facts.parse(raw) is None


def test_only_the_known_facts_as_strings_are_kept() -> None:
    raw = json.dumps({"ctrain": "0.1.0", "torch": ["x"], "cuda": None, "other": "y"}).encode()
    assert facts.parse(raw) == {"ctrain": "0.1.0", "cuda": None}
