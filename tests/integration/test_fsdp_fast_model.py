"""The fast engine's model sharded with FSDP2 computes the loss, gradients and AdamW step it computes unsharded.

With ``training.fsdp`` ctrain trains a transformers Llama switched to the fast path
(``ctrain.fast.prepare_model``: document-masked varlen attention, decoder layers compiled or not),
with TRL's fused LM head added (``add_fused_lm_head``, as ``SFTTrainer`` does) and its loss taken as
``FastSFTTrainer.compute_loss`` takes it; accelerate then shards it (``fsdp2_prepare_model``):
``fully_shard`` on each decoder layer, on the input embeddings, one group ``[final norm, lm_head]``
kept unsharded after its forward, then the root. TRL's fused head never calls the ``lm_head``
module: it reads ``lm_head.weight`` directly, while FSDP gathers and reduces that weight through
the hooks of its group. These tests check that no gradient is lost or changed by that.

Accelerate runs FSDP on GPUs only, so its own ``fsdp2_prepare_model`` is called here with a stand-in
Accelerator on 2 CPU processes (gloo), with the plugin transformers builds from ctrain's
``FSDP_DEFAULTS`` and the default (float32) mixed precision policy. Both ranks get the same packed
batch: FSDP averages their (equal) gradients, which is the single batch's gradient, so every rank
compares its model with an unsharded copy (eager layers) that took the same steps. Then, as a control,
rank 1 takes another batch: the comparison must fail for every group of parameters.

Eager decoder layers in the CI tier; compiled ones (``fast.compile: layers``) in the full tier.
This file is also the workers' script: ``python -m torch.distributed.run ... THIS_FILE COMPILE OUT``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

RANKS = 2
DOCUMENTS = ((13, 4), (21, 6), (9, 3))  # (length, prompt tokens without labels) of the packed batch's documents
LR = 1e-3
# Loss and gradients: float32 on both sides, rounding apart. Eager layers run the same kernels on the same
# values and match bitwise (FSDP's mean of 2 equal gradients is exact); compiled ones fuse differently,
# measured up to 6e-8 off in gradients of up to 0.15. A lost or wrong gradient is off by its own size
# (the gradients' largest elements are 7e-4 to 0.15); in the control, each group's is off by 7e-3 or more.
RTOL, ATOL = 1e-5, 1e-6
# Parameters after one AdamW step: its first step moves each element by about LR * g / (|g| + eps), so a
# rounding difference in a gradient near eps (1e-8) comes out larger in the parameter (compiled layers:
# 3e-6 measured), while a lost or wrong gradient moves elements by about LR. A hundredth of LR.
PARAM_ATOL = LR / 100
GROUPS = ("embed_tokens", "layers", "norm", "lm_head")


# --- the workers (run under torchrun; torch imported only there) ----------------------------------


def _tiny_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=300, max_position_embeddings=256,
                         tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config).float()
    # A fresh model's norms are all ones: make every parameter a random one, so no gradient is special.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _batch(seed: int) -> dict[str, Any]:
    """A padding-free packed row of DOCUMENTS as TRL's collator gives it, prompts without labels."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    generator = torch.Generator().manual_seed(seed)
    examples = [{"input_ids": torch.randint(5, 300, (n,), generator=generator).tolist(),
                 "completion_mask": [0] * prompt + [1] * (n - prompt)} for n, prompt in DOCUMENTS]  # fmt: skip
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    batch.pop("seq_idx")  # as tests/unit/test_fast.py: the model takes the rest
    return batch


def _loss(model: Any, batches: list[dict[str, Any]], world: int = 1) -> Any:
    """FastSFTTrainer.compute_loss's loss: -sum(log_probs) over the label tokens, divided by the Trainer's
    ``num_items_in_batch`` (label tokens of all ranks, ``average_tokens_across_devices``) and multiplied by
    ``world``. The unsharded copy (``world`` 1) takes the batches of all ranks at once."""
    import torch.distributed as dist

    total, count = 0, 0
    for batch in batches:
        outputs = model(**batch, use_cache=False, fused_lm_head=True)
        for field in ("log_probs", "label_mask", "entropy", "is_top1"):
            assert getattr(outputs, field) is not None, f"the fused head gave no {field}"
        labels = (batch["labels"][:, 1:] != -100).sum()
        assert int(labels) == int(outputs.label_mask.sum()) > 0
        total, count = total - outputs.log_probs.sum(), count + labels
    if world > 1:
        dist.all_reduce(count)
    return total / count * world


def _full(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _diffs(sharded: Any, reference: Any, what: str) -> dict[str, dict[str, float]]:
    """Per parameter (its gradient or, with ``what="param"``, its value): max |sharded - reference|,
    max |reference|, max |sharded| and whether they are close (RTOL and ATOL, values PARAM_ATOL)."""
    import torch

    rtol, atol = (RTOL, ATOL) if what == "grad" else (0.0, PARAM_ATOL)
    out = {}
    for (name, param), (ref_name, ref) in zip(sharded.named_parameters(), reference.named_parameters()):
        assert name == ref_name, (name, ref_name)
        a, b = (param.grad, ref.grad) if what == "grad" else (param, ref)
        if a is None or b is None:
            out[name] = {"missing": float(a is None) + 2 * float(b is None)}
            continue
        a, b = _full(a), b.detach()
        out[name] = {"max_abs_diff": float((a - b).abs().max()), "ref_max": float(b.abs().max()),
                     "max": float(a.abs().max()),
                     "close": bool(torch.allclose(a, b, rtol=rtol, atol=atol))}  # fmt: skip
    return out


class _Accelerator:
    """What ``fsdp2_prepare_model`` reads of an Accelerator, for fp32 training on the default mesh."""

    def __init__(self, plugin: Any, rank: int) -> None:
        import torch

        self.state = type("State", (), {"fsdp_plugin": plugin})()
        self.torch_device_mesh = None  # fully_shard's default: every rank of the process group
        self.mixed_precision = "no"
        self.is_main_process = rank == 0
        self.device = torch.device("cpu")


def _shard(model: Any, rank: int) -> dict[str, Any]:
    """Accelerate's FSDP2 wrapping of ``model`` with ctrain's settings; returns how it grouped the parameters."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule

    from ctrain.train.recipe import FSDP_DEFAULTS

    # The plugin TrainingArguments builds from fsdp_config (transformers' _process_fsdp_args).
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=FSDP_DEFAULTS["version"], auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        reshard_after_forward=FSDP_DEFAULTS["reshard_after_forward"], cpu_ram_efficient_loading=False,
        state_dict_type=FSDP_DEFAULTS["state_dict_type"],
    )  # fmt: skip
    assert fsdp2_prepare_model(_Accelerator(plugin, rank), model) is model

    names = {id(param): name for name, param in model.named_parameters()}
    groups = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            groups[name or "<root>"] = {
                "group": id(group) if group is not None else None,
                "params": sorted(names[id(p.sharded_param)] for p in group.fsdp_params) if group is not None else [],
                "reshard_after_forward": group is not None and group.post_forward_mesh_info is not None,
            }
    from types import SimpleNamespace

    import torch
    from torch.distributed.fsdp import fully_shard

    from ctrain.fast.trainer import fused_head_problem

    lone = torch.nn.Linear(4, 4)  # an output head sharded alone: what the fast engine's guard refuses
    fully_shard(lone)  # the default mesh, as accelerate's (every rank)
    guard = {"accelerate's grouping": fused_head_problem(model),
             "head alone": fused_head_problem(SimpleNamespace(get_output_embeddings=lambda: lone))}
    tail = groups.get("lm_head", {}).get("group")
    return {"groups": {name: {k: v for k, v in g.items() if k != "group"} for name, g in groups.items()},
            "lm_head_shares_norm_group": tail is not None and groups.get("model.norm", {}).get("group") == tail,
            "guard": guard,
            "layers": model.config.num_hidden_layers}  # fmt: skip


def worker(compile_mode: str, out: Path) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from trl.trainer.utils import add_fused_lm_head

    from ctrain.fast import FastSettings, prepare_model

    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    # As ctrain's build_trainer, then SFTTrainer.__init__; the reference's layers are never compiled.
    prepare_model(model, FastSettings(compile=compile_mode), "cpu")
    prepare_model(reference, FastSettings(compile="off"), "cpu")
    for each in (model, reference):
        add_fused_lm_head(each, outputs=("log_probs", "entropy", "is_top1"))
    wrapping = _shard(model, rank)
    record: dict[str, Any] = {"wrapping": wrapping, "attn": model.config._attn_implementation, "seconds": {}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    batch, other = _batch(1), _batch(2)

    tick = time.perf_counter()
    loss = _loss(model, [batch], world)
    record["lm_head_weight_after_forward"] = type(model.lm_head.weight).__name__
    loss.backward()
    ref_loss = _loss(reference, [batch])
    ref_loss.backward()
    record["seconds"]["first forward+backward (both models)"] = time.perf_counter() - tick
    record["loss"] = {"sharded": loss.item(), "reference": ref_loss.item()}
    record["grad"] = _diffs(model, reference, "grad")
    record["grad_is_dtensor"] = {n: isinstance(p.grad, DTensor) for n, p in model.named_parameters()}

    optimizer.step()
    ref_optimizer.step()
    record["param"] = _diffs(model, reference, "param")

    # Control: after the step, rank 0 keeps the batch and rank 1 takes another one. The sharded model's
    # gradients are then those of both batches' token mean (FSDP's average over the ranks): the reference's
    # on rank 0's batch alone must differ, its on both batches must not.
    optimizer.zero_grad()
    ref_optimizer.zero_grad()
    tick = time.perf_counter()
    control = _loss(model, [batch if rank == 0 else other], world)
    control.backward()
    global_loss = control.detach().clone()
    dist.all_reduce(global_loss)
    ref_alone = _loss(reference, [batch])
    ref_alone.backward()
    record["control_grad"] = _diffs(model, reference, "grad")
    ref_optimizer.zero_grad()
    ref_both = _loss(reference, [batch, other])
    ref_both.backward()
    record["seconds"]["second forward+backward (both models)"] = time.perf_counter() - tick
    record["mean_grad"] = _diffs(model, reference, "grad")
    record["control_loss"] = {"sharded": global_loss.item() / world, "reference": ref_both.item(),
                              "reference_rank_0_batch": ref_alone.item()}  # fmt: skip
    record["seconds"]["worker"] = time.perf_counter() - started
    if rank == 0:
        out.write_text(json.dumps(record, indent=1))
    dist.destroy_process_group()


# --- the tests ------------------------------------------------------------------------------------


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    from tests.plugins.train import REPO, train_env

    env = {**train_env(cwd), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCHINDUCTOR_CACHE_DIR": str(cwd / "inductor")}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               __file__, *args]  # fmt: skip
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


# Compiled layers (inductor, as on GPUs) take 2 min here (1 min 50 s of it compiling, on 2 busy cores): the
# full tier.
COMPILE = ["off", pytest.param("layers", marks=pytest.mark.full)]


@pytest.fixture(scope="module", params=COMPILE, ids=["eager", "compiled"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-process run, once per compile setting; what rank 0 recorded. The compiled run is in the full
    tier alone; CI tier: test_compiled_layers_share_one_graph_and_do_not_recompile (compiled layers, one
    process) and these tests' eager run."""
    work = tmp_path_factory.mktemp(f"fsdp-{request.param}")
    started = time.perf_counter()
    torchrun(request.param, str(work / "result.json"), cwd=work)
    record = json.loads((work / "result.json").read_text())
    record["seconds"]["torchrun"] = time.perf_counter() - started
    print(f"compile={request.param}: {json.dumps(record['seconds'])}")
    return record


def group_of(name: str) -> str:
    """embed_tokens, layers, norm or lm_head."""
    return name.removeprefix("model.").split(".")[0]


def worst(diffs: dict[str, dict[str, float]]) -> dict[str, float]:
    """Max abs difference per parameter group."""
    out: dict[str, float] = {}
    for name, d in diffs.items():
        group = group_of(name)
        out[group] = max(out.get(group, 0.0), d.get("max_abs_diff", float("inf")))  # inf: a gradient missing
    return out


def test_the_model_is_wrapped_as_accelerate_wraps_it(run: dict[str, Any]) -> None:
    wrapping = run["wrapping"]
    groups = wrapping["groups"]
    layers = [f"model.layers.{i}" for i in range(wrapping["layers"])]
    assert sorted(groups) == sorted(["<root>", "model.embed_tokens", *layers, "model.norm", "lm_head"])
    for layer in layers:
        assert groups[layer]["reshard_after_forward"], layer
        assert groups[layer]["params"] and all(p.startswith(layer) for p in groups[layer]["params"])
    assert groups["model.embed_tokens"]["params"] == ["model.embed_tokens.weight"]
    assert wrapping["lm_head_shares_norm_group"], "norm and lm_head are not one FSDP group"
    # The fast engine's guard lets accelerate's grouping train and refuses a head sharded alone.
    assert wrapping["guard"]["accelerate's grouping"] is None
    assert "output head of SimpleNamespace is an FSDP unit of its own" in wrapping["guard"]["head alone"]
    assert groups["lm_head"]["params"] == ["lm_head.weight", "model.norm.weight"]
    assert not groups["lm_head"]["reshard_after_forward"]
    assert groups["<root>"]["params"] == []  # every parameter is in a group of its own module
    assert run["attn"] == "ctrain_varlen"
    # The fused head ran after the tail group's pre-forward had gathered the weight (a plain tensor).
    assert run["lm_head_weight_after_forward"] != "DTensor"


def test_sharded_loss_and_gradients_equal_the_unsharded_ones(run: dict[str, Any]) -> None:
    loss = run["loss"]
    assert loss["sharded"] == pytest.approx(loss["reference"], rel=RTOL, abs=ATOL)
    grads = run["grad"]
    assert len(grads) == 2 + 9 * run["wrapping"]["layers"] + 1  # embeddings, 9 per layer, norm, lm_head
    missing = {name: d for name, d in grads.items() if "missing" in d}
    assert not missing, f"gradients missing (1: sharded, 2: reference, 3: both): {missing}"
    assert all(run["grad_is_dtensor"].values()), "a sharded parameter's gradient is not a sharded DTensor"
    wrong = {name: d for name, d in grads.items() if not d.get("close")}
    assert not wrong, f"sharded gradients differ from the unsharded ones: {wrong}"
    for name, d in grads.items():
        assert d["ref_max"] > 0, f"{name}: zero gradient, nothing compared"


def test_lm_head_and_embeddings_get_matching_nonzero_gradients(run: dict[str, Any]) -> None:
    """The fused head reads lm_head.weight without calling lm_head: its gradient must still arrive."""
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        d = run["grad"][name]
        assert d["max"] > 1e-4 and d["ref_max"] > 1e-4, f"{name}: no gradient ({d})"
        assert d["close"] and d["max_abs_diff"] <= ATOL, f"{name}: sharded gradient differs ({d})"


def test_one_adamw_step_updates_the_shards_as_the_unsharded_model(run: dict[str, Any]) -> None:
    wrong = {name: d for name, d in run["param"].items() if not d.get("close")}
    assert not wrong, f"parameters differ after one AdamW step: {wrong}"
    # The updated shards give the updated reference's loss (of both ranks' batches: the control run).
    control = run["control_loss"]
    assert control["reference_rank_0_batch"] != pytest.approx(run["loss"]["reference"], rel=1e-4), "no step"
    assert control["sharded"] == pytest.approx(control["reference"], rel=RTOL, abs=ATOL)


def test_two_ranks_with_two_batches_get_the_gradients_of_both(run: dict[str, Any]) -> None:
    """Control, first half: FSDP really averages over the ranks, lm_head's and embed_tokens' gradients too.

    With equal batches a gradient that is never reduced looks right. Measured: with lm_head in an FSDP
    group of its own, whose hooks never fire (the fused head never calls it), the fused head gathers the
    sharded weight itself (``full_tensor``) and each rank keeps its own batch's lm_head gradient; only
    this test (and the wrapping's) failed.
    """
    wrong = {name: d for name, d in run["mean_grad"].items() if not d.get("close")}
    assert not wrong, f"gradients of 2 ranks with 2 batches differ from those of both batches: {wrong}"


def test_the_comparison_fails_when_a_rank_sees_another_batch(run: dict[str, Any]) -> None:
    """Control, second half: rank 1's other batch changes every group's gradient far beyond the tolerance."""
    worst_control = worst(run["control_grad"])
    assert set(worst_control) == set(GROUPS)
    for group, diff in worst_control.items():
        assert diff > 1e3 * ATOL, f"{group}: another batch on rank 1 left its gradient unchanged ({diff})"
    assert not run["control_grad"]["lm_head.weight"]["close"]
    assert not run["control_grad"]["model.embed_tokens.weight"]["close"]
    print("max |grad diff| per group:", worst(run["grad"]), "control:", worst_control)
    print("max |param diff| after AdamW per group:", worst(run["param"]), "2 batches:", worst(run["mean_grad"]))


if __name__ == "__main__":
    from ctrain.train.logs import exit_process

    worker(sys.argv[1], Path(sys.argv[2]))
    exit_process(0)  # as ctrain train ends its ranks: no gloo thread left for C++ teardown to abort on
