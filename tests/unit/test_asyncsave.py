"""The background writer's parts without a Trainer: the host copies a save writes from, and the
one thread that writes and seals (the runs are in tests/integration/test_train.py)."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import require


def test_staged_copies_hold_the_values_of_the_save_and_tied_tensors_stay_tied() -> None:
    require("torch")
    import torch

    from ctrain.train.asyncsave import Staging

    weight = torch.arange(6.0).reshape(2, 3)
    state = {"embed.weight": weight, "head.weight": weight, "bias": torch.ones(3), "step": 4, "groups": [{"lr": 0.1}]}
    staging = Staging(pin=False)
    copied = staging.copy("model", state)
    weight.add_(100)  # training goes on while the copy is written
    assert copied["embed.weight"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert copied["embed.weight"] is copied["head.weight"], "a tied pair must be written as one tensor"
    assert copied["bias"] is not state["bias"] and copied["step"] == 4 and copied["groups"] == [{"lr": 0.1}]
    assert staging.bytes == (6 + 3) * 4

    again = staging.copy("model", state)  # the next save reuses the buffers: no new host memory
    assert again["embed.weight"].data_ptr() == copied["embed.weight"].data_ptr()
    assert again["embed.weight"][0, 0].item() == 100.0 and staging.bytes == (6 + 3) * 4
    staging.copy("optimizer", {"state": {0: {"exp_avg": torch.zeros(3)}}})
    assert staging.bytes == (6 + 3 + 3) * 4, "another name's tensors must get buffers of their own"


def test_buffers_reserved_before_the_first_save_are_the_ones_it_copies_into() -> None:
    require("torch")
    import torch

    from ctrain.train.asyncsave import Staging

    state = {"exp_avg": torch.randn(4, 4), "step": torch.tensor(3.0)}
    staging = Staging(pin=False)
    staging.reserve("optimizer", state)
    assert staging.bytes == (16 + 1) * 4
    reserved = {key: buffer.data_ptr() for key, buffer in staging._buffers.items()}
    copied = staging.copy("optimizer", state)
    assert {key: buffer.data_ptr() for key, buffer in staging._buffers.items()} == reserved
    assert torch.equal(copied["exp_avg"], state["exp_avg"]) and copied["step"].item() == 3.0


def test_host_room_reads_this_machines_free_memory() -> None:
    from ctrain.train.asyncsave import host_room

    room = host_room()
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    assert room is not None and 0 < room <= available * 1.1


def test_the_writer_runs_jobs_in_order_one_at_a_time_and_hands_a_failure_to_the_main_thread() -> None:
    from ctrain.train.asyncsave import Writer

    writer = Writer()
    release, done = threading.Event(), []
    writer.submit(lambda: (release.wait(10), done.append("write")))
    writer.submit(lambda: done.append("seal"))
    assert writer.busy and done == []
    release.set()
    writer.wait()
    assert done == ["write", "seal"] and not writer.busy

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    writer.submit(lambda: done.append("sealed after a failed write"))
    writer.wait(raise_errors=False)
    assert done == ["write", "seal"], "a checkpoint whose write failed must not be sealed"
    with pytest.raises(OSError, match="No space left"):
        writer.check()
    writer.check()  # raised once
    writer.submit(lambda: done.append("next"))
    writer.wait()
    assert done[-1] == "next"
    writer.close()
