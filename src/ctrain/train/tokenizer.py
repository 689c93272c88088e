"""Tokenizers: loaded from a path or hub name, or trained on the recipe's data for from-scratch models.

A trained tokenizer is byte-level BPE (any text encodes, nothing is unknown) with each digit its
own token, so numbers are read digit by digit. It gets ctrain's chat template, whose assistant
turns carry ``{% generation %}`` markers so the loss can be limited to what the assistant says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError
from ctrain.files import load_json_bounded, read_text_bounded
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train.recipe import Recipe, TokenizerTraining, expand_path

log = logging.getLogger("ctrain.train")

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = [PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES)]

# Every turn ends with EOS; only the assistant's words and its EOS fall inside the generation
# markers, so with assistant-only loss the model learns to answer and to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def texts_for_training(rows: Iterable[dict[str, Any]], recipe: Recipe) -> Iterator[str]:
    """The text of each example: chat message contents, prompt and completion, or the text column."""
    data = recipe.data
    for row in rows:
        if data.messages_column in row and recipe.task == "sft":
            for message in row[data.messages_column]:
                yield str(message.get("content") or "")
        elif data.prompt_column in row and data.completion_column in row and recipe.task == "sft":
            for part in (row[data.prompt_column], row[data.completion_column]):
                if isinstance(part, list):
                    yield from (str(m.get("content") or "") for m in part)
                else:
                    yield str(part)
        else:
            yield str(row[data.text_column])


def train_tokenizer(texts: Iterable[str], settings: TokenizerTraining) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=10**9,
    )


def load_tokenizer(recipe: Recipe) -> Any:
    """The tokenizer named by ``tokenizer.path`` (else the model's), with a pad token."""
    reference = recipe.tokenizer.path or recipe.model.path
    assert reference is not None, "recipe validation guarantees a tokenizer source"
    revision = recipe.model.revision if not recipe.tokenizer.path else None
    tokenizer = read_tokenizer(reference, revision=revision, trust_remote_code=recipe.model.trust_remote_code)
    return finish_tokenizer(tokenizer, recipe)


# A tokenizer_config.json is read whole before transformers reads it: its settings and added tokens
# are kilobytes; more is not a tokenizer's config.
MAX_TOKENIZER_CONFIG_BYTES = 64 * 2**20
# What transformers and the tokenizers library raise for a damaged tokenizer file: a tokenizer.json
# without its keys (KeyError), of the wrong shape (TypeError, AttributeError), nested too deep to
# parse (RecursionError), or one the Rust parser refuses (a plain Exception, matched by its type).
TOKENIZER_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError)


def read_tokenizer(reference: str, **load: Any) -> Any:
    """``AutoTokenizer.from_pretrained(reference)``; a tokenizer that cannot load, local or from the
    hub, is one ConfigError naming it and what is wrong (never the parser's traceback)."""
    from transformers import AutoTokenizer

    local = expand_path(reference)
    settings = local / "tokenizer_config.json"
    if settings.is_file():
        data = load_json_bounded(settings, MAX_TOKENIZER_CONFIG_BYTES, "the tokenizer's config")
        if not isinstance(data, dict):
            raise ConfigError(f"the tokenizer's config {settings} holds a {type(data).__name__}, not a JSON object "
                              "of settings: copy the tokenizer files again")  # fmt: skip
    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else reference, **load)
    except Exception as exc:  # noqa: BLE001 - narrowed just below
        if not isinstance(exc, TOKENIZER_ERRORS) and type(exc) is not Exception:
            raise
        raise ConfigError(f"cannot load the tokenizer {reference}: {_detail(exc, local)}") from exc


def _detail(exc: BaseException, local: Path) -> str:
    """What is wrong, in one line: the error's own words, or what a bare KeyError or RecursionError means."""
    if isinstance(exc, RecursionError):
        return "a file of it nests too deep to read (tokenizer.json or tokenizer_config.json is damaged)"
    if isinstance(exc, KeyError):
        return f"a file of it lacks the key {exc} (is {local / 'tokenizer.json'} a tokenizer's file?)"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def finish_tokenizer(tokenizer: Any, recipe: Recipe) -> Any:
    """Apply the recipe's chat template and make sure a pad token exists."""
    if recipe.tokenizer.chat_template:
        tokenizer.chat_template = read_text_bounded(
            expand_path(recipe.tokenizer.chat_template), MAX_SETTINGS_BYTES, "tokenizer.chat_template:"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"the tokenizer {recipe.tokenizer.path or recipe.model.path} has neither a pad nor an eos token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
