"""The benchmark's problem definition, bookkeeping, and a CPU smoke run of ``ctrain bench --tiny``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from ctrain.bench import data
from ctrain.bench.run import kernel_summary
from ctrain.bench.spec import FULL, PEAK_FLOPS, TINY
from ctrain.bench.suite import add_scaling, compare_losses, pick_cases, render
from ctrain.cli import main
from ctrain.errors import ConfigError
from tests.conftest import require


@pytest.mark.parametrize("spec", [FULL, TINY], ids=["full", "tiny"])
def test_parameter_count_matches_the_model(spec):
    torch = require("torch")
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(spec.model_config())
    assert spec.parameters() == sum(p.numel() for p in model.parameters())


def test_full_problem_is_the_published_one():
    assert round(FULL.parameters() / 1e6) == 374
    lens = data.lengths(FULL)
    assert len(lens) == 6000 and lens.min() >= 64 and lens.max() <= 2048
    assert 700 < lens.mean() < 780  # lognormal(6.4, 0.7) clipped: mean ~740
    six_n, with_attention = FULL.flops_per_token(data.attention_context(lens))
    assert six_n == 6 * FULL.parameters()
    assert with_attention == six_n + 6 * 24 * 1024 * data.attention_context(lens)


def test_attention_context_weights_long_documents():
    assert data.attention_context(np.array([10, 10])) == 10
    assert data.attention_context(np.array([1, 3])) == pytest.approx(10 / 4)


def test_synthetic_chats_are_deterministic_and_masked_on_the_reply():
    ids, mask, offsets = data.examples(TINY)
    again, _, _ = data.examples(TINY)
    assert np.array_equal(ids, again)
    for i in range(len(offsets) - 1):
        row, m = ids[offsets[i] : offsets[i + 1]], mask[offsets[i] : offsets[i + 1]]
        assert (row[0], row[1], row[-1]) == (data.BOS, data.USER, data.EOS)
        start = int(np.flatnonzero(row == data.ASSISTANT)[0]) + 1
        assert not m[:start].any() and m[start:].all()
        assert data.PAD not in row and row.max() < TINY.vocab
    ds = data.dataset(TINY)
    assert ds.num_rows == TINY.examples and ds[0]["input_ids"] == ids[: offsets[1]].tolist()


def test_tokenizer_knows_the_special_tokens():
    tok = data.tokenizer(TINY)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (data.PAD, data.BOS, data.EOS)
    assert len(tok) == TINY.vocab


def _result(case, world, rate, losses=(), strategy="ddp"):
    return {
        "case": case,
        "world_size": world,
        "strategy": strategy if world > 1 else "single",
        "tokens_per_s": rate,
        "tokens_per_s_per_device": rate / world,
        "mfu_6n": rate / world * 6 * FULL.parameters() / PEAK_FLOPS,
        "mfu_with_attention": 0.0,
        "peak_memory_gib": 1.0,
        "step_ms": 100.0,
        "losses": list(losses),
    }


def test_weak_scaling_efficiency_is_per_device_rate_over_single_device():
    results = [_result("ctrain", 1, 100.0), _result("ctrain", 4, 380.0), _result("ctrain", 2, 150.0, strategy="fsdp")]
    add_scaling(results)
    assert [r["scaling_efficiency"] for r in results] == [None, 0.95, 0.75]
    table = render(results, None)
    assert "95.0%" in table and "75.0%" in table


def test_loss_check_pairs_steps_and_measures_noise():
    seeds = _result("seeds", 1, 10.0, [(1, 10.0), (2, 9.0), (3, 8.5)])
    fast = _result("ctrain-same-batches", 1, 50.0, [(1, 10.0), (2, 9.1), (3, 8.4)])
    check = compare_losses([seeds, fast])
    assert check["steps"] == 3 and check["loss_drop"] == 1.5
    assert check["max_abs_diff"] == pytest.approx(0.1) and check["mean_abs_diff"] == pytest.approx(0.2 / 3)
    assert check["reference_step_noise"] == pytest.approx(0.25)  # step changes -1.0 and -0.5
    assert compare_losses([seeds]) is None
    assert "5.00x" in render([seeds, fast], check)


def test_kernel_summary_counts_busy_time_once():
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 10},
            {"cat": "kernel", "name": "flash_fwd_kernel", "ts": 5, "dur": 10},
            {"cat": "kernel", "name": "triton_poi_fused_add", "ts": 30, "dur": 10},
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        ]
    }
    summary = kernel_summary(trace)
    assert summary["profiled_us"] == 40 and summary["gpu_busy_fraction"] == pytest.approx(25 / 40)
    assert summary["kernel_us_by_kind"] == {"matmul": 10, "attention": 10, "compiled (triton)": 10}


def test_unknown_case_is_a_clear_error():
    with pytest.raises(ConfigError, match="valid: seeds"):
        pick_cases(["seeds", "fastest"])


def test_gpus_sweep_needs_cuda():
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--tiny", "--cases", "ctrain", "--gpus", "1,2"])
    assert result.exit_code != 0 and "needs CUDA" in result.output


@pytest.mark.full
def test_tiny_cpu_smoke(tmp_path, monkeypatch):
    """The whole bench on a CPU: seeds vs ctrain, same-batch loss check, table and JSON.
    Full tier alone; CI tier: test_the_benchs_figures_from_what_a_case_measured (the figures it reports) and
    test_parameter_count_matches_the_model (the FLOPs it counts)."""
    require("trl")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--tiny", "--warmup", "1", "--steps", "2", "--json", str(out)]
    result = CliRunner().invoke(main, [*args, "--cases", "seeds,ctrain-same-batches,ctrain"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["results"]] == ["seeds", "ctrain-same-batches", "ctrain"]
    assert all(r["tokens_per_s"] > 0 and r["measured_tokens"] > 0 for r in doc["results"])
    # Each case ran in a fresh process of its own, none in this one.
    processes = [r["process"] for r in doc["results"]]
    assert len(set(processes)) == 3 and os.getpid() not in processes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"], "only the JSON asked for is written"
    # Same model init, same batches, float32 on a CPU: the kernels change nothing.
    assert doc["loss_check"]["steps"] == 1 + 2 + 3
    assert doc["loss_check"]["max_abs_diff"] < 1e-4
    assert doc["results"][2]["settings"]["packing"] is True
    assert "loss check" in result.output and "ctrain-same-batches" in result.output


def test_lora_cases_are_the_8b_shape_with_one_adapter_setting():
    from ctrain import resources
    from ctrain.bench.run import CASES, LORA_TARGETS
    from ctrain.bench.spec import LLAMA_8B
    from ctrain.train.recipe import load_recipe

    lora = [c for c in CASES.values() if c.adapters]
    names = ["lora-seeds", "lora-trl-best", "lora-trl-checkpointed", "lora-ctrain", "lora-ctrain-ungrouped",
             "lora-ctrain-hf", "qlora-trl", "qlora-ctrain", "qlora-ctrain-checkpointed"]  # fmt: skip
    assert [c.name for c in lora] == names
    assert all(c.spec is LLAMA_8B for c in lora)
    assert {c.name: c.baseline for c in lora if c.baseline != "lora-trl-best"} == {
        "qlora-ctrain": "qlora-trl",
        "qlora-ctrain-checkpointed": "qlora-trl",
    }
    assert round(LLAMA_8B.parameters() / 1e9, 2) == 8.03
    # The recipe's all-linear picks the same seven projections the TRL cases name.
    shipped = load_recipe(resources.path("recipes", CASES["lora-ctrain"].recipe))
    assert (shipped.peft.method, shipped.peft.r, shipped.peft.alpha) == ("lora", 16, 32)
    assert shipped.peft.target_modules == "all-linear" and len(LORA_TARGETS) == 7


@pytest.mark.full
def test_lora_cases_train_on_a_cpu(tmp_path):
    """Each LoRA case builds its trainer and trains a tiny model: only the adapters change.
    Only the full tier runs the bench's cases on a CPU; CI tier: test_lora_on_the_fast_engine_with_checkpointing
    (ctrain's LoRA engine) and test_the_benchs_figures_from_what_a_case_measured (the figures)."""
    require("trl")
    require("peft")
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--tiny", "--warmup", "1", "--steps", "1", "--json", str(out)]
    cases = "lora-seeds,lora-trl-best,lora-trl-checkpointed,lora-ctrain,lora-ctrain-ungrouped,lora-ctrain-hf,qlora-trl,qlora-ctrain"
    result = CliRunner().invoke(main, [*args, "--cases", cases])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    by_case = {r["case"]: r for r in doc["results"]}
    for name in ("lora-seeds", "lora-trl-best", "lora-trl-checkpointed", "lora-ctrain", "lora-ctrain-ungrouped",
                 "lora-ctrain-hf"):  # fmt: skip
        r = by_case[name]
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["spec"] == "tiny" and len(r["losses"]) == 1 + 1 + 3
        assert r["settings"]["peft"]["r"] == 16 and r["settings"]["peft"]["alpha"] == 32
    seeds, best, ours = by_case["lora-seeds"], by_case["lora-trl-best"], by_case["lora-ctrain"]
    assert sorted(seeds["settings"]["peft"]["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert seeds["settings"]["peft"]["trainable_dtypes"] == ["torch.float32"]
    assert "packing" not in seeds["settings"] and seeds["settings"]["per_device_train_batch_size"] == 8
    assert best["settings"]["packing"] is True and best["settings"]["padding_free"] is True
    assert best["settings"]["gradient_checkpointing"] is False
    assert best["settings"]["per_device_train_batch_size"] * best["settings"]["gradient_accumulation_steps"] == 9
    checkpointed = by_case["lora-trl-checkpointed"]["settings"]
    assert checkpointed["gradient_checkpointing"] is True and checkpointed["per_device_train_batch_size"] == 9
    # On a CPU engine auto takes transformers' Trainer (the fast engine is for GPUs).
    assert ours["settings"]["engine"] == "hf" and ours["settings"]["recipe"] == "llama-3.1-8b-lora.yaml"
    assert ours["settings"]["activation_checkpointing"] is False and ours["settings"]["packing"] is True
    assert ours["settings"]["save_strategy"] == "no", "no checkpoint, not even the one transformers saves at the end"
    hf = by_case["lora-ctrain-hf"]["settings"]
    assert hf["engine"] == "hf" and hf["activation_checkpointing"] is True
    # QLoRA quantises with bitsandbytes on a GPU: on a CPU the cases fail alone, saying so.
    assert "needs a GPU" in by_case["qlora-trl"]["error"]
    assert "needs a GPU" in by_case["qlora-ctrain"]["error"]
    assert "lora-trl-best" in result.output


def test_export_is_the_bench_problem_as_ctrain_train_reads_it(tmp_path):
    """``ctrain bench --export``: the chats, read and tokenized by ``ctrain train``'s own code with the
    exported tokenizer, are exactly the rows the bench trains on; the model is the case's shape."""
    from transformers import AutoConfig

    from ctrain import resources
    from ctrain.train.data import _tokenizer_for, load_raw, tokenize_sft_example
    from ctrain.train.recipe import load_recipe

    target = tmp_path / "problem"
    args = ["bench", "--device", "cpu", "--tiny", "--cases", "sft8b-ctrain", "--export", str(target)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    overrides = result.output.strip().splitlines()[-1].split()
    recipe = load_recipe(resources.path("recipes", "llama-3.1-8b-sft.yaml"), overrides)
    assert recipe.model.path == str(target / "model") and recipe.data.eval_split is None
    train, held_out = load_raw(recipe)
    assert held_out is None and train.num_rows == TINY.examples
    tokenizer = _tokenizer_for(recipe, train)
    rows = data.labelled(TINY)
    for i, chat in enumerate(train):
        got = tokenize_sft_example(chat, tokenizer, "messages", {"messages": "messages"}, True, None)
        assert got == {"input_ids": rows[i]["input_ids"], "labels": rows[i]["labels"]}, i
    config = AutoConfig.from_pretrained(recipe.model.path)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (TINY.hidden, TINY.layers, TINY.vocab)
    assert str(config.dtype).endswith("bfloat16")
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "is not empty" in again.output


def test_layers_cut_a_cases_model_and_reach_its_workers(tmp_path):
    from ctrain.bench.run import CASES
    from ctrain.bench.suite import _worker, case_spec

    case = CASES["sft8b-trl-best"]
    whole, cut = case_spec(case, False), case_spec(case, False, 8)
    assert (cut.layers, cut.name, cut.hidden) == (8, f"{whole.name}-8-layers", whole.hidden)
    assert cut.parameters() < whole.parameters()
    assert case_spec(case, False, None) == whole
    args = _worker(case, warmup=1, steps=1, tiny=False, device="cuda", json_path=tmp_path / "r.json",
                   out=tmp_path, profile=False, layers=8)  # fmt: skip
    assert args[args.index("--layers") + 1] == "8"
    assert "--layers" not in _worker(case, warmup=1, steps=1, tiny=False, device="cuda",
                                     json_path=tmp_path / "r.json", out=tmp_path, profile=False)  # fmt: skip


@pytest.mark.parametrize("export", [False, True], ids=["measure", "export"])
def test_more_layers_than_the_model_has_is_one_clear_error(tmp_path, export):
    args = ["bench", "--device", "cpu", "--cases", "sft8b-ctrain", "--layers", "40"]
    target = tmp_path / "inputs"
    result = CliRunner().invoke(main, args + (["--export", str(target)] if export else []))
    assert result.exit_code != 0
    assert "--layers 40: sft8b-ctrain's model has 32 decoder layers; give 1 to 32" in result.output
    assert "Traceback" not in result.output
    assert not target.exists()


def test_no_case_named_is_an_error_not_an_empty_result() -> None:
    from ctrain.bench.suite import pick_cases

    with pytest.raises(ConfigError, match="--cases names no case; valid: seeds"):
        pick_cases([])
