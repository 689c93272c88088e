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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError
from ctrain.files import load_json_bounded, shorten
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train.recipe import MAX_PARAMETERS, MAX_RANK, Recipe, check_max_length, check_rank, expand_path
from ctrain.train.sources import BUILTIN_MODEL_TYPE
from ctrain.train.tokenizer import read_tokenizer

ADAPTER_CONFIG = "adapter_config.json"  # what PEFT writes beside an adapter's weights
ADAPTER_WEIGHTS = "adapter_model.safetensors"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Weights transformers reads without safetensors: present, they are left to it.
OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# An index of a model's weight files is a name per tensor: megabytes at the most (DeepSeek-V3's is 9 MB).
MAX_INDEX_BYTES = 64 * 2**20

# Config fields that are sizes (widths, counts, lengths): where a config sets them, each is a whole
# number from 1 to MAX_SIZE. Else transformers' validators raise a traceback, torch's allocator fails
# after the data is tokenized, or (0 layers, a 0-wide MLP) a model of nothing trains without a word.
SIZE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_inner", "n_layer", "n_head", "n_positions",
)  # fmt: skip
MAX_SIZE = 2**31

log = logging.getLogger("ctrain.train")


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it cannot read or build: wrong types (its strict
    dataclasses), missing keys, a zero head count it divides by, JSON nested too deep."""
    from huggingface_hub.errors import StrictDataclassError

    return (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError, ArithmeticError,
            StrictDataclassError)  # fmt: skip


def _first_line(exc: BaseException) -> str:
    """The error's first line of words (its cause's, where transformers wraps one), else its type's name;
    of torch's state-dict errors, the first size mismatch they list."""
    cause = exc.__cause__ or exc
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    mismatch = [line for line in lines if line.startswith("size mismatch")]
    return shorten((mismatch or lines or [type(cause).__name__])[0], 400)


def check_size_fields(values: Mapping[str, Any], where: str, fix: str, whole: bool = True) -> None:
    """Refuse a size field of ``values`` (a config's JSON, the overrides) that is no whole number in
    range, and, when ``values`` is a whole config, key/value heads that do not divide the heads (the
    overrides' are checked as the built config has them, after transformers' own rules); ``where``
    starts each line (the file, ``model.config_overrides.``), ``fix`` ends it."""
    for key in SIZE_FIELDS:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise ConfigError(f"{where}{key} is {shorten(repr(value))}; a size must be a whole number from 1 to "
                              f"{MAX_SIZE}: {fix}")  # fmt: skip
    heads, groups = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if whole and isinstance(heads, int) and isinstance(groups, int) and heads % groups:
        raise ConfigError(f"{where}num_key_value_heads is {groups}; it must divide num_attention_heads ({heads}): "
                          f"{fix}")  # fmt: skip


def _check_config_sizes(config: Any, reference: str) -> None:
    """The sizes of a built config, as transformers derived them (head_dim from the width and heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = {key: getattr(text, key) for key in SIZE_FIELDS if hasattr(text, key)}
    check_size_fields(values, f"the {config.model_type} config of {reference}: ",
                      "fix the config or model.config_overrides")  # fmt: skip


def _read_config(reference: str, **load: Any) -> Any:
    """``AutoConfig.from_pretrained(reference)``; a local config.json is read bounded and its sizes
    checked first, and one that transformers refuses is one ConfigError naming it."""
    from transformers import AutoConfig

    local = expand_path(reference)
    file = local / "config.json" if local.is_dir() else local
    if file.is_file():
        raw = load_json_bounded(file, MAX_SETTINGS_BYTES, "the model's config")
        if not isinstance(raw, dict):
            raise ConfigError(f"the model's config {file} holds a {type(raw).__name__}, not a JSON object: "
                              "copy the model again")  # fmt: skip
        fix = "correct the file (or copy the model again)"
        check_size_fields(raw, f"{file}: ", fix)
        if isinstance(raw.get("text_config"), dict):
            check_size_fields(raw["text_config"], f"{file}: text_config.", fix)
    try:
        return AutoConfig.from_pretrained(str(local) if local.exists() else reference, **load)
    except _config_errors() as exc:
        raise ConfigError(f"cannot load the model config {reference}: {_first_line(exc)}") from exc


def load_config(recipe: Recipe) -> Any:
    """The model's config with the recipe's overrides applied (cheap: no weights); its sizes checked."""
    from transformers import AutoConfig

    model = recipe.model
    reference = model.path or model.config
    assert reference is not None
    check_size_fields(model.config_overrides, "model.config_overrides.", "fix it in the recipe", whole=False)
    by_type = bool(model.config and BUILTIN_MODEL_TYPE.match(model.config) and not expand_path(model.config).exists())
    if by_type:
        try:
            config = AutoConfig.for_model(model.config)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"cannot load the model config {reference}: {exc}") from exc
    else:
        config = _read_config(reference, revision=model.revision, trust_remote_code=model.trust_remote_code)
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
            config = AutoConfig.for_model(model.config, **model.config_overrides)
        else:
            for key, value in model.config_overrides.items():
                setattr(config, key, value)
    except _config_errors() as exc:  # how transformers' configs refuse values
        raise ConfigError(
            f"model.config_overrides do not make a valid {config.model_type} config: {_first_line(exc)}"
        ) from exc
    _check_config_sizes(config, reference)
    return config


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
    if recipe.model.path and expand_path(recipe.model.path).is_dir():
        check_weights(recipe, config, expand_path(recipe.model.path))


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the model in ``directory`` (none where it has only PyTorch's); a
    directory without weights, or an index naming files it lacks, is refused."""
    if (directory / WEIGHTS).exists():
        return [directory / WEIGHTS]
    index = directory / WEIGHTS_INDEX
    if not index.exists():
        if any((directory / name).exists() for name in OTHER_WEIGHTS):
            return []
        raise ConfigError(f"{directory} has a config.json but no weights ({WEIGHTS} or {WEIGHTS_INDEX}): copy the "
                          "whole model directory")  # fmt: skip
    data = load_json_bounded(index, MAX_INDEX_BYTES, "the weights index")
    mapping = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(name, str) for name in mapping.values()):
        raise ConfigError(f"the weights index {index} has no weight_map of tensor names to files: copy the model again")
    files = []
    for name in sorted(set(mapping.values())):
        if Path(name).name != name or name in ("", ".", ".."):
            raise ConfigError(f"the weights index {index} names {shorten(repr(name))}, not a file beside it")
        if not (directory / name).exists():
            raise ConfigError(f"the weights index {index} names {name}, which {directory} lacks: copy the whole "
                              "model directory")  # fmt: skip
        files.append(directory / name)
    return files


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """The shape of each tensor in the safetensors file ``path``, from its header alone (memory-mapped,
    nothing read); a file that is no safetensors file (cut short, empty, a header length of 2^63, a
    header that is not one) is one ConfigError naming it, where transformers raises SafetensorError."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ConfigError(f"{path} is not a regular file (a directory, device or pipe): it should hold weights")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable safetensors file ({_first_line(exc)}): it is damaged or was "
                          "not copied whole; copy it again") from exc  # fmt: skip


def check_weights(recipe: Recipe, config: Any, directory: Path) -> None:
    """The weight files of the local model in ``directory`` are whole safetensors files whose tensors
    have the shapes ``config`` makes, checked from their headers before the data is tokenized: a
    damaged file or a config that is not the weights' (a width edited, another model's) is refused
    before transformers allocates the model and then fails to read them."""
    import itertools

    shapes = {key: (path, shape) for path in _weight_files(directory) for key, shape in tensor_shapes(path).items()}
    if not shapes or getattr(config, "quantization_config", None) is not None:  # packed: other shapes
        return
    model = _meta_model(recipe, config)
    if model is None:
        return
    made = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    expected = {name: list(tensor.shape) for name, tensor in made}
    prefix = getattr(model, "base_model_prefix", "")
    source = "config.json with model.config_overrides" if recipe.model.config_overrides else "config.json"
    for key, (path, shape) in shapes.items():
        want = expected.get(key, expected.get(f"{prefix}.{key}"))
        if want is not None and want != shape:
            raise ConfigError(
                f"{path} does not fit the model's config: its {key} is {shape}, the config ({source}) makes it "
                f"{want}; the config is another model's or was edited: correct it or copy the model again"
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
        except Exception as exc:  # noqa: BLE001 - narrowed by _load_error
            if not _load_error(exc):
                raise
            raise ConfigError(f"cannot load the model {model_settings.path}: {_first_line(exc)}") from exc
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


def _load_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised reading a model or an adapter, is about its files (a ConfigError line
    then), not the machine: what configs raise, a damaged safetensors file, PEFT's refusals, and
    torch's shape mismatch; out of memory and other runtime errors stay what they are."""
    from peft.utils.error import PeftError
    from safetensors import SafetensorError

    if isinstance(exc, (*_config_errors(), SafetensorError, PeftError)):
        return True
    return isinstance(exc, RuntimeError) and ("size mismatch" in str(exc) or "ignore_mismatched_sizes" in str(exc))


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


def check_adapter_config(adapter: Any, path: Path) -> int:
    """Refuse an adapter_config.json PEFT would fail on with a traceback, or allocate memory for
    without end: not a LoRA one, ranks that are no whole number from 1 to ``MAX_RANK``, an alpha that
    is no positive number, target modules that are not names. Returns the largest rank it asks."""
    if not isinstance(adapter, dict):
        raise ConfigError(f"{path} holds a {type(adapter).__name__}, not the JSON object PEFT writes: save the "
                          "adapter again")  # fmt: skip
    kind = adapter.get("peft_type")
    if kind != "LORA":
        raise ConfigError(f"{path}: peft_type is {shorten(repr(kind))}; ctrain loads LoRA adapters (peft_type: LORA)")
    ranks: dict[str, Any] = {"r": adapter.get("r")}
    alphas: dict[str, Any] = {"lora_alpha": adapter.get("lora_alpha")}
    for key, into in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        pattern = adapter.get(key)
        if pattern is not None and not isinstance(pattern, dict):
            raise ConfigError(f"{path}: {key} is {shorten(repr(pattern))}; it maps module names to numbers")
        into.update({f"{key}.{name}": value for name, value in (pattern or {}).items()})
    for name, value in ranks.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANK:
            raise ConfigError(f"{path}: {name} is {shorten(repr(value))}; an adapter's rank is a whole number from 1 "
                              f"to {MAX_RANK}: save the adapter again")  # fmt: skip
    for name, value in alphas.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{path}: {name} is {shorten(repr(value))}; LoRA's alpha is a positive number: save "
                              "the adapter again")  # fmt: skip
    targets = adapter.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{path}: target_modules is {shorten(repr(targets))}; it names the adapted modules, a "
                          "string or a list of strings: save the adapter again")  # fmt: skip
    return max(ranks.values())


def _pretrained_config(recipe: Recipe, reference: str) -> Any:
    """The config of the pretrained model ``reference``, its sizes checked and, when it is a local
    directory, its weight files against it (:func:`check_weights`)."""
    config = _read_config(reference, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code)
    _check_config_sizes(config, reference)
    if expand_path(reference).is_dir():
        check_weights(recipe, config, expand_path(reference))
    return config


def _from_pretrained(reference: str, **load: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained``; a model whose files it cannot read is one ConfigError."""
    from transformers import AutoModelForCausalLM

    local = expand_path(reference)
    try:
        return AutoModelForCausalLM.from_pretrained(str(local) if local.exists() else reference, **load)
    except Exception as exc:  # noqa: BLE001 - narrowed by _load_error
        if not _load_error(exc):
            raise
        raise ConfigError(f"cannot load the model {reference}: {_first_line(exc)}") from exc


def _with_adapter(recipe: Recipe, adapter_dir: Path, **load: Any) -> Any:
    """The base model (the recipe's ``model.path``, else the one the adapter names), sized to the
    adapter's tokenizer as training sized it, with the adapter in ``adapter_dir`` on it (a PeftModel).
    The adapter's config and files are checked before the base loads."""
    from peft import PeftModel

    settings = adapter_dir / ADAPTER_CONFIG
    adapter = load_json_bounded(settings, MAX_SETTINGS_BYTES, "the adapter's config")
    rank = check_adapter_config(adapter, settings)
    if (adapter_dir / ADAPTER_WEIGHTS).exists():
        tensor_shapes(adapter_dir / ADAPTER_WEIGHTS)
    elif not (adapter_dir / "adapter_model.bin").exists():
        raise ConfigError(f"{adapter_dir} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}: the adapter was not saved "
                          "whole; save or copy it again")  # fmt: skip
    named = adapter.get("base_model_name_or_path")
    reference = recipe.model.path or (named if isinstance(named, str) else None)
    if not reference:
        raise ConfigError(f"{adapter_dir} holds a LoRA adapter and neither it nor the recipe names its base model")
    config = _pretrained_config(recipe, reference)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    if isinstance(hidden, int) and rank > hidden:
        raise ConfigError(f"{settings} asks rank {rank}, more than the base model's hidden size ({hidden}, "
                          f"{reference}): is the adapter for another model?")  # fmt: skip
    base = _from_pretrained(reference, config=config, revision=recipe.model.revision,
                            trust_remote_code=recipe.model.trust_remote_code, **load)  # fmt: skip
    size = len(read_tokenizer(str(adapter_dir)))
    if size > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(size)
    try:
        with warnings.catch_warnings():  # transformers' deprecation notices, raised from inside PEFT
            warnings.simplefilter("ignore", FutureWarning)
            return PeftModel.from_pretrained(base, str(adapter_dir))
    except Exception as exc:  # noqa: BLE001 - narrowed by _load_error
        if not _load_error(exc):
            raise
        raise ConfigError(f"cannot put the adapter in {adapter_dir} on its base model {reference}: "
                          f"{_first_line(exc)}") from exc  # fmt: skip


def merge_adapters(recipe: Recipe, adapter_dir: Path, target: Path, dtype: Any) -> None:
    """Fold the adapter in ``adapter_dir`` into a fresh copy of the base model and save it to ``target``
    with weights in ``dtype`` (:func:`final_dtype`).

    The base is loaded again on the CPU, not taken from training: merging into QLoRA's 4-bit weights
    would round the result, and the training model may be wrapped or sharded.
    """
    adapted = _with_adapter(recipe, adapter_dir, dtype=dtype)
    with warnings.catch_warnings():  # transformers' deprecation notices, raised from inside PEFT
        warnings.simplefilter("ignore", FutureWarning)
        adapted.merge_and_unload().save_pretrained(str(target))
    read_tokenizer(str(adapter_dir)).save_pretrained(str(target))


def load_trained(model_dir: Path, recipe: Recipe) -> Any:
    """A trained model for inference: a full model, or the recipe's base with the adapter in ``model_dir``.
    A damaged one is one ConfigError naming it, before its weights are read where that can be told."""
    if not (model_dir / ADAPTER_CONFIG).is_file():
        config = _pretrained_config(recipe, str(model_dir))
        return _from_pretrained(str(model_dir), config=config)
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
