"""Bytes per token that one compiled LoRA decoder layer of a Llama-3.1-8B shape keeps for its backward pass.

Runs on a CPU (bf16 autocast, compiled with inductor, ~1 minute a case): the compiler's choice of
what to keep is the same as on a GPU, except attention, which runs uncompiled on a CPU and keeps
fp32 copies (flash attention on a GPU keeps q, k, v and its output in bf16). Used in
docs/benchmarks.md to see what adapter dropout and fast.group_adapters cost in memory:

    PYTHONPATH=src .venv/bin/python scripts/saved-activations.py [--ungrouped] [--dropout P] [--tokens T] [--budget F]
"""

from __future__ import annotations

import argparse
import collections

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from ctrain.fast import FastSettings, decoder_layers, prepare_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ungrouped", action="store_true", help="PEFT's forward for every adapter")
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--budget", type=float, help="fast.activation_memory_budget (CPU cost model, not the GPU's)")
    args = parser.parse_args()
    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=1, vocab_size=512, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=args.dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    settings = FastSettings(compile="layers", group_adapters=not args.ungrouped, activation_memory_budget=args.budget)
    prepare_model(model, settings, "cpu")
    weights = {p.data_ptr() for p in model.parameters()}
    layer = decoder_layers(model)[0]
    inside = [False]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t
        return t

    t = args.tokens
    ids = torch.randint(0, config.vocab_size, (1, t))
    positions = torch.cat([torch.arange(t // 2), torch.arange(t - t // 2)])[None]  # two packed documents
    for _ in range(2):  # the second step runs the compiled graphs
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
    by_kind: collections.Counter[str] = collections.Counter()
    for x in kept.values():
        by_kind[f"{str(x.dtype).removeprefix('torch.')} x {x.shape[-1] if x.dim() else 1}"] += x.untyped_storage().nbytes()
    total = sum(by_kind.values())
    budget = f", budget {args.budget}" if args.budget else ""
    print(f"{'ungrouped' if args.ungrouped else 'grouped'}, dropout {args.dropout}{budget}: {total / t / 1024:.1f} KiB a token")
    for kind, size in by_kind.most_common():
        print(f"  {kind:>18}: {size / t / 1024:6.1f} KiB a token")


if __name__ == "__main__":
    main()
