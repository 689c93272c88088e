"""The model: pretrained from a path or hub name, or new from a config with overrides (run_clm's way).

``model.config`` is a model type (``llama``, ``gpt2``, ...) or a config file/directory/hub name;
``model.config_overrides`` changes any field of it. A new model's vocabulary and special token
ids come from the tokenizer.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from ctrain.errors import ConfigError
from ctrain.train.recipe import BUILTIN_MODEL_TYPE, Recipe, expand_path

log = logging.getLogger("ctrain.train")


def load_config(recipe: Recipe) -> Any:
    """The model's config with the recipe's overrides applied (cheap: no weights)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    model = recipe.model
    reference = model.path or model.config
    assert reference is not None
    by_type = bool(model.config and BUILTIN_MODEL_TYPE.match(model.config) and not expand_path(model.config).exists())
    try:
        if by_type:
            config = AutoConfig.for_model(model.config)
        else:
            local = expand_path(reference)
            config = AutoConfig.from_pretrained(
                str(local) if local.exists() else reference,
                revision=model.revision,
                trust_remote_code=model.trust_remote_code,
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load the model config {reference}: {exc}") from exc
    valid = set(config.to_dict())
    unknown = sorted(set(model.config_overrides) - valid)
    if unknown:
        raise ConfigError(
            f"model.config_overrides: {config.model_type} configs have no field '{unknown[0]}'; fields: "
            f"{', '.join(sorted(valid))}"
        )
    try:
        if by_type:
            # Through the constructor, so fields derived from others (head_dim from hidden_size and the
            # head count) follow the overrides.
            return AutoConfig.for_model(model.config, **model.config_overrides)
        for key, value in model.config_overrides.items():
            setattr(config, key, value)
        return config
    except (ValueError, TypeError, StrictDataclassError) as exc:  # how transformers' configs refuse values
        cause = exc.__cause__ or exc
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(f"model.config_overrides do not make a valid {config.model_type} config: {detail}") from exc


def max_positions(config: Any) -> int | None:
    """How many positions the model can attend over, if its config says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, key, None)
        if isinstance(value, int):
            return value
    return None


def check_sizes(recipe: Recipe, config: Any) -> None:
    """Sequence length against what the model can hold, before any weights load."""
    positions = max_positions(config)
    if positions is not None and recipe.data.max_length > positions:
        raise ConfigError(
            f"data.max_length ({recipe.data.max_length}) is larger than the model's max_position_embeddings "
            f"({positions}): lower data.max_length"
        )


def attention(recipe: Recipe, device_type: str, dtype: str) -> str:
    """``auto``: FlashAttention 2 on CUDA in half precision when the package is there, else SDPA."""
    wanted = recipe.model.attn_implementation
    if wanted != "auto":
        return wanted
    if device_type == "cuda" and dtype in ("bf16", "fp16") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_dtype(recipe: Recipe, precision: str) -> Any:
    """Weights dtype at load: ``auto`` keeps float32 master weights (mixed precision autocasts), except
    under DeepSpeed, which keeps its own float32 copy and wants the model in the training dtype."""
    import torch

    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if recipe.model.dtype != "auto":
        return names[recipe.model.dtype]
    if recipe.training.deepspeed and precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.float32


def build_model(recipe: Recipe, config: Any, tokenizer: Any, precision: str, device_type: str) -> Any:
    """A pretrained or new causal LM, matched to the tokenizer."""
    from transformers import AutoModelForCausalLM

    model_settings = recipe.model
    dtype = load_dtype(recipe, precision)
    attn = attention(recipe, device_type, precision)
    if model_settings.path:
        local = expand_path(model_settings.path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(local) if local.exists() else model_settings.path,
                config=config,
                revision=model_settings.revision,
                dtype=dtype,
                attn_implementation=attn,
                trust_remote_code=model_settings.trust_remote_code,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the model {model_settings.path}: {exc}") from exc
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            log.info("resizing the token embeddings to the tokenizer's %d tokens", len(tokenizer))
            model.resize_token_embeddings(len(tokenizer))
    else:
        if "vocab_size" not in model_settings.config_overrides:
            config.vocab_size = len(tokenizer)
        elif config.vocab_size < len(tokenizer):
            raise ConfigError(
                f"model.config_overrides.vocab_size ({config.vocab_size}) is smaller than the tokenizer "
                f"({len(tokenizer)} tokens)"
            )
        for name in ("bos", "eos", "pad"):
            token_id = getattr(tokenizer, f"{name}_token_id")
            if token_id is not None:
                setattr(config, f"{name}_token_id", token_id)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id
        if tokenizer.eos_token_id is not None:
            generation.eos_token_id = tokenizer.eos_token_id
    return model


def parameter_count(model: Any) -> int:
    """Parameters of the model, also when ZeRO-3 has partitioned them away from this rank."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
