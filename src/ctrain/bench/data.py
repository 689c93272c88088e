"""Synthetic pre-tokenized chats for the benchmark, and a tokenizer that knows their special tokens.

Each example is ``<s> <user> u1..uk <assistant> a1..am </s>`` with a total length drawn from a
log-normal, so batch shapes vary like real chat data. User tokens follow a Zipf-like law; the
assistant repeats the user's tokens, which a model can learn, so the loss curve moves. Loss is on
the assistant's tokens and the closing ``</s>`` only (``assistant_masks``), as in chat SFT.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ctrain.bench.spec import BenchSpec

PAD, BOS, EOS, USER, ASSISTANT = 0, 1, 2, 3, 4
SPECIAL = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<user>": USER, "<assistant>": ASSISTANT}
FIRST_WORD = len(SPECIAL)
# The chats as text (``chats``) become the examples' exact tokens and loss mask again through this
# template: the user turn after ``<s> <user>``, the reply and ``</s>`` inside the generation markers.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<s><user> {{ m['content'] }} <assistant> "
    "{% else %}{% generation %}{{ m['content'] }} </s>{% endgeneration %}{% endif %}{% endfor %}"
)


def lengths(spec: BenchSpec) -> np.ndarray:
    """Example lengths in tokens: log-normal, rounded, clipped to the spec's range."""
    rng = np.random.default_rng(spec.seed)
    raw = rng.lognormal(spec.length_mu, spec.length_sigma, spec.examples)
    return np.clip(np.rint(raw), spec.min_length, spec.longest_example or spec.max_length).astype(np.int64)


def attention_context(lens: np.ndarray) -> float:
    """Length-weighted mean document length, the context each token attends over (see spec FLOPs)."""
    lens = lens.astype(np.float64)
    return float((lens**2).sum() / lens.sum())


def examples(spec: BenchSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat token ids, flat assistant mask, and offsets (``examples + 1``) of all examples."""
    lens = lengths(spec)
    rng = np.random.default_rng(spec.seed + 1)
    words = spec.vocab - FIRST_WORD
    weights = 1.0 / (np.arange(words) + 10.0) ** 1.1
    offsets = np.concatenate([[0], np.cumsum(lens)])
    ids = np.empty(offsets[-1], dtype=np.int32)
    mask = np.zeros(offsets[-1], dtype=np.int8)
    content = rng.choice(words, size=offsets[-1], p=weights / weights.sum()).astype(np.int32) + FIRST_WORD
    for i, n in enumerate(lens):
        row = ids[offsets[i] : offsets[i + 1]]
        body = n - 4  # <s> <user> ... <assistant> ... </s>
        user = max(1, int(body * 0.4))
        reply = body - user
        row[0], row[1] = BOS, USER
        row[2 : 2 + user] = content[offsets[i] : offsets[i] + user]
        row[2 + user] = ASSISTANT
        row[3 + user : 3 + user + reply] = np.resize(row[2 : 2 + user], reply)
        row[-1] = EOS
        mask[offsets[i] + 3 + user : offsets[i + 1]] = 1
    return ids, mask, offsets


def _rows(ids: np.ndarray, offsets: np.ndarray, column: str, values: np.ndarray) -> Any:
    """A ``datasets.Dataset`` of ``input_ids`` and one more per-token column, cut at ``offsets``."""
    import datasets
    import pyarrow as pa

    off = pa.array(offsets.astype(np.int32))
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(off, pa.array(ids)),
            column: pa.ListArray.from_arrays(off, pa.array(values)),
        }
    )
    return datasets.Dataset(table)


def dataset(spec: BenchSpec) -> Any:
    """The examples as TRL takes pre-tokenized chats: ``input_ids`` and ``assistant_masks``."""
    ids, mask, offsets = examples(spec)
    return _rows(ids, offsets, "assistant_masks", mask)


def labelled(spec: BenchSpec) -> Any:
    """The examples as ``ctrain.train.data`` tokenizes chats: ``input_ids`` and ``labels`` (-100 off the assistant)."""
    ids, mask, offsets = examples(spec)
    return _rows(ids, offsets, "labels", np.where(mask.astype(bool), ids, -100).astype(np.int32))


def word(token: int) -> str:
    """The text of a synthetic word token, as the tokenizer's vocabulary and the chats spell it."""
    return f"w{token}"


def chats(spec: BenchSpec) -> Iterator[dict[str, Any]]:
    """The examples as chat text (:func:`word`: ``w17`` is token 17), which :data:`CHAT_TEMPLATE` and
    :func:`tokenizer` turn back into :func:`labelled`'s rows: the problem as ``ctrain train`` reads it."""
    ids, _, offsets = examples(spec)
    for start, end in zip(offsets[:-1], offsets[1:]):
        row = ids[start:end]
        split = int(np.flatnonzero(row == ASSISTANT)[0])
        user, reply = row[2:split], row[split + 1 : -1]
        yield {
            "messages": [
                {"role": "user", "content": " ".join(map(word, user))},
                {"role": "assistant", "content": " ".join(map(word, reply))},
            ]
        }


def tokenizer(spec: BenchSpec) -> Any:
    """A word-level tokenizer over the synthetic vocabulary, with the chats' template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(SPECIAL)
    vocab.update({word(i): i for i in range(FIRST_WORD, spec.vocab)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    made = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
    made.chat_template = CHAT_TEMPLATE
    return made
