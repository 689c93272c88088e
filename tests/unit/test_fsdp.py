"""What ``training.fsdp`` turns into: transformers' arguments, FSDP2's mixed precision, the final save.

The sharded run itself needs GPUs (accelerate shards only CUDA processes); its checkpoints are
exercised for real on CPU in tests/integration/test_sharded_checkpoint.py, its speed in
docs/benchmarks.md (the sft8b cases).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import require

torch = require("torch")

from accelerate.utils import FullyShardedDataParallelPlugin

from ctrain import resources
from ctrain.errors import ConfigError
from ctrain.fast import FastSettings
from ctrain.fast.trainer import tune_fsdp
from ctrain.train.recipe import FSDP_DEFAULTS, load_recipe
from ctrain.train.trainer import Layout, argument_values, training_arguments, whole_final_model

SFT_8B = resources.path("recipes", "llama-3.1-8b-sft.yaml")
# One rank of the recipe on a node of 4 GPUs: 2 rows per micro-batch, 4 micro-batches a step.
FOUR_GPUS = Layout(rank=0, world_size=4, device_type="cuda", precision="bf16", engine="fast",
                   per_device_batch=2, accumulation=4)  # fmt: skip


def test_the_8b_recipe_shards_each_layer_checkpoints_sharded_and_reduces_every_micro_batch(tmp_path: Path) -> None:
    recipe = load_recipe(SFT_8B)
    assert recipe.hf_engine_reason() is None  # engine auto: the fast engine on GPUs
    assert recipe.fast.rows_per_device(recipe.data.max_length) == 2
    values = argument_values(recipe, FOUR_GPUS, tmp_path, [])
    assert values["fsdp"] is True
    sharded = {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}
    assert values["fsdp_config"] == sharded
    assert values["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    assert values["per_device_train_batch_size"] == 2 and values["gradient_accumulation_steps"] == 4


def test_a_recipe_key_wins_over_the_fsdp_defaults(tmp_path: Path) -> None:
    recipe = load_recipe(SFT_8B, ['training.fsdp_config={"state_dict_type": "FULL_STATE_DICT", "cpu_offload": true}'])
    config = argument_values(recipe, FOUR_GPUS, tmp_path, [])["fsdp_config"]
    assert config == {**FSDP_DEFAULTS, "state_dict_type": "FULL_STATE_DICT", "cpu_offload": True}
    assert FSDP_DEFAULTS["state_dict_type"] == "SHARDED_STATE_DICT"  # the recipe's key did not leak into them


def test_without_fsdp_nothing_of_it_reaches_the_arguments(tmp_path: Path) -> None:
    recipe = load_recipe(SFT_8B, ["training.fsdp=false"])
    values = argument_values(recipe, FOUR_GPUS, tmp_path, [])
    assert values["fsdp"] is False and values["fsdp_config"] is None and "accelerator_config" not in values


def test_accelerator_config_in_trainer_args_is_refused_under_fsdp(tmp_path: Path) -> None:
    recipe = load_recipe(SFT_8B, ['training.trainer_args={"accelerator_config": {"split_batches": true}}'])
    with pytest.raises(ConfigError, match=r"training.trainer_args.accelerator_config is set by ctrain itself"):
        training_arguments(recipe, FOUR_GPUS, tmp_path, [])


def _trainer(plugin: object, bf16: bool = True) -> SimpleNamespace:
    """What tune_fsdp and whole_final_model read of a Trainer: its Accelerator's state and its arguments."""
    return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)),
                           args=SimpleNamespace(bf16=bf16))  # fmt: skip


@pytest.mark.parametrize(("reduce", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_layers_compute_in_bf16_and_gradients_sum_in_the_asked_dtype(reduce: str, dtype: torch.dtype) -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    tune_fsdp(_trainer(plugin), FastSettings(gradient_reduce=reduce))
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, dtype, torch.bfloat16)


def test_fp32_training_and_ddp_keep_their_precision() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    tune_fsdp(_trainer(plugin, bf16=False), FastSettings())
    assert plugin.mixed_precision_policy is None
    tune_fsdp(_trainer(None), FastSettings())  # no FSDP: nothing to set, no error


def test_the_final_model_is_gathered_whole() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    whole_final_model(_trainer(plugin))
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)
    whole_final_model(_trainer(None))  # DDP or one process: nothing to switch
