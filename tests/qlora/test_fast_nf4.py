"""QLoRA's 4-bit base layers dequantised inside the compiled layers (ctrain.fast.nf4), against
bitsandbytes itself: the same weights bit for bit, the same loss and adapter gradients, and no
dequantised weight kept for the backward pass."""

from __future__ import annotations

import bitsandbytes as bnb
import peft
import pytest
import torch

from ctrain.fast import FastSettings, prepare_model
from ctrain.fast.nf4 import dequantized, inline_4bit
from tests.unit.test_fast import packed_batch, random_examples, tiny_llama

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def four_bit(linear: torch.nn.Linear, nested: bool = True) -> torch.nn.Module:
    """``linear`` quantised the way QLoRA loads a base (NF4, double quantisation when ``nested``)."""
    dtype = linear.weight.dtype
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=dtype,
        compress_statistics=nested,
        quant_type="nf4",
    )
    layer.weight = bnb.nn.Params4bit(
        linear.weight.data.clone(), requires_grad=False, compress_statistics=nested, quant_type="nf4"
    )
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to("cpu")  # quantises


def four_bit_llama() -> torch.nn.Module:
    """The tiny Llama with every projection of its layers in 4 bits and LoRA adapters on them."""
    model = tiny_llama()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in PROJECTIONS:
                    setattr(parent, name, four_bit(child))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(PROJECTIONS))
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape", [(128, 64), (96, 320)])  # 480 blocks: not whole blocks of 256 scales
def test_dequantised_weight_is_bitsandbytes_own_bit_for_bit(nested, shape):
    torch.manual_seed(1)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    layer = four_bit(linear, nested)
    reference = bnb.functional.dequantize_4bit(layer.weight, layer.weight.quant_state)
    x = torch.randn(9, shape[1], dtype=torch.bfloat16)
    expected = layer(x)
    assert inline_4bit(layer) == 1
    ours = dequantized(layer, torch.bfloat16)
    assert ours.dtype == reference.dtype and torch.equal(ours, reference)
    assert torch.equal(layer(x), expected)
    assert isinstance(layer, bnb.nn.Linear4bit) and inline_4bit(layer) == 0, "once is enough"
    # The state dict is bitsandbytes' own: nothing of ctrain's is saved with a checkpoint.
    assert not any("_ctrain" in key for key in layer.state_dict())


def test_other_4bit_formats_keep_bitsandbytes_forward():
    linear = torch.nn.Linear(64, 32, bias=False)
    layer = bnb.nn.Linear4bit(64, 32, bias=False, quant_type="fp4")
    layer.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="fp4")
    layer = layer.to("cpu")
    assert inline_4bit(layer) == 0 and type(layer) is bnb.nn.Linear4bit


def test_compiled_qlora_layers_train_like_bitsandbytes_and_keep_no_dequantised_weight():
    """The compiled layers with the dequantisation inlined (under a memory budget, as the QLoRA
    recipe runs) give bitsandbytes' loss and adapter gradients, and what they keep for the backward
    pass holds no weight-shaped tensor: the dequantised weights are made again, not kept."""
    batch = packed_batch(random_examples(8, (19, 33, 7)))  # 59 tokens: no activation looks like a weight
    reference = four_bit_llama()
    prepare_model(reference, FastSettings(compile="off"), "cpu")
    model = four_bit_llama()  # the same seed: the same base and adapters
    torch._dynamo.reset()
    prepare_model(model, FastSettings(compile="layers", activation_memory_budget=0.5), "cpu")
    inlined = [m for m in model.modules() if getattr(m, "_ctrain_packed", None) is not None]
    assert len(inlined) == 3 * len(PROJECTIONS)
    weights = {tuple(m._ctrain_shape) for m in inlined}
    params = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    kept: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params and t.is_floating_point():
            kept.append(tuple(t.shape))
        return t

    losses, grads = [], []
    for m in (reference, model):
        m.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(**batch, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 3 * len(PROJECTIONS)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert kept, "the hook saw nothing"
    assert not weights & set(kept), f"a dequantised weight was kept for the backward pass: {weights & set(kept)}"


@pytest.mark.parametrize(
    ("settings", "checkpointing", "inlined"),
    [
        (FastSettings(compile="layers", activation_memory_budget=0.5), False, True),
        (FastSettings(compile="layers"), True, True),
        (FastSettings(compile="layers", gradient_checkpointing=True), False, True),
        # Without recomputation the compiler keeps each dequantised weight for the backward pass.
        (FastSettings(compile="layers"), False, False),
        (FastSettings(compile="layers", activation_memory_budget=1.0), False, False),
        (FastSettings(compile="layers", activation_memory_budget=0.5, inline_4bit=False), False, False),
        (FastSettings(compile="off"), True, False),
    ],
)
def test_inlined_where_the_layers_compile_and_recompute(settings, checkpointing, inlined):
    torch._dynamo.reset()
    model = four_bit_llama()
    prepare_model(model, settings, "cpu", checkpointing=checkpointing)
    assert any(hasattr(m, "_ctrain_packed") for m in model.modules()) is inlined
