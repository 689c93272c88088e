"""Fixtures for train tests: a tiny recipe and ways to run `ctrain train` as users do (one process, torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ctrain.testbed import Testbed

REPO = Path(__file__).resolve().parents[2]

# The demo's shape at a size that trains in seconds: same data, same tokenizer training, same trainer.
TINY_RECIPE = """\
task: sft
seed: 7
model:
  config: llama
  config_overrides:
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 2
    num_attention_heads: 2
    num_key_value_heads: 2
    max_position_embeddings: 64
    tie_word_embeddings: true
tokenizer:
  train:
    vocab_size: 300
data:
  source: builtin:addition
  max_examples: 1024
  eval_size: 64
  max_length: 64
  packing: false
training:
  global_batch_size: 16
  max_steps: 40
  learning_rate: 1.0e-3
  logging_steps: 1
  save_steps: 10
logging:
  report_to: []
"""


def train_env(tmp: Path) -> dict[str, str]:
    """The environment of a training subprocess: offline, caches under ``tmp``, no inherited output root."""
    launcher = {"CTRAIN_OUTPUT_DIR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf-datasets"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass(frozen=True)
class Quickstart:
    """What ``scripts/quickstart.sh`` did: its process, whether it left the testbed up, and
    ``work``, which holds a copy of the model it trained (``outputs/demo-addition``)."""

    result: subprocess.CompletedProcess[str]
    testbed_up: bool
    work: Path


def _seed_wheelhouse(wheels: Path, directory: Path) -> None:
    """Give ``directory`` (the quickstart's wheelhouse) the suite's wheels of the same pins, linked, if it
    holds none: ``ctrain wheelhouse`` then keeps them, as on a user's second run, instead of downloading
    the same 335 MB again (the slowest and least steady step of a CI run)."""
    if any(directory.glob("*.whl")):
        return
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in wheels.glob("*.whl"):
        try:
            os.link(wheel, directory / wheel.name)
        except OSError:  # another file system
            shutil.copy2(wheel, directory / wheel.name)


@pytest.fixture(scope="session")
def quickstart(testbed: Testbed, cpu_image: Any, test_wheelhouse: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Quickstart:  # fmt: skip
    """The README's first command, run once as a user runs it: the demo trained to its bar on 2
    nodes x 2 processes of the testbed. The tests that need a trained demo model read a copy of
    it (the testbed's shared directory belongs to its job user), so the demo trains once.

    The suite's longest item (about 4.5 minutes on 2 cores, more than 5 on a slower machine): it
    builds its own image from its own wheelhouse, as a new user's machine does, and trains the
    800 steps the accuracy bar needs; what it proves is the whole path, so it is not cut. It starts
    once the suite's own image (``cpu_image``, the same Dockerfile and base) is built: its build then
    finds every layer in buildah's cache instead of building the same layers beside it at once; and its
    wheelhouse holds the suite's wheels (``test_wheelhouse``, made by the same ``ctrain wheelhouse``)."""
    _seed_wheelhouse(test_wheelhouse, REPO / ".ctrain" / "wheels")
    result = subprocess.run(
        [REPO / "scripts" / "quickstart.sh"], capture_output=True, text=True, timeout=2400, check=False
    )
    work = tmp_path_factory.mktemp("demo")
    trained = testbed.shared_dir / "demo" / "outputs" / "demo-addition"
    if result.returncode == 0:
        shutil.copytree(trained, work / "outputs" / "demo-addition", ignore=shutil.ignore_patterns("checkpoint-*"))
    return Quickstart(result, testbed.is_up(), work)


@pytest.fixture(scope="session")
def demo_run(quickstart: Quickstart) -> Path:
    """The demo recipe trained once, as the README runs it (``outputs/demo-addition`` in the
    returned directory); the tests that read it must not change it."""
    result = quickstart.result
    assert result.returncode == 0, f"the quickstart failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return quickstart.work


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    return path


def run_ctrain(
    cwd: Path, *args: str, timeout: float = 600, launcher: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ctrain ARGS`` (under ``launcher`` if given) in ``cwd``; the finished process, output captured."""
    command = [*launcher, *(["-m", "ctrain"] if launcher else [sys.executable, "-m", "ctrain"]), *args]
    return subprocess.run(command, check=False, cwd=cwd, env=train_env(cwd), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture
def ctrain(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """:func:`run_ctrain` in ``tmp_path``."""

    def run(*args: str, timeout: float = 600, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        return run_ctrain(tmp_path, *args, timeout=timeout, launcher=launcher)

    return run


def losses(output_dir: Path) -> dict[str, dict[int, float]]:
    """Training loss per step, per run (a resumed run appends to metrics.jsonl under its own run id)."""
    runs: dict[str, dict[int, float]] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            runs.setdefault(record["run"], {})[record["step"]] = record["loss"]
    return runs


def assert_same_state(ours: object, theirs: object, where: str) -> None:
    """Nested state (dicts, lists, tensors, numbers) equal value for value, tensors bit for bit."""
    import torch

    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs) and ours.dtype == theirs.dtype, where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), where
        for key in theirs:
            assert_same_state(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_state(a, b, f"{where}/{index}")
    else:
        assert ours == theirs, where


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def start(args: list[str], cwd: Path, log: Path, launcher: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Start ``ctrain ARGS`` in the background, output to ``log``."""
    command = [*launcher, *(["-m", "ctrain"] if launcher else [sys.executable, "-m", "ctrain"]), *args]
    with log.open("wb") as handle:
        return subprocess.Popen(command, cwd=cwd, env=train_env(cwd), stdout=handle, stderr=subprocess.STDOUT)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[bytes], what: str, timeout: float = 300) -> None:
    """Poll until ``condition`` holds; fail if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
