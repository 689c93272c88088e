"""The model: pretrained from a path or hub name, or new from a config with overrides (run_clm's way).

``model.config`` is a model type (``llama``, ``gpt2``, ...) or a config file/directory/hub name;
``model.config_overrides`` changes any field of it. A new model's vocabulary and special token
ids come from the tokenizer.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import warnings
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError
from ctrain.files import load_json_bounded
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train.recipe import MAX_PARAMETERS, Recipe, check_max_length, check_rank, expand_path
from ctrain.train.sources import BUILTIN_MODEL_TYPE

ADAPTER_CONFIG = "adapter_config.json"  # what PEFT writes beside an adapter's weights

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


def parameters(config: Any) -> int | None:
    """About how many parameters a decoder of this config has (embeddings, attention and MLP per
    layer), from its sizes alone; None when the config does not say them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    vocab = getattr(text, "vocab_size", None)
    if not all(isinstance(v, int) for v in (hidden, layers, vocab)):
        return None
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return vocab * hidden * 2 + layers * (4 * hidden * hidden + 3 * hidden * inner)


def check_sizes(recipe: Recipe, config: Any) -> None:
    """Sequence length, adapter rank and model size against what the model can hold, before any
    weights load (the allocator's error comes minutes later and names none of them)."""
    where = f"the {config.model_type} config"
    check_max_length(recipe.data.max_length, max_positions(config), where)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if recipe.peft.enabled:
        hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
        check_rank(recipe.peft.r, hidden if isinstance(hidden, int) else None, where)
    count = parameters(config)
    if count is not None and count > MAX_PARAMETERS:
        raise ConfigError(
            f"{where} describes about {count:.1e} parameters (hidden_size, num_hidden_layers, vocab_size ...): "
            f"more than {MAX_PARAMETERS:.0e}, beyond any model; check model.config_overrides"
        )


# Optimizers whose state is two moments per weight in the weights' dtype (torch's AdamW): with the
# weights and their gradients, four copies of the model; any other optimizer is counted at two (no state).
ADAMW_OPTIMIZERS = frozenset({"auto", "adamw_torch", "adamw_torch_fused"})


def _meta_model(recipe: Recipe, config: Any, **fields: Any) -> Any:
    """The model of ``config`` (a copy, with ``fields`` set) built on the meta device: its shapes and
    dtypes without memory, well under a second at 70B; None when the config cannot be built that way
    (one only ``from_pretrained`` builds), and the caller decides as if it had not asked."""
    import torch
    from transformers import AutoModelForCausalLM

    shape = copy.deepcopy(config)  # a copy: from_config sets fields of the config it gets
    dtype = fields.pop("dtype", None)
    for key, value in fields.items():
        setattr(shape, key, value)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                shape, dtype=dtype, trust_remote_code=recipe.model.trust_remote_code
            )
    except Exception:  # noqa: BLE001 - whatever the model's own code raises
        return None


def count_parameters(recipe: Recipe, config: Any) -> int | None:
    """The model's exact parameter count (tied weights once), from its meta copy; None when there is
    none. A new model's vocabulary comes from the tokenizer, not read yet: its embeddings count one
    token each, so the count stays a floor."""
    new_vocabulary = not recipe.model.path and "vocab_size" not in recipe.model.config_overrides
    model = _meta_model(recipe, config, **({"vocab_size": 1} if new_vocabulary else {}))
    return None if model is None else sum(p.numel() for p in model.parameters())


def check_fits(recipe: Recipe, count: int, precision: str, world: int, gpu_bytes: int, gpu: str) -> str:
    """Refuse a full fine-tune that cannot fit its GPUs whatever its batch, before data and weights
    load (the allocator's error comes minutes later); returns the line the start logs instead.

    What is counted is a floor, never an estimate of activations: the weights, their gradients and
    the optimizer's state on each GPU (sharded over the ranks under ``training.fsdp``, else whole on
    every GPU; none with FSDP's CPU offload), and under FSDP the whole model as each rank reads it
    onto its GPU before sharding it.
    """
    dtype = load_dtype(recipe, precision)
    size = dtype.itemsize
    fsdp = recipe.training.fsdp
    copies = 4 if recipe.training.optim in ADAMW_OPTIMIZERS else 2
    per_parameter = size * copies
    state = count * per_parameter / (world if fsdp else 1)
    gib, have = 2**30, f"one GPU's {gpu_bytes / 2**30:.1f} GiB ({gpu})"
    what = f"the weights, their gradients and {'AdamW state' if copies == 4 else 'no optimizer state'}"
    dtype_name = str(dtype).removeprefix("torch.")
    if fsdp and count * size > gpu_bytes:
        raise ConfigError(
            f"under training.fsdp every rank reads the whole model onto its GPU before sharding it: {count:.3g} "
            f"parameters in {dtype_name} are {count * size / gib:.1f} GiB, more than {have}; use GPUs with more "
            "memory, or train adapters (peft.method: lora or qlora)"
        )
    if fsdp and recipe.training.fsdp_settings().get("cpu_offload"):  # as transformers reads it: truthy
        return (
            f"memory per GPU: {what} ({state / gib:.1f} GiB per rank) live in host memory "
            f"(training.fsdp_config.cpu_offload), after each rank reads {count * size / gib:.1f} GiB onto {have}"
        )
    if state > gpu_bytes:
        needed = math.ceil(count * per_parameter / gpu_bytes)
        where = f"sharded over {world} rank(s)" if fsdp else "whole on every GPU (no training.fsdp)"
        fix = (f"run on at least {needed} GPUs of this size (more for the activations)" if fsdp else
               f"set training.fsdp: true to shard it over the GPUs (at least {needed} of this size)")  # fmt: skip
        raise ConfigError(
            f"{what} ({per_parameter} bytes per parameter in {dtype_name}) are {state / gib:.1f} GiB per GPU for "
            f"{count:.3g} parameters {where}, more than {have}: {fix}, or train adapters (peft.method: lora)"
        )
    shared = f" / {world} rank{'s' if world > 1 else ''}" if fsdp else ""
    return (
        f"memory per GPU: {what} {state / gib:.1f} GiB ({per_parameter} bytes x {count:.3g} parameters{shared}) "
        f"of {have}; the rest is for activations"
    )


def attention(recipe: Recipe, device_type: str, dtype: str) -> str:
    """``auto``: FlashAttention 2 on CUDA in half precision when the package is there, else SDPA."""
    wanted = recipe.model.attn_implementation
    if wanted != "auto":
        return wanted
    if device_type == "cuda" and dtype in ("bf16", "fp16") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _dtypes() -> dict[str, Any]:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_dtype(recipe: Recipe, precision: str) -> Any:
    """Weights dtype at load: ``auto`` keeps float32 master weights (mixed precision autocasts), except
    under DeepSpeed, which keeps its own float32 copy and wants the model in the training dtype."""
    import torch

    if recipe.model.dtype != "auto":
        return _dtypes()[recipe.model.dtype]
    if recipe.training.deepspeed and precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.float32


def final_dtype(recipe: Recipe, config: Any, precision: str) -> Any:
    """The dtype the final model is saved in: ``model.save_dtype``, under ``auto`` the pretrained
    checkpoint's own, so that fine-tuning a bf16 model gives back a bf16 one of the same size (not
    twice that in float32 masters), and for a new model (or a checkpoint that names none) the dtype
    it trained in. ``config`` is the model's config as :func:`load_config` read it, before loading."""
    if recipe.model.save_dtype != "auto":
        return _dtypes()[recipe.model.save_dtype]
    stored = stored_dtype(config) if recipe.model.path else None
    return stored if stored is not None else load_dtype(recipe, precision)


def stored_dtype(config: Any) -> Any:
    """The dtype a pretrained checkpoint's config says its weights are stored in; None when it names
    none ctrain trains in."""
    stated = getattr(config, "dtype", None)
    for name, dtype in _dtypes().items():
        if stated in (name, dtype):
            return dtype
    return None


def _read_dtype(recipe: Recipe, config: Any, dtype: Any) -> Any:
    """The dtype to read a pretrained checkpoint in when it goes straight onto a device, to be widened
    to ``dtype`` there: transformers widens each tensor in host memory before moving it (about 3 GiB
    more per rank at 8B, measured), the device does it in place of that.

    The stored dtype when it is narrower and the model makes each of its floating buffers in float32
    whatever its dtype (a copy on the meta device says so): then the widened model equals the one read
    in ``dtype``. Llama's rotary frequencies are; Gemma's embedding scale is not, so Gemma reads as before.
    """
    import torch

    stored = stored_dtype(config)
    if stored is None or stored.itemsize >= dtype.itemsize:
        return dtype
    shape = _meta_model(recipe, config, dtype=stored)
    if shape is None:
        return dtype
    made = {b.dtype for b in shape.buffers() if b.is_floating_point()}
    return stored if made <= {torch.float32} else dtype


def build_model(
    recipe: Recipe, config: Any, tokenizer: Any, precision: str, device_type: str, place: Any = None
) -> Any:
    """A pretrained or new causal LM, matched to the tokenizer; its weights made (or read) on the
    device ``place`` when given, else in host memory."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    model_settings = recipe.model
    dtype = load_dtype(recipe, precision)
    attn = attention(recipe, device_type, precision)
    if model_settings.path:
        local = expand_path(model_settings.path)
        extra: dict[str, Any] = {}
        if recipe.peft.method == "qlora":
            extra["quantization_config"] = _four_bits()
            dtype = extra["quantization_config"].bnb_4bit_compute_dtype
        read_as = dtype
        if place is not None:
            extra["device_map"] = {"": place}
            if "quantization_config" not in extra:
                read_as = _read_dtype(recipe, config, dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(local) if local.exists() else model_settings.path,
                config=config,
                revision=model_settings.revision,
                dtype=read_as,
                attn_implementation=attn,
                trust_remote_code=model_settings.trust_remote_code,
                **extra,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the model {model_settings.path}: {exc}") from exc
        if read_as != dtype:
            model.to(dtype)  # widening is exact (_read_dtype)
            model.config.dtype = dtype
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
        with torch.device(place) if place is not None else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id
        if tokenizer.eos_token_id is not None:
            generation.eos_token_id = tokenizer.eos_token_id
    return model


def _four_bits() -> Any:
    """QLoRA's quantisation of the frozen base: NF4 weights, double quantisation, bf16 compute."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def linear_names(model: Any) -> list[str]:
    """The last name part of every linear layer but the output head: what ``target_modules`` can name."""
    import torch

    head = model.get_output_embeddings()
    names = set()
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def check_adapters(recipe: Recipe, config: Any) -> None:
    """The modules ``peft`` names exist in the model (ConfigError listing the ones that do), before
    any data or weights load: the model is built from its config on the meta device, which
    allocates nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    settings = recipe.peft
    targets = settings.targets()
    if isinstance(targets, list):
        available = linear_names(model)
        missing = [t for t in targets if t not in available]
        if missing:
            raise ConfigError(
                f"peft.target_modules: {model.config.model_type} has no linear layer named '{missing[0]}'; "
                f"its linear layers: {', '.join(available)} (or use all-linear)"
            )
    modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing_saved = [m for m in settings.modules_to_save if m not in modules]
    if missing_saved:
        raise ConfigError(
            f"peft.modules_to_save: {model.config.model_type} has no module named '{missing_saved[0]}'; "
            f"top-level modules: {', '.join(sorted(n for n, _ in model.named_children()))}"
        )


def add_adapters(recipe: Recipe, model: Any) -> Any:
    """The model with trainable LoRA adapters (a PeftModel); the base weights stay frozen. The
    modules named were checked before anything loaded (:func:`check_adapters`)."""
    from peft import LoraConfig, get_peft_model

    settings = recipe.peft
    # Not PEFT's prepare_model_for_kbit_training: it upcasts the embeddings, the output head and
    # the norms to fp32 for fp16 training, +4 GB on an 8B model and an fp32 head, where ctrain's
    # QLoRA computes in bf16 (Recipe refuses float32) and its norms already compute in fp32.
    if recipe.training.gradient_checkpointing:
        # The frozen embeddings give checkpointed layers no input that needs a gradient (the
        # fast engine's fast.gradient_checkpointing: ctrain.fast.checkpoint_layers sees to it).
        model.enable_input_require_grads()
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.targets(),
        modules_to_save=settings.modules_to_save or None,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # transformers' deprecation notices, raised from inside PEFT
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "%s r=%d alpha=%g on %s: %s of %s parameters train (%.3f%%)",
        settings.method.upper() if settings.method == "qlora" else "LoRA", settings.r, settings.alpha,
        ", ".join(sorted({n.rsplit(".", 1)[-1] for n in model.peft_config["default"].target_modules})),
        f"{trainable:,}", f"{total:,}",
        100.0 * trainable / max(total, 1),
    )  # fmt: skip
    return model


def _with_adapter(recipe: Recipe, adapter_dir: Path, **load: Any) -> Any:
    """The base model (the recipe's ``model.path``, else the one the adapter names), sized to the
    adapter's tokenizer as training sized it, with the adapter in ``adapter_dir`` on it (a PeftModel)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = load_json_bounded(adapter_dir / ADAPTER_CONFIG, MAX_SETTINGS_BYTES, "the adapter's config")
    reference = recipe.model.path or (adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None)
    if not reference:
        raise ConfigError(f"{adapter_dir} holds a LoRA adapter and neither it nor the recipe names its base model")
    local = expand_path(reference)
    base = AutoModelForCausalLM.from_pretrained(
        str(local) if local.exists() else reference,
        revision=recipe.model.revision,
        trust_remote_code=recipe.model.trust_remote_code,
        **load,
    )
    size = len(AutoTokenizer.from_pretrained(str(adapter_dir)))
    if size > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(size)
    with warnings.catch_warnings():  # transformers' deprecation notices, raised from inside PEFT
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, str(adapter_dir))


def merge_adapters(recipe: Recipe, adapter_dir: Path, target: Path, dtype: Any) -> None:
    """Fold the adapter in ``adapter_dir`` into a fresh copy of the base model and save it to ``target``
    with weights in ``dtype`` (:func:`final_dtype`).

    The base is loaded again on the CPU, not taken from training: merging into QLoRA's 4-bit weights
    would round the result, and the training model may be wrapped or sharded.
    """
    from transformers import AutoTokenizer

    adapted = _with_adapter(recipe, adapter_dir, dtype=dtype)
    with warnings.catch_warnings():  # transformers' deprecation notices, raised from inside PEFT
        warnings.simplefilter("ignore", FutureWarning)
        adapted.merge_and_unload().save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(adapter_dir)).save_pretrained(str(target))


def load_trained(model_dir: Path, recipe: Recipe) -> Any:
    """A trained model for inference: a full model, or the recipe's base with the adapter in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    if not (model_dir / ADAPTER_CONFIG).is_file():
        return AutoModelForCausalLM.from_pretrained(str(model_dir))
    return _with_adapter(recipe, model_dir)


def _true_count(parameter: Any) -> int:
    """A parameter's number of weights: also when ZeRO-3 has partitioned it away from this rank, and
    for a 4-bit weight, which bitsandbytes packs two to a byte (its ``quant_state`` has the shape)."""
    partitioned = getattr(parameter, "ds_numel", None)
    if partitioned:
        return int(partitioned)
    shape = getattr(getattr(parameter, "quant_state", None), "shape", None)
    if shape is not None:
        return int(math.prod(int(n) for n in shape))
    return int(parameter.numel())


# The FLOPs convention of the MFU that `ctrain train` logs, named in the line (docs/training.md).
FULL_CONVENTION = "6N"
FROZEN_CONVENTION = "6N trained + 4N frozen"


def flops_per_token(model: Any) -> tuple[float, str]:
    """Training FLOPs per token and the convention's name: 6 per trained weight (2 forward, 4
    backward), 4 per frozen one (2 forward, 2 for the activations' gradients; no weight gradient:
    LoRA's and QLoRA's base), 4-bit weights counted at their true number. The bench counts the same
    (``BenchSpec.flops_per_token``), so the log and docs/benchmarks.md agree."""
    trained = frozen = 0
    for parameter in model.parameters():
        if parameter.requires_grad:
            trained += _true_count(parameter)
        else:
            frozen += _true_count(parameter)
    return 6.0 * trained + 4.0 * frozen, FROZEN_CONVENTION if frozen else FULL_CONVENTION
