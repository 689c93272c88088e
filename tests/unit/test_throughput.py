"""The figures the README and docs/benchmarks.md quote (tokens/s, MFU) against hand-computed values, on a CPU.

MFU never runs without CUDA on its own (no datasheet peak for a CPU), so these tests state a peak:
the recipe's ``training.peak_tflops``, as a user does for a GPU the table does not know.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctrain.bench.run import figures
from ctrain.bench.spec import TINY
from tests.conftest import require

torch = require("torch")

from ctrain.train import callbacks, goodput  # noqa: E402  (imports torch's stack: after the check above)
from ctrain.train.model import FROZEN_CONVENTION, FULL_CONVENTION, flops_per_token  # noqa: E402


def _model() -> torch.nn.Module:
    """15 trained weights (a 4x3 layer with its bias) and 6 frozen ones (a 2x2 layer with its bias)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(2, 2))
    model[1].requires_grad_(False)
    return model


def test_flops_per_token_count_6_per_trained_and_4_per_frozen_weight() -> None:
    model = _model()
    assert flops_per_token(model) == (6 * 15 + 4 * 6, FROZEN_CONVENTION)
    model[1].requires_grad_(True)
    assert flops_per_token(model) == (6 * 21, FULL_CONVENTION)


def test_the_step_lines_tokens_per_second_and_mfu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """8,000 tokens in 2 s on 2 ranks is 4,000 tokens/s; at 114 FLOPs a token against a stated peak of
    1 MFLOP/s (1e-6 TFLOP/s) a GPU: 114 * 4,000 / (1e6 * 2) = 22.8 % MFU."""
    monkeypatch.delenv(goodput.TIMELINE_ENV, raising=False)
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    progress = callbacks.Progress(tmp_path, world_size=2, rank=0, peak=1e-6, memory=False, run_id="run")
    state = SimpleNamespace(num_input_tokens_seen=1000, global_step=0, max_steps=10)
    progress.on_train_begin(None, state, None, model=_model())
    state.num_input_tokens_seen, state.global_step = 9000, 1
    logs = {"loss": 1.5}
    with caplog.at_level(logging.INFO, logger="ctrain.train"):
        progress.on_log(None, state, None, logs=logs)
    assert logs["throughput/tokens_per_second"] == pytest.approx(4000.0)
    assert logs["throughput/mfu"] == pytest.approx(0.228)
    line = caplog.records[-1].getMessage()
    assert "step 1/10, loss 1.5000" in line and "4,000 tok/s" in line, line
    assert f"MFU 22.8% ({FROZEN_CONVENTION})" in line, line
    record = json.loads((tmp_path / callbacks.METRICS_FILE).read_text())
    assert record["throughput/mfu"] == pytest.approx(0.228) and record["step"] == 1


def test_no_peak_no_mfu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(goodput.TIMELINE_ENV, raising=False)
    clock = iter([0.0, 4.0])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    progress = callbacks.Progress(tmp_path, world_size=1, rank=0, peak=None, memory=False, run_id="run")
    state = SimpleNamespace(num_input_tokens_seen=0, global_step=0, max_steps=2)
    progress.on_train_begin(None, state, None, model=_model())
    state.num_input_tokens_seen, state.global_step = 100, 1
    logs = {"loss": 2.0}
    progress.on_log(None, state, None, logs=logs)
    assert logs["throughput/tokens_per_second"] == pytest.approx(25.0) and "throughput/mfu" not in logs


def test_the_peak_comes_from_the_recipe_else_the_gpus_datasheet(monkeypatch: pytest.MonkeyPatch) -> None:
    assert callbacks.peak_tflops(123.0) == 123.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert callbacks.peak_tflops(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA A100-SXM4-40GB", 312.0),
                       ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("Some Other GPU", None)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda name=name: name)
        assert callbacks.peak_tflops(None) == peak, name


def test_the_benchs_figures_from_what_a_case_measured() -> None:
    """12,000 tokens in 3 s over 4 steps on 2 devices: 4,000 tokens/s, 2,000 a device, 750 ms a step;
    at 6e9 FLOPs a token (8e9 with attention) against 1e13 FLOP/s: MFU 1.2 (1.6)."""
    got = figures(12_000, 3.0, 4, 2, 6e9, 8e9, peak=1e13)
    assert got == pytest.approx({"tokens_per_s": 4000.0, "tokens_per_s_per_device": 2000.0, "step_ms": 750.0,
                                 "mfu_6n": 1.2, "mfu_with_attention": 1.6})  # fmt: skip
    assert figures(0, 0.0, 0, 1, 6e9, 8e9)["tokens_per_s"] == 0.0


def test_the_benchs_flops_per_token_by_hand() -> None:
    """TINY: hidden 64, 2 layers, 4 heads of 16, 4 KV heads, MLP 176, vocab 512, untied:
    attention 2*64*64 + 2*64*16*4 = 16,384, MLP 3*64*176 = 33,792, norms 2*64 a layer;
    2*512*64 embeddings and head, 64 for the final norm: 166,208 weights."""
    assert TINY.parameters() == 166_208
    dense, with_attention = TINY.flops_per_token(100.0)
    assert dense == 6 * 166_208 and with_attention == 6 * 166_208 + 6 * 2 * 64 * 100
    assert TINY.flops_per_token(100.0, frozen=True)[0] == 4 * 166_208
