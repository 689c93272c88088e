"""The fixed benchmark: model shape, synthetic data, and the FLOP count that MFU is measured against."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

# Dense bf16 peak of an H100/H200 SXM (datasheet); MFU is quoted against it.
PEAK_FLOPS = 989e12


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark problem. ``FULL`` is the published one; ``TINY`` checks the code on a CPU."""

    name: str = "llama-374m"
    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    kv_heads: int = 16
    intermediate: int = 2816
    vocab: int = 32000
    examples: int = 6000
    length_mu: float = 6.4
    length_sigma: float = 0.7
    min_length: int = 64
    max_length: int = 2048
    # Longest example (clipped); None: max_length. Packed rows longer than the examples keep their
    # lengths as they are.
    longest_example: int | None = None
    seed: int = 0
    # Per-device batch of the seeds' settings (examples; packed rows on the fast path).
    batch: int = 8

    def model_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
            max_position_embeddings=self.max_length,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )

    def parameters(self) -> int:
        """Parameter count, from the shapes (the model need not exist)."""
        attn = self.hidden * self.hidden * 2 + self.hidden * (self.hidden // self.heads) * self.kv_heads * 2
        mlp = 3 * self.hidden * self.intermediate
        layer = attn + mlp + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * layer + self.hidden

    def flops_per_token(self, attention_context: float, frozen: bool = False) -> tuple[float, float]:
        """Training FLOPs per token: ``6N``, and ``6N`` plus causal attention over ``attention_context``.

        ``frozen``: the weights take no gradient (LoRA's base), so the backward pass computes only
        the gradients of the activations: ``4N`` instead of ``6N`` (the adapters' own FLOPs, under
        1% at rank 16, are left out).

        The attention term is forward+backward of ``QK^T`` and ``PV`` with a causal mask:
        ``6 * layers * hidden * context``, where the context is the length-weighted mean document
        length (sum of squared lengths over sum of lengths), since packed documents only attend
        within themselves.
        """
        dense = (4.0 if frozen else 6.0) * self.parameters()
        return dense, dense + 6.0 * self.layers * self.hidden * attention_context


FULL = BenchSpec()
# The LoRA cases' base: Llama-3.1-8B's shape (8.03B parameters), random weights, same chats.
LLAMA_8B = replace(
    FULL, name="llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256
)
# Full fine-tuning of the 8B shape: the LoRA cases' chats (clipped at 2048 tokens) packed into
# 4096-token rows, 2 rows (8192 tokens) per GPU in the seeds' settings.
LLAMA_8B_4K = replace(LLAMA_8B, name="llama-3.1-8b-4k", max_length=4096, longest_example=2048, batch=2)
TINY = replace(
    FULL,
    name="tiny",
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=4,
    intermediate=176,
    vocab=512,
    examples=96,
    length_mu=3.6,
    length_sigma=0.5,
    min_length=8,
    max_length=128,
)
