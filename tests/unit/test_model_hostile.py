"""Damaged model, tokenizer and adapter directories: each is one ConfigError naming the file and what
is wrong, raised before the data is tokenized where the run allows (load_config and check_sizes run
first), never a traceback from transformers, safetensors or PEFT after minutes of work."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ctrain.errors import ConfigError
from ctrain.settings import from_mapping
from ctrain.train.model import build_model, check_sizes, load_config, load_trained
from ctrain.train.recipe import Recipe, TokenizerTraining
from ctrain.train.tokenizer import load_tokenizer, train_tokenizer

TEXTS = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(10)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny pretrained model directory (2 layers, 32 wide) and a LoRA adapter of it, made once."""
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pristine")
    tokenizer = train_tokenizer(TEXTS, TokenizerTraining(vocab_size=300))
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                  vocab_size=len(tokenizer), tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    peft.get_peft_model(model, lora).save_pretrained(root / "adapter")
    tokenizer.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def recipe_for(model_dir: Path, overrides: dict[str, Any] | None = None, lora: bool = False) -> Recipe:
    """A recipe fine-tuning ``model_dir`` (with LoRA when asked): what `ctrain train` and `ctrain eval` get."""
    settings: dict[str, Any] = {"model": {"path": str(model_dir), "config_overrides": overrides or {}},
                                "data": {"source": "d.jsonl", "max_length": 64}}  # fmt: skip
    if lora:
        settings["peft"] = {"method": "lora", "r": 4}
    return from_mapping(Recipe, settings)


def copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_json(path: Path, change: Callable[[Any], Any]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def with_field(key: str, value: Any) -> Callable[[Any], Any]:
    return lambda data: {**data, key: value}


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


WEIGHTS_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "cut short": (lambda p: truncate(p, 1000), "not a readable safetensors file .*invalid header length"),
    "cut at the end": (lambda p: truncate(p, p.stat().st_size - 100), "not a readable safetensors file"),
    "empty": (lambda p: p.write_bytes(b""), "not a readable safetensors file .*header too small"),
    "header length 2^63": (lambda p: p.write_bytes((2**63).to_bytes(8, "little") + p.read_bytes()[8:]),
                           "not a readable safetensors file .*header too large"),  # fmt: skip
    "header not one": (lambda p: p.write_bytes(len(b'{"a": 1}').to_bytes(8, "little") + b'{"a": 1}'),
                       "not a readable safetensors file .*invalid JSON in header"),  # fmt: skip
    "missing": (lambda p: p.unlink(), "has a config.json but no weights"),
}


@pytest.mark.parametrize("damage", WEIGHTS_DAMAGE, ids=list(WEIGHTS_DAMAGE))
def test_damaged_weights_are_refused_before_the_data_is_tokenized(
    damage: str, pristine: tuple[Path, Path], tmp_path: Path
) -> None:
    """check_sizes runs before the data is prepared: safetensors' errors came only at build_model, after it."""
    model_dir = copy(pristine[0], tmp_path / "model")
    change, says = WEIGHTS_DAMAGE[damage]
    change(model_dir / "model.safetensors")
    recipe = recipe_for(model_dir)
    with pytest.raises(ConfigError, match=says):
        check_sizes(recipe, load_config(recipe))


def test_a_damaged_weights_file_that_reaches_the_load_is_one_error(pristine: tuple[Path, Path], tmp_path: Path) -> None:
    """Past the checks (a file damaged since), build_model's load says the model's name, not SafetensorError."""
    model_dir = copy(pristine[0], tmp_path / "model")
    recipe = recipe_for(model_dir)
    config = load_config(recipe)
    tokenizer = load_tokenizer(recipe)
    truncate(model_dir / "model.safetensors", 1000)
    with pytest.raises(ConfigError, match=f"cannot load the model {model_dir}: .*header"):
        build_model(recipe, config, tokenizer, "fp32", "cpu")


CONFIG_DAMAGE: dict[str, tuple[Callable[[Any], Any], str]] = {
    "width a string": (with_field("hidden_size", "1e9"), r"config.json: hidden_size is '1e9'; a size must be a whole"),
    "width a float": (with_field("hidden_size", 1e12), r"config.json: hidden_size is 1000000000000.0; a size"),
    "positions a string": (with_field("max_position_embeddings", "64"), "max_position_embeddings is '64'"),
    "no heads": (with_field("num_attention_heads", 0), "num_attention_heads is 0; a size must be a whole number"),
    "negative width": (with_field("hidden_size", -32), "hidden_size is -32"),
    "negative vocabulary": (with_field("vocab_size", -1), "vocab_size is -1"),
    "kv heads not dividing": (with_field("num_key_value_heads", 3), r"num_key_value_heads is 3; it must divide "
                                                                   r"num_attention_heads \(2\)"),  # fmt: skip
    "head_dim a float": (with_field("head_dim", 1e8), "head_dim is 100000000.0"),
    "rope a number": (with_field("rope_parameters", 5), "cannot load the model config .*rope_parameters"),
    "a list": (lambda data: [1], "config.json holds a list, not a JSON object"),
}


@pytest.mark.parametrize("damage", CONFIG_DAMAGE, ids=list(CONFIG_DAMAGE))
def test_a_config_json_with_bad_sizes_is_one_error_naming_the_field(
    damage: str, pristine: tuple[Path, Path], tmp_path: Path
) -> None:
    """transformers' strict dataclasses, a division by zero heads or torch's negative dimension were tracebacks."""
    model_dir = copy(pristine[0], tmp_path / "model")
    change, says = CONFIG_DAMAGE[damage]
    edit_json(model_dir / "config.json", change)
    with pytest.raises(ConfigError, match=says):
        load_config(recipe_for(model_dir))


def test_a_config_wider_than_its_weights_is_refused_from_the_headers(
    pristine: tuple[Path, Path], tmp_path: Path
) -> None:
    """hidden_size 1000000 over 32-wide weights: 4 GB allocated, then transformers' size mismatch; now the
    weights' headers are compared with a meta-device model, which allocates nothing."""
    model_dir = copy(pristine[0], tmp_path / "model")
    edit_json(model_dir / "config.json", with_field("hidden_size", 1000000))
    recipe = recipe_for(model_dir)
    with pytest.raises(ConfigError, match=r"model.safetensors does not fit the model's config: its "
                                          r"model.embed_tokens.weight is \[\d+, 32\], .* makes it \[\d+, 1000000\]"):
        check_sizes(recipe, load_config(recipe))


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("num_hidden_layers", -1),
                                          ("intermediate_size", 0), ("hidden_size", "32")])  # fmt: skip
@pytest.mark.parametrize("new", [True, False], ids=["new model", "pretrained"])
def test_config_overrides_that_are_no_size_are_refused(
    field: str, value: Any, new: bool, pristine: tuple[Path, Path]
) -> None:
    """num_attention_heads 0 divided by zero; 0 layers or a 0-wide MLP trained a model of nothing with rc 0."""
    recipe = recipe_for(pristine[0], {field: value})
    if new:
        recipe.model.path, recipe.model.config = None, "llama"
    with pytest.raises(ConfigError, match=rf"model.config_overrides.{field} is {value!r}; a size must be a whole "
                                          r"number from 1 to \d+: fix it in the recipe"):  # fmt: skip
        load_config(recipe)


TOKENIZER_DAMAGE: dict[str, tuple[str, str, str]] = {
    "tokenizer.json of no tokenizer": ("tokenizer.json", '{"not": "a tokenizer"}', "lacks the key 'added_tokens'"),
    "tokenizer.json nested deep": ("tokenizer.json", "[" * 100000 + "]" * 100000, "nests too deep"),
    "tokenizer_config.json a list": ("tokenizer_config.json", "[1]", "tokenizer_config.json holds a list"),
}


@pytest.mark.parametrize("damage", TOKENIZER_DAMAGE, ids=list(TOKENIZER_DAMAGE))
def test_a_damaged_tokenizer_is_one_error(damage: str, pristine: tuple[Path, Path], tmp_path: Path) -> None:
    """KeyError, RecursionError and AttributeError escaped load_tokenizer, which caught OSError and ValueError."""
    model_dir = copy(pristine[0], tmp_path / "model")
    name, text, says = TOKENIZER_DAMAGE[damage]
    (model_dir / name).write_text(text)
    with pytest.raises(ConfigError, match=says):
        load_tokenizer(recipe_for(model_dir))


def test_ctrain_eval_of_a_damaged_full_model_is_one_error(pristine: tuple[Path, Path], tmp_path: Path) -> None:
    """load_trained read the weights with no check or catch: SafetensorError from `ctrain eval`."""
    model_dir = copy(pristine[0], tmp_path / "model")
    assert load_trained(model_dir, recipe_for(model_dir)) is not None
    truncate(model_dir / "model.safetensors", 1000)
    with pytest.raises(ConfigError, match=f"{model_dir}/model.safetensors is not a readable safetensors file"):
        load_trained(model_dir, recipe_for(model_dir))


ADAPTER_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "rank 1e9": (lambda d: edit_json(d / "adapter_config.json", with_field("r", 10**9)),
                 r"adapter_config.json: r is 1000000000; an adapter's rank is a whole number from 1 to 65536"),
    "rank pattern 1e9": (lambda d: edit_json(d / "adapter_config.json", with_field("rank_pattern", {"q_proj": 10**9})),
                         r"rank_pattern.q_proj is 1000000000; an adapter's rank"),
    "rank wider than the model": (lambda d: edit_json(d / "adapter_config.json", with_field("r", 64)),
                                  r"asks rank 64, more than the base model's hidden size \(32"),
    "rank negative": (lambda d: edit_json(d / "adapter_config.json", with_field("r", -1)), "r is -1"),
    "rank a string": (lambda d: edit_json(d / "adapter_config.json", with_field("r", "8")), "r is '8'"),
    "alpha a string": (lambda d: edit_json(d / "adapter_config.json", with_field("lora_alpha", "x")),
                       "lora_alpha is 'x'; LoRA's alpha is a positive number"),
    "no such module": (lambda d: edit_json(d / "adapter_config.json", with_field("target_modules", ["nonexistent"])),
                       r"cannot put the adapter in .* on its base model .*: Target modules \{'nonexistent'\} not"),
    "modules a number": (lambda d: edit_json(d / "adapter_config.json", with_field("target_modules", 5)),
                         "target_modules is 5; it names the adapted modules"),
    "not LoRA": (lambda d: edit_json(d / "adapter_config.json", with_field("peft_type", "BOGUS")),
                 "peft_type is 'BOGUS'; ctrain loads LoRA adapters"),
    "a list": (lambda d: edit_json(d / "adapter_config.json", lambda data: [1]), "holds a list, not the JSON object"),
    "weights cut short": (lambda d: truncate(d / "adapter_model.safetensors", 100),
                          "adapter_model.safetensors is not a readable safetensors file"),
    "no weights": (lambda d: (d / "adapter_model.safetensors").unlink(),
                   "has adapter_config.json but no adapter_model.safetensors"),
    "rank not the weights'": (lambda d: edit_json(d / "adapter_config.json", with_field("r", 8)),
                              r"cannot put the adapter .*: size mismatch for .*lora_A"),
}


@pytest.mark.parametrize("damage", ADAPTER_DAMAGE, ids=list(ADAPTER_DAMAGE))
def test_a_damaged_adapter_is_one_error_naming_its_directory(
    damage: str, pristine: tuple[Path, Path], tmp_path: Path
) -> None:
    """`ctrain eval --model ADAPTER`: PEFT allocated 128 GB for rank 1e9, and raised ValueError, TypeError,
    KeyError or a hub-name HFValidationError for the rest; the ranks are checked before anything loads."""
    base, adapter = pristine
    adapter_dir = copy(adapter, tmp_path / "adapter")
    change, says = ADAPTER_DAMAGE[damage]
    change(adapter_dir)
    with pytest.raises(ConfigError, match=says):
        load_trained(adapter_dir, recipe_for(base, lora=True))


def test_a_whole_adapter_still_loads(pristine: tuple[Path, Path]) -> None:
    base, adapter = pristine
    assert type(load_trained(adapter, recipe_for(base, lora=True))).__name__ == "PeftModelForCausalLM"
