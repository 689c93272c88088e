"""The fast path's pieces compute what the plain path computes (CPU, float32/float64)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tests.conftest import require

torch = require("torch")
require("trl")

from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import add_fused_lm_head

from ctrain.errors import ConfigError
from ctrain.fast import (
    FastSettings,
    attention,
    checkpoint_layers,
    compile_layers,
    decoder_layers,
    prepare_model,
    sft_overrides,
)
from ctrain.settings import from_mapping


def tiny_llama(seed: int = 0, kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=128,
        vocab_size=300,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def random_examples(seed: int, lengths: tuple[int, ...]) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, 300, (n,), generator=gen).tolist()} for n in lengths]


def packed_batch(examples: list[dict]) -> dict:
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    batch.pop("seq_idx")
    return batch


def per_example_loss(model: LlamaForCausalLM, examples: list[dict]) -> torch.Tensor:
    """Token-weighted mean loss, one forward per example (nothing to leak between examples)."""
    total, count = 0.0, 0
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        n = ids.shape[1] - 1
        total = total + model(input_ids=ids, labels=ids, use_cache=False).loss * n
        count += n
    return total / count


def dense_block_causal(q, k, v, cu):
    """Masked attention over the whole row: causal, and only within a document."""
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long())
    pos = torch.arange(q.shape[0])
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_varlen_is_block_diagonal_causal_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (5,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    total = int(cu[-1])
    q = torch.randn(total, 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(total, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    out = attention.reference_varlen(q, k, v, cu)
    ref = dense_block_causal(q, k, v, cu)
    assert torch.allclose(out, ref, atol=1e-12)


def test_packed_loss_and_grads_equal_per_example_training():
    examples = random_examples(0, (17, 40, 5, 33))
    plain = tiny_llama()
    fast = tiny_llama()
    prepare_model(fast, FastSettings(), "cpu")
    assert fast.config._attn_implementation == attention.NAME

    ref = per_example_loss(plain, examples)
    ref.backward()
    out = fast(**packed_batch(examples), use_cache=False)
    out.loss.backward()

    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), fast.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_packed_rows_would_leak_without_document_masking():
    """The check above can fail: plain causal attention over the packed row gives another loss."""
    examples = random_examples(1, (30, 30))
    model = tiny_llama()
    batch = packed_batch(examples)
    leaky = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    assert leaky.item() != pytest.approx(per_example_loss(model, examples).item(), rel=1e-4)


def test_boundaries_from_position_ids_when_collator_gives_none():
    examples = random_examples(2, (12, 9, 20))
    model = tiny_llama()
    prepare_model(model, FastSettings(), "cpu")
    batch = packed_batch(examples)
    with_cu = model(**batch, use_cache=False).loss
    only_positions = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    assert model(**only_positions, use_cache=False).loss.item() == pytest.approx(with_cu.item(), rel=1e-6)


def test_padded_batches_still_use_the_padding_mask():
    """Evaluation and generation batches come padded: same outputs as transformers' SDPA."""
    plain = tiny_llama()
    fast = tiny_llama()
    prepare_model(fast, FastSettings(), "cpu")
    ids = torch.randint(5, 300, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    a = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    b = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1, :8], b[1, :8], atol=1e-5)


def test_chunked_lm_head_loss_equals_full_logits_loss():
    """TRL's fused LM head, which the fast path trains with, equals the plain cross-entropy."""
    examples = random_examples(3, (25, 14, 31))
    batch = packed_batch(examples)
    model = tiny_llama()
    prepare_model(model, FastSettings(), "cpu")
    full = model(**batch, use_cache=False).loss
    add_fused_lm_head(model, outputs=("log_probs",))
    chunked = model(**batch, use_cache=False, fused_lm_head=True).loss
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)


def test_compiled_layers_share_one_graph_and_do_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    eager = tiny_llama()
    prepare_model(model, FastSettings(compile="off"), "cpu")
    prepare_model(eager, FastSettings(compile="off"), "cpu")
    assert compile_layers(model, backend="aot_eager") == 3
    first = packed_batch(random_examples(4, (17, 40, 5)))
    second = packed_batch(random_examples(5, (23, 8, 30, 11)))
    model(**first, use_cache=False).loss.backward()
    graphs = counters["stats"]["unique_graphs"]
    out = model(**second, use_cache=False).loss
    out.backward()
    assert counters["stats"]["unique_graphs"] == graphs, "a new batch shape recompiled the layers"
    assert out.item() == pytest.approx(eager(**second, use_cache=False).loss.item(), rel=1e-6)


def saved_tensor_count(model: LlamaForCausalLM, batch: dict) -> tuple[int, torch.Tensor]:
    """How many tensors the forward keeps for the backward, and the loss."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch, use_cache=False).loss
    return count, loss


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_checkpointed_layers_keep_less_and_compute_the_same(backend):
    """Checkpointing in the fast path (around each layer, compiled or not) saves fewer tensors and
    gives the same loss and gradients as keeping every activation."""
    batch = packed_batch(random_examples(6, (19, 33, 7)))
    plain, checkpointed = tiny_llama(), tiny_llama()
    prepare_model(plain, FastSettings(compile="off"), "cpu")
    if backend:
        torch._dynamo.reset()
        prepare_model(checkpointed, FastSettings(compile="off"), "cpu")
        compile_layers(checkpointed, backend=backend)
        checkpoint_layers(checkpointed)
    else:
        prepare_model(checkpointed, FastSettings(compile="off"), "cpu", checkpointing=True)
    kept, loss = saved_tensor_count(plain, batch)
    kept_checkpointed, loss_checkpointed = saved_tensor_count(checkpointed, batch)
    assert kept_checkpointed < kept / 2, (kept_checkpointed, kept)
    loss.backward()
    loss_checkpointed.backward()
    assert loss_checkpointed.item() == pytest.approx(loss.item(), rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert not sft_overrides(FastSettings(gradient_checkpointing=True), "cpu")["activation_checkpointing"]


def test_checkpointed_adapters_get_the_same_gradients():
    """LoRA on a frozen base, adapter dropout on: checkpointing redraws the same dropout mask and
    gives the adapters the gradients they get without it."""
    peft = require("peft")
    batch = packed_batch(random_examples(7, (21, 9, 30)))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules="all-linear")
    grads = []
    for checkpointing in (False, True):
        model = peft.get_peft_model(tiny_llama(), config)
        prepare_model(model, FastSettings(compile="off"), "cpu", checkpointing=checkpointing)
        model.train()
        torch.manual_seed(11)
        model(**batch, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any("layers.0." in n for n in grads[1])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_kernel_path_traces_into_one_graph_per_layer():
    """On the kernel path (meta tensors stand in for CUDA), a layer compiles without graph breaks."""
    with torch.device("meta"):
        model = tiny_llama().to(torch.bfloat16)
    prepare_model(model, FastSettings(compile="off"), "cpu")
    explained = explain_on_the_kernel_path(decoder_layers(model)[0])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def explain_on_the_kernel_path(layer) -> Any:
    """``torch._dynamo.explain`` of a tiny Llama layer's forward on meta tensors (bf16, 50 packed tokens)."""
    t = 50
    h = torch.randn(1, t, 64, device="meta", dtype=torch.bfloat16)
    rope = torch.randn(1, t, 16, device="meta", dtype=torch.bfloat16)
    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    return torch._dynamo.explain(layer.forward)(
        h, position_embeddings=(rope, rope), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30
    )


def test_self_check_reports_small_errors_on_cpu():
    errors = attention.self_check("cpu", torch.float64)
    assert errors["fused"] == 0.0
    assert max(v for k, v in errors.items() if k != "fused") < 1e-10


def test_sft_overrides_per_batching_mode():
    packed = sft_overrides(FastSettings(), "cuda")
    assert packed["packing"] and packed["padding_free"] and packed["packing_strategy"] == "bfd"
    assert packed["bf16"] and packed["optim"] == "adamw_torch_fused"
    assert not packed.get("activation_checkpointing", packed.get("gradient_checkpointing"))
    free = sft_overrides(FastSettings(batching="padding_free"), "cpu")
    assert free["padding_free"] and "packing" not in free and "bf16" not in free
    padded = sft_overrides(FastSettings(batching="padded", attention="sdpa"), "cuda")
    assert "padding_free" not in padded


def test_settings_reject_packing_without_document_masking():
    with pytest.raises(ConfigError, match="varlen"):
        from_mapping(FastSettings, {"attention": "sdpa"}, where="fast")
    with pytest.raises(ConfigError, match="batching"):
        from_mapping(FastSettings, {"batching": "pack"}, where="fast")
    assert from_mapping(FastSettings, {"compile": "off"}, where="fast").compiles("cuda") is False
    assert FastSettings().compiles("cuda") and not FastSettings().compiles("cpu")


def test_attention_dropout_is_refused_up_front():
    model = tiny_llama()
    model.config.attention_dropout = 0.1
    with pytest.raises(ConfigError, match="dropout"):
        prepare_model(model, FastSettings(), "cpu")


def test_auto_engine_on_a_gpu_is_fast_unless_transformers_speedups_are_asked(monkeypatch, tmp_path):
    from ctrain.train.recipe import load_recipe
    from ctrain.train.trainer import plan
    from tests.plugins.train import TINY_RECIPE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    packed = ["data.packing=true"]
    assert plan(load_recipe(path, packed)).engine == "fast"
    assert plan(load_recipe(path, [*packed, "training.torch_compile=true"])).engine == "hf"
    assert plan(load_recipe(path, [*packed, "training.liger_kernel=true"])).engine == "hf"
    assert plan(load_recipe(path)).engine == "hf"  # unpacked data, fast.batching packed


def test_nan_filter_is_off_only_without_per_step_syncs():
    assert sft_overrides(FastSettings(), "cuda")["logging_nan_inf_filter"] is False
    assert sft_overrides(FastSettings(sync_metrics=True), "cuda")["logging_nan_inf_filter"] is True


def test_rank_balanced_sampler_is_a_permutation_dealt_evenly_by_cost():
    from ctrain.fast.trainer import RankBalancedSampler, deal

    rng = np.random.default_rng(3)
    costs = rng.lognormal(12, 0.6, size=1000)
    world, per_device = 4, 16
    sampler = RankBalancedSampler(costs, world, per_device, seed=5)
    order = list(sampler)
    assert sorted(order) == list(range(1000)) and len(sampler) == 1000
    assert order == list(RankBalancedSampler(costs, world, per_device, seed=5)), "ranks must agree on the order"
    sampler.set_epoch(1)
    assert list(sampler) != order
    step = world * per_device
    balanced, plain = [], []
    shuffled = np.random.default_rng((5, 0)).permutation(1000)
    for i in range(0, 1000 - 1000 % step, step):
        ours = np.array(order[i : i + step]).reshape(world, per_device)
        assert sorted(ours.ravel()) == sorted(shuffled[i : i + step]), "rows must stay within their step"
        balanced.append(costs[ours].sum(1).max() / costs[ours].sum() * world)
        plain.append(costs[shuffled[i : i + step].reshape(world, per_device)].sum(1).max() / costs[ours].sum() * world)
    # the busiest rank's excess over the mean: a fifth or less of what plain random order gives
    assert np.mean(balanced) - 1 < (np.mean(plain) - 1) / 5, (np.mean(balanced), np.mean(plain))
    assert order[1000 - 1000 % step :] == shuffled[1000 - 1000 % step :].tolist()
    assert deal(np.arange(4), np.array([4.0, 3.0, 2.0, 1.0]), 2).tolist() == [0, 3, 1, 2]


def test_accelerate_gives_each_rank_its_dealt_rows():
    """The sampler relies on accelerate handing batch k*world + r to rank r: check it against accelerate itself."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from ctrain.fast.trainer import RankBalancedSampler

    costs = np.random.default_rng(0).lognormal(10, 0.8, size=96)
    world, per_device = 4, 3
    order = list(RankBalancedSampler(costs, world, per_device, seed=1))
    for rank in range(world):
        batches = BatchSampler(RankBalancedSampler(costs, world, per_device, seed=1), per_device, drop_last=False)
        shard = list(BatchSamplerShard(batches, num_processes=world, process_index=rank))
        expected = [order[(k * world + rank) * per_device : (k * world + rank + 1) * per_device] for k in range(8)]
        assert shard == expected


def test_attention_cost_of_packed_and_unpacked_rows():
    import datasets

    from ctrain.fast.trainer import attention_cost

    packed = datasets.Dataset.from_dict({"input_ids": [[1] * 7, [1] * 5], "seq_lengths": [[3, 4], [5]]})
    assert attention_cost(packed).tolist() == [25.0, 25.0]
    plain = datasets.Dataset.from_dict({"input_ids": [[1] * 7, [1] * 2]})
    assert attention_cost(plain).tolist() == [49.0, 4.0]


def test_activation_memory_budget_makes_compiled_layers_keep_less(monkeypatch):
    """fast.activation_memory_budget reaches the compiler's partitioner: a compiled layer keeps fewer
    bytes for the backward pass at 0.1 than at 1.0, and computes the same loss."""
    import torch._functorch.config as functorch_config

    import ctrain.fast

    monkeypatch.setattr(ctrain.fast, "compile_layers", lambda m: compile_layers(m, backend="aot_eager_decomp_partition"))
    batch = packed_batch(random_examples(6, (19, 33, 7)))
    kept = {}
    with functorch_config.patch(activation_memory_budget=1.0):  # prepare_model sets it for the process
        for budget in (1.0, 0.1):
            kept[budget] = _kept_with_budget(budget, batch)
    assert kept[0.1][0] < 0.9 * kept[1.0][0], kept
    assert kept[0.1][1] == pytest.approx(kept[1.0][1], rel=1e-6)


def _kept_with_budget(budget: float, batch: dict) -> tuple[int, float]:
    """Bytes a compiled tiny Llama keeps for the backward pass under ``budget``, and its loss."""
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    model = tiny_llama()
    prepare_model(model, FastSettings(compile="layers", activation_memory_budget=budget), "cpu")
    assert functorch_config.activation_memory_budget == budget
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch, use_cache=False).loss
    return total, loss.item()


def test_activation_memory_budget_makes_dropout_recomputable_on_cuda():
    """On CUDA the budget also lets the compiler draw dropout masks again from their seed instead
    of keeping them; on a CPU (no Philox generator for it) that stays off."""
    import torch._functorch.config as functorch_config

    settings = FastSettings(compile="layers", activation_memory_budget=0.5)
    with functorch_config.patch(activation_memory_budget=1.0, functionalize_rng_ops=False):
        prepare_model(tiny_llama(), settings, "cpu")
        assert functorch_config.functionalize_rng_ops is False
        prepare_model(tiny_llama(), FastSettings(compile="layers"), "cuda")
        assert functorch_config.functionalize_rng_ops is False, "only with a budget"
        prepare_model(tiny_llama(), settings, "cuda")
        assert functorch_config.functionalize_rng_ops is True
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (FastSettings(activation_memory_budget=0.0), "must be in (0, 1]"),
        (FastSettings(activation_memory_budget=1.5), "must be in (0, 1]"),
        (FastSettings(activation_memory_budget=0.5, gradient_checkpointing=True), "set one of them"),
        (FastSettings(activation_memory_budget=0.5, compile="off"), "needs compiled layers"),
    ],
)
def test_activation_memory_budget_refuses_what_cannot_work(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare_model(tiny_llama(), settings, "cpu")


@pytest.mark.parametrize("first_step", [1, 5])
def test_the_compile_report_names_the_runs_first_step_also_after_a_resume(first_step, caplog):
    """A requeued run starts at the checkpoint's step: its first step is the one that compiles (or
    loads from the cache), so it is reported, once, whatever its number."""
    from torch._dynamo.utils import counters
    from transformers import TrainerControl, TrainerState

    from ctrain.fast.trainer import compile_report_callback

    callback, state = compile_report_callback(), TrainerState()
    state.global_step = first_step - 1
    counters["inductor"]["fxgraph_cache_hit"] += 3
    try:
        with caplog.at_level("INFO", logger="ctrain"):
            callback.on_train_begin(None, state, TrainerControl())
            for _ in range(3):
                state.global_step += 1
                callback.on_step_end(None, state, TrainerControl())
    finally:
        counters["inductor"]["fxgraph_cache_hit"] -= 3
    reports = [r.getMessage() for r in caplog.records if "after training started" in r.getMessage()]
    assert len(reports) == 1
    expected = rf"step {first_step} came [0-9.]+ s after training started: \d+ compiled graphs, \d+ of them"
    assert re.match(expected, reports[0])
