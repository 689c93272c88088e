"""Sharded (FSDP) checkpoints as ctrain seals, verifies and resumes them: real FSDP2 and DCP on CPU (gloo).

With ``training.fsdp`` each rank writes its own shards with torch.distributed.checkpoint
(``pytorch_model_fsdp_0/`` and ``optimizer_0/``: ``__RANK_0.distcp`` files and a ``.metadata``), as
accelerate does for ``state_dict_type: SHARDED_STATE_DICT``. These tests train a small model
fully_shard-ed over 2 processes, save and seal checkpoints as the run does, resume the newest on 1
process (another GPU count) and damage a shard to see it refused and the older checkpoint chosen.

This file is also the workers' script: ``python -m torch.distributed.run ... THIS_FILE save OUT``
(2 processes) and ``... THIS_FILE resume CHECKPOINT RESULT`` (1 process).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ctrain.train import checkpoint
from ctrain.train.artifacts import COMPLETE_MARKER

pytestmark = pytest.mark.integration

SAVED_AT = (2, 3)  # the steps after which the 2-process run saves and seals a checkpoint
STEPS = 5  # it trains on after the last one, so the resumed run has losses to match
GLOBAL_BATCH = 12
SHAPE = (8, 32, 32, 5)  # layer widths; 5 rows of the last weight shard unevenly over 2 ranks
MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's names
RANKS = 2


# --- the workers (run under torchrun; torch imported only there) ----------------------------------


def _start() -> tuple[int, int, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    return dist.get_rank(), world, init_device_mesh("cpu", (world,))


def _build(mesh: Any) -> tuple[Any, Any]:
    """The same model on every rank and in every run (same seed), each Linear sharded, then the root."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for width, following in zip(SHAPE, SHAPE[1:]):
        layers += [torch.nn.Linear(width, following), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: Any, optimizer: Any, step: int, rank: int, world: int) -> float:
    """One optimizer step on this rank's part of global batch ``step``; the global batch's loss.

    The batch depends only on the step, so any number of ranks sees the same global data; FSDP
    averages the gradients over the ranks, which is the gradient of the global mean loss.
    """
    import torch
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, SHAPE[0], generator=generator)
    y = torch.randn(GLOBAL_BATCH, SHAPE[-1], generator=generator)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _full(model: Any, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer state unsharded (gathered on rank 0, empty elsewhere), keyed by parameter name.

    Copied: on 1 process the "gathered" tensors are the live ones, which training goes on changing.
    """
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": copy.deepcopy(model_state), "optimizer": copy.deepcopy(optimizer_state)}


def _save(model: Any, optimizer: Any, directory: Path) -> None:
    """What accelerate writes for SHARDED_STATE_DICT: each rank its shards, through DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state}, checkpoint_id=directory / MODEL_DIR)
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=directory / OPTIMIZER_DIR)


def _load(model: Any, optimizer: Any, directory: Path) -> None:
    """What accelerate reads back: DCP into this run's (differently) sharded state, then set into the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    wrapped_model, wrapped_optimizer = {"model": model_state}, {"optimizer": optimizer_state}
    dcp.load(wrapped_model, checkpoint_id=directory / MODEL_DIR)
    dcp.load(wrapped_optimizer, checkpoint_id=directory / OPTIMIZER_DIR)
    set_state_dict(model, optimizer, model_state_dict=wrapped_model["model"],
                   optim_state_dict=wrapped_optimizer["optimizer"])  # fmt: skip


def save_worker(out: Path) -> None:
    """Train STEPS steps on all ranks; after each of SAVED_AT save, seal and verify ``out/checkpoint-STEP``."""
    import torch
    import torch.distributed as dist

    rank, world, mesh = _start()
    model, optimizer = _build(mesh)
    record: dict[str, Any] = {"initial": _full(model, optimizer)["model"], "losses": {}, "seal": {}, "verify": {}}
    for step in range(1, STEPS + 1):
        record["losses"][step] = _step(model, optimizer, step, rank, world)
        if step in SAVED_AT:
            directory = out / f"checkpoint-{step}"
            _save(model, optimizer, directory)
            dist.barrier()  # as ctrain's callback waits for every rank's files before sealing
            damage = checkpoint.seal(directory, {"step": step, "world_size": world}, rank, world)
            verdict = checkpoint.verify(directory, rank, world)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (str(damage), str(verdict.damage)))
            record["seal"][step] = [seal for seal, _ in everyone]
            record["verify"][step] = [found for _, found in everyone]
            record[f"state-{step}"] = _full(model, optimizer)
    if rank == 0:
        torch.save(record, out / "run-2-ranks.pt")
    dist.destroy_process_group()


def resume_worker(directory: Path, result: Path) -> None:
    """On 1 process: verify ``directory``, load it into a fresh sharded model, train on to STEPS."""
    import torch
    import torch.distributed as dist

    rank, world, mesh = _start()
    verdict = checkpoint.verify(directory, rank, world)
    model, optimizer = _build(mesh)
    before = _full(model, optimizer)["model"]
    _load(model, optimizer, directory)
    loaded = _full(model, optimizer)
    start = checkpoint.step_of(directory) or 0
    losses = {step: _step(model, optimizer, step, rank, world) for step in range(start + 1, STEPS + 1)}
    torch.save({"damage": str(verdict.damage), "checksummed": verdict.checksummed, "files": verdict.files,
                "world": world, "before": before, "loaded": loaded, "losses": losses}, result)  # fmt: skip
    dist.destroy_process_group()


# --- the tests ------------------------------------------------------------------------------------


def torchrun(processes: int, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    from tests.plugins.train import REPO, train_env

    env = {**train_env(cwd), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               __file__, *args]  # fmt: skip
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


@dataclass(frozen=True)
class Run:
    out: Path  # checkpoint-2 and checkpoint-3, sealed by 2 ranks
    record: dict[str, Any]  # what rank 0 recorded (save_worker)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The 2-process run, once for the module; the tests copy its checkpoints before changing them."""
    import torch

    work = tmp_path_factory.mktemp("sharded")
    out = work / "out"
    torchrun(RANKS, "save", str(out), cwd=work)
    record = torch.load(out / "run-2-ranks.pt", weights_only=False)
    (out / "run-2-ranks.pt").unlink()  # the output directory holds the checkpoints only
    return Run(out, record)


def test_two_ranks_write_and_seal_sharded_checkpoints(sharded_run: Run) -> None:
    record = sharded_run.record
    for step in SAVED_AT:
        directory = sharded_run.out / f"checkpoint-{step}"
        assert record["seal"][step] == ["None"] * RANKS, f"seal found damage in {directory}"
        assert record["verify"][step] == ["None"] * RANKS, f"verify on {RANKS} ranks found damage in {directory}"
        files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        shards = [f"__{rank}_0.distcp" for rank in range(RANKS)]
        expected = sorted(f"{part}/{name}" for part in (MODEL_DIR, OPTIMIZER_DIR) for name in [".metadata", *shards])
        assert files == [COMPLETE_MARKER, *expected], "not the layout of a sharded checkpoint"
        marker = checkpoint.read_marker(directory)
        assert marker is not None
        assert (marker["step"], marker["world_size"], marker["files"]) == (step, RANKS, len(expected))
        manifest = marker["manifest"]
        assert sorted(manifest) == expected
        for name, (size, crc) in manifest.items():
            assert size == (directory / name).stat().st_size > 0, name
            assert crc == checkpoint.file_digest(directory / name), name
    assert checkpoint.scan(sharded_run.out).complete == [sharded_run.out / f"checkpoint-{s}" for s in (3, 2)]


def test_resume_on_one_process_continues_the_two_process_run(sharded_run: Run, tmp_path: Path) -> None:
    """Resharding from 2 ranks to 1: same parameters and optimizer state, then the same losses."""
    import torch

    directory = sharded_run.out / f"checkpoint-{SAVED_AT[-1]}"
    result_path = tmp_path / "resumed.pt"
    torchrun(1, "resume", str(directory), str(result_path), cwd=tmp_path)
    resumed = torch.load(result_path, weights_only=False)
    assert resumed["world"] == 1
    assert resumed["damage"] == "None" and resumed["checksummed"] and resumed["files"] == 6

    saved = sharded_run.record[f"state-{SAVED_AT[-1]}"]
    assert sorted(resumed["loaded"]["model"]) == sorted(saved["model"]) == sorted(resumed["before"])
    for name, tensor in saved["model"].items():
        assert not torch.equal(resumed["before"][name], tensor), f"{name}: training did not change it"
        assert torch.equal(resumed["loaded"]["model"][name], tensor), f"{name} differs after loading on 1 process"

    def tensors(state: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(state, torch.Tensor):
            return {prefix: state}
        if isinstance(state, dict):
            return {k: v for key, value in state.items() for k, v in tensors(value, f"{prefix}/{key}").items()}
        if isinstance(state, list):
            return {k: v for i, value in enumerate(state) for k, v in tensors(value, f"{prefix}/{i}").items()}
        return {prefix: state}

    saved_optimizer, loaded_optimizer = tensors(saved["optimizer"]), tensors(resumed["loaded"]["optimizer"])
    assert sorted(loaded_optimizer) == sorted(saved_optimizer)
    assert any(key.endswith("/exp_avg_sq") for key in saved_optimizer)
    for key, value in saved_optimizer.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded_optimizer[key], value), f"optimizer {key} differs after loading on 1 process"
        else:
            assert loaded_optimizer[key] == value, key

    expected = [sharded_run.record["losses"][step] for step in range(SAVED_AT[-1] + 1, STEPS + 1)]
    got = [resumed["losses"][step] for step in range(SAVED_AT[-1] + 1, STEPS + 1)]
    assert len(got) == 2
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7), "the resumed run does not continue the 2-rank run"


DAMAGED_SHARD = f"{OPTIMIZER_DIR}/__1_0.distcp"  # rank 1's optimizer shard


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size - 100)


DAMAGE = [("intact", None, None), ("flipped byte", _flip, "checksum"), ("truncated", _truncate, "size")]


@pytest.mark.parametrize(("harm", "reason"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_damaged_shard_is_refused_and_the_older_checkpoint_chosen(sharded_run: Run, tmp_path: Path, harm: Any,
                                                                  reason: str | None) -> None:  # fmt: skip
    out = tmp_path / "out"
    shutil.copytree(sharded_run.out, out)
    newer, older = out / "checkpoint-3", out / "checkpoint-2"
    if harm is not None:
        harm(newer / DAMAGED_SHARD)

    verdict = checkpoint.verify(newer, 0, 1)
    if reason is None:
        assert verdict.damage is None and verdict.checksummed
    else:
        assert verdict.damage is not None, "damage in a .distcp shard went unnoticed"
        assert (verdict.damage.file, verdict.damage.reason) == (DAMAGED_SHARD, reason)
    assert checkpoint.verify(older, 0, 1).damage is None

    found = checkpoint.scan(out)
    assert found.complete == [newer, older] and found.torn == []  # the marker is intact: only verify can tell
    chosen = checkpoint.choose(found, 0, 1)
    if reason is None:
        assert chosen == newer
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-3"]
        return
    assert chosen == older
    moved = out / f"checkpoint-3.damaged-{reason}"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", moved.name]  # moved aside, not deleted
    assert (moved / DAMAGED_SHARD).is_file() and (moved / COMPLETE_MARKER).is_file()
    assert checkpoint.scan(out).complete == [older]
    assert checkpoint.verify(older, 0, 1).damage is None


if __name__ == "__main__":
    from ctrain.train.logs import exit_process

    if sys.argv[1] == "save":
        save_worker(Path(sys.argv[2]))
    elif sys.argv[1] == "resume":
        resume_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
    # Ended as ctrain train ends its ranks: a gloo thread still joinable at C++ teardown would abort a
    # worker that finished (SIGABRT, "terminate called without an active exception"; docs/reliability.md).
    exit_process(0)
