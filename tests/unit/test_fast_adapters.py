"""ctrain.fast.adapters: LoRA adapters of projections that share an input, computed together."""

from __future__ import annotations

import pytest

from tests.conftest import require
import torch

from ctrain.fast import FastSettings, compile_layers, decoder_layers, prepare_model
from ctrain.fast import adapters
from ctrain.fast.adapters import group_adapters
from tests.unit.test_fast import explain_on_the_kernel_path, packed_batch, random_examples, tiny_llama

peft = require("peft")


def adapted(dropout: float = 0.0, seed: int = 0):
    """The tiny Llama with r4 adapters on all seven projections, their B made non-zero (a fresh B is
    zero, which would hide a wrong B path)."""
    model = peft.get_peft_model(tiny_llama(seed), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                   target_modules="all-linear"))  # fmt: skip
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_groups_are_q_k_v_and_gate_up_of_each_layer():
    model = adapted()
    assert group_adapters(model) == 2 * len(decoder_layers(model))
    assert group_adapters(tiny_llama()) == 0, "a model without adapters has nothing to group"


def test_the_fast_engine_groups_adapters_unless_told_not_to():
    grouped, plain = adapted(), adapted()
    prepare_model(grouped, FastSettings(compile="off"), "cpu")
    prepare_model(plain, FastSettings(compile="off", group_adapters=False), "cpu")
    attention = [m for m in grouped.modules() if type(m).__name__ == "LlamaAttention"]
    assert attention and all(m._ctrain_groups == (("q_proj", "k_proj", "v_proj"),) for m in attention)
    assert not any(hasattr(m, "_ctrain_groups") for m in plain.modules())


@pytest.mark.parametrize("backend", [None, pytest.param("aot_eager", marks=pytest.mark.full)])
def test_grouped_adapters_compute_what_peft_computes(backend, monkeypatch):
    """Without dropout the groups are PEFT's arithmetic: the same loss and adapter gradients, compiled
    or not; and no group holds a tensor once the forward is done. Compiled (aot_eager) in the full tier
    alone; CI tier: test_grouped_adapters_compute_what_peft_computes (eager) and
    test_compiled_layers_share_one_graph_and_do_not_recompile (compiled layers)."""
    batch = packed_batch(random_examples(8, (23, 11, 30)))
    reference, grouped = adapted(), adapted()
    prepare_model(reference, FastSettings(compile="off", group_adapters=False), "cpu")
    prepare_model(grouped, FastSettings(compile="off", group_adapters=True), "cpu")
    if backend:
        torch._dynamo.reset()
        compile_layers(grouped, backend=backend)
    loss, grads = loss_and_grads(reference, batch)
    computed = []
    original = adapters._outputs
    monkeypatch.setattr(adapters, "_outputs", lambda members, *a: computed.append(len(members)) or original(members, *a))
    loss_grouped, grads_grouped = loss_and_grads(grouped, batch)
    if backend is None:  # every layer's q/k/v and gate/up went through their group
        assert computed == [3, 2] * len(decoder_layers(grouped)), computed
    assert loss_grouped == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == grads_grouped.keys() and len(grads) == 2 * 7 * 3
    for name, grad in grads.items():
        torch.testing.assert_close(grads_grouped[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for module in grouped.modules():
        assert getattr(module, "_ctrain_output", None) is None, "a group holds a tensor after the forward"


def test_grouped_adapters_share_one_dropout_mask():
    """With dropout the members of a group see the same dropped input: q's, k's and v's adapters of a
    layer, fed through the group, equal each one's own A and B applied to one masked input."""
    model = adapted(dropout=0.5)
    group_adapters(model)
    model.train()
    attention = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(1, 9, 64)
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o)) for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
    torch.manual_seed(3)
    rope = model.base_model.model.model.rotary_emb(x, torch.arange(9)[None])
    attention(x, position_embeddings=rope, attention_mask=None)
    for hook in hooks:
        hook.remove()
    outputs = seen
    torch.manual_seed(3)
    mask = torch.nn.functional.dropout(torch.ones_like(x), 0.5, training=True)
    for module, out in zip((attention.q_proj, attention.k_proj, attention.v_proj), outputs, strict=True):
        a, b = module.lora_A["default"], module.lora_B["default"]
        expected = module.base_layer(x) + b(a(x * mask)) * module.scaling["default"]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state", ["merged", "disabled", "eval"])
def test_groups_fall_back_to_peft_where_they_are_not_plain_lora(state):
    """Merged or disabled adapters go through PEFT's own forward; in eval mode (no dropout) the groups
    give PEFT's outputs."""
    reference, grouped = adapted(dropout=0.1), adapted(dropout=0.1)
    group_adapters(grouped)
    batch = packed_batch(random_examples(9, (12, 20)))
    for model in (reference, grouped):
        model.eval()
        if state == "merged":
            model.merge_adapter()
    with torch.no_grad():
        if state == "disabled":
            with reference.disable_adapter(), grouped.disable_adapter():
                expected, got = reference(**batch).loss, grouped(**batch).loss
        else:
            expected, got = reference(**batch).loss, grouped(**batch).loss
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_checkpointing_makes_the_embeddings_output_need_a_gradient_once():
    """The frozen embeddings get one hook that makes their output need a gradient, whether
    checkpointing was asked of the model before (add_adapters does) or only of the fast engine."""
    from ctrain.fast import checkpoint_layers

    for already in (False, True):
        model = adapted()
        if already:
            model.enable_input_require_grads()
        checkpoint_layers(model)
        embeddings = model.get_input_embeddings()
        assert len(embeddings._forward_hooks) == 1, (already, embeddings._forward_hooks)


def test_grouped_layer_traces_into_one_graph_on_the_kernel_path():
    """On the GPU kernel path (meta tensors stand in for CUDA), a layer with grouped adapters in
    training mode compiles as one graph without breaks, as it does with PEFT's forward."""
    with torch.device("meta"):
        model = tiny_llama().to(torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    prepare_model(model, FastSettings(compile="off", group_adapters=True), "cpu")
    model.train()
    layer = decoder_layers(model)[0]
    assert type(layer.self_attn).forward is not type(layer.self_attn).__mro__[1].forward, "not grouped"
    explained = explain_on_the_kernel_path(layer)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
