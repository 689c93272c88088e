"""LoRA for real on CPU: adapters on a pretrained tiny model, killed and resumed, merged, evaluated,
on one process and under torchrun; and the demo model adapted to a task it has never seen."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest

from ctrain.train.artifacts import COMPLETE_MARKER
from tests.plugins.train import REPO, TINY_RECIPE, TORCHRUN, assert_same_state, losses, run_ctrain, start, wait_for

pytestmark = pytest.mark.integration

# Exact-match accuracy on 500 held-out subtraction problems the LoRA demo must reach.
BAR = 0.9

LORA = """\
task: sft
seed: 7
model:
  path: {base}
data:
  source: builtin:{task}
  max_examples: 1024
  eval_size: 64
  max_length: 64
  packing: false
training:
  global_batch_size: 16
  max_steps: 40
  learning_rate: 2.0e-3
  logging_steps: 1
  save_steps: 10
logging:
  report_to: []
eval:
  max_new_tokens: 5
peft:
  method: lora
  r: 8
  alpha: 16
  dropout: 0.1
"""


def digest(directory: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.glob("*.safetensors")))).hexdigest()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrained tiny model: the tiny recipe trained 30 steps from scratch (its final/)."""
    work = tmp_path_factory.mktemp("base")
    (work / "tiny.yaml").write_text(TINY_RECIPE)
    result = run_ctrain(work, "train", "tiny.yaml", "training.max_steps=30")
    assert result.returncode == 0, result.stderr[-4000:]
    return work / "outputs/tiny/final"


def lora_recipe(work: Path, base: Path, task: str = "subtraction") -> Path:
    path = work / "lora.yaml"
    path.write_text(LORA.format(base=base, task=task))
    return path


def test_lora_preempted_and_resumed_matches_an_uninterrupted_run(base: Path, tmp_path: Path) -> None:
    lora_recipe(tmp_path, base)
    before = digest(base)
    common = ["train", "lora.yaml", "data.prepared_dir=prepared"]
    whole = run_ctrain(tmp_path, *common, "training.output_dir=outputs/whole")
    assert whole.returncode == 0, whole.stderr[-4000:]
    assert "LoRA r=8 alpha=16 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in whole.stderr
    (reference,) = losses(tmp_path / "outputs/whole").values()

    stopped = tmp_path / "outputs/stopped"
    log = tmp_path / "stopped.log"
    process = start([*common, f"training.output_dir={stopped}", "training.save_steps=5000"], tmp_path, log)
    wait_for(lambda: "step 12/40" in log.read_text(), process, "step 12")
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=300) == 75, log.read_text()[-4000:]
    (saved,) = [p for p in stopped.glob("checkpoint-*") if (p / COMPLETE_MARKER).is_file()]
    names = {p.name for p in saved.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= names, names
    assert "model.safetensors" not in names  # the frozen base is not saved again
    adapter = (saved / "adapter_model.safetensors").stat().st_size
    assert adapter < (base / "model.safetensors").stat().st_size / 2, adapter

    again = run_ctrain(tmp_path, *common, f"training.output_dir={stopped}", "training.save_steps=5000")
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resuming from {saved} " in again.stderr
    runs = losses(stopped)
    first, second = (runs[key] for key in sorted(runs))
    step = int(saved.name.split("-")[1])
    assert sorted(second) == list(range(step + 1, 41))
    for number, loss in {**first, **second}.items():
        assert loss == pytest.approx(reference[number], rel=1e-4, abs=1e-5), f"step {number}"
    from safetensors.torch import load_file

    trained = load_file(stopped / "final/adapter_model.safetensors")
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert len(lora_b) == 14 and all(v.abs().max() > 0 for v in lora_b), "an adapter was not trained (B starts at 0)"
    assert digest(base) == before, "training adapters changed the base model's files"
    assert (stopped / "final/adapter_model.safetensors").is_file()
    assert json.loads((stopped / "final" / COMPLETE_MARKER).read_text())["step"] == 40


def test_a_background_save_writes_the_adapter_a_blocking_save_writes(base: Path, tmp_path: Path) -> None:
    """training.save_async on and off: checkpoint-10 holds the same adapter, bit for bit (all 28 of
    its tensors, none of the frozen base's) and the same optimizer state."""
    import torch
    from safetensors.torch import load_file

    lora_recipe(tmp_path, base)
    common = ["train", "lora.yaml", "data.prepared_dir=prepared", "training.max_steps=10"]
    for name, setting in (("background", "true"), ("blocking", "false")):
        run = run_ctrain(tmp_path, *common, f"training.output_dir=outputs/{name}", f"training.save_async={setting}")
        assert run.returncode == 0, run.stderr[-4000:]
    ours, theirs = tmp_path / "outputs/background/checkpoint-10", tmp_path / "outputs/blocking/checkpoint-10"
    assert (ours / COMPLETE_MARKER).is_file() and (theirs / COMPLETE_MARKER).is_file()
    adapter = load_file(ours / "adapter_model.safetensors")
    assert len(adapter) == 28 and all("lora_" in key for key in adapter), sorted(adapter)
    assert (ours / "adapter_model.safetensors").read_bytes() == (theirs / "adapter_model.safetensors").read_bytes()
    assert_same_state(torch.load(ours / "optimizer.pt"), torch.load(theirs / "optimizer.pt"), "optimizer.pt")
    assert not (ours / "model.safetensors").exists()


def test_lora_on_the_fast_engine_with_checkpointing(base: Path, tmp_path: Path) -> None:
    """The fast engine trains adapters too (padding-free batches, document-masked attention, every
    layer recomputed in the backward pass): step for step the loss of transformers' Trainer on the
    same batches, and only the adapter is saved."""
    lora_recipe(tmp_path, base)
    curves = {}
    for engine, extra in (("hf", []), ("fast", ["fast.batching=padding_free", "training.gradient_checkpointing=true"])):
        run = run_ctrain(
            tmp_path, "train", "lora.yaml", f"training.engine={engine}", *extra, "training.max_steps=12",
            f"training.output_dir=outputs/{engine}",
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        assert f"engine {engine}," in run.stderr and "LoRA r=8 alpha=16" in run.stderr
        (curves[engine],) = losses(tmp_path / f"outputs/{engine}").values()
    assert sorted(curves["fast"]) == list(range(1, 13))
    for step, loss in curves["hf"].items():
        assert curves["fast"][step] == pytest.approx(loss, rel=1e-3), f"step {step}"
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "outputs/fast/final/adapter_model.safetensors")
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert len(lora_b) == 14 and all(v.abs().max() > 0 for v in lora_b), "an adapter was not trained"
    assert not (tmp_path / "outputs/fast/final/model.safetensors").exists()


def test_lora_on_two_processes_merges_and_evaluates_either_form(base: Path, tmp_path: Path) -> None:
    lora_recipe(tmp_path, base)
    trained = run_ctrain(tmp_path, "train", "lora.yaml", "training.max_steps=20", "peft.merge=true", launcher=TORCHRUN)
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert "[rank 1 host" in trained.stderr and "Traceback" not in trained.stderr
    final = tmp_path / "outputs/lora/final"
    marker = json.loads((final / COMPLETE_MARKER).read_text())
    assert marker["world_size"] == 2
    assert "merged/model.safetensors" in marker["manifest"], marker  # sealed with the rest

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    batch = tokenizer(["What is 58 - 27?"], return_tensors="pt")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        expected, got, before = (m(**batch).logits for m in (adapted, merged, plain))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, expected, atol=1e-3), "the adapter changes nothing"

    results = {}
    for model in (None, final / "merged"):
        evaluated = run_ctrain(tmp_path, "eval", "lora.yaml", *(["--model", str(model)] if model else []))
        assert evaluated.returncode == 0, evaluated.stderr[-4000:]
        results[str(model)] = json.loads((tmp_path / "outputs/lora/eval.json").read_text())
    adapter_result, merged_result = results.values()
    assert adapter_result["total"] == 64
    assert [e["answer"] for e in adapter_result["examples"]] == [e["answer"] for e in merged_result["examples"]]
    assert adapter_result["correct"] == merged_result["correct"]


def test_lora_refuses_what_cannot_work_before_any_data(base: Path, tmp_path: Path) -> None:
    lora_recipe(tmp_path, base)
    result = run_ctrain(tmp_path, "train", "lora.yaml", "peft.target_modules=[q_proj,wq]")
    assert result.returncode != 0
    assert "peft.target_modules: llama has no linear layer named 'wq'; its linear layers: down_proj" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "outputs/lora/prepared").exists()
    scratch = run_ctrain(tmp_path, "train", "lora.yaml", "model.path=null", "model.config=llama")
    assert scratch.returncode != 0 and "adapts a pretrained model" in scratch.stderr, scratch.stderr
    qlora = run_ctrain(tmp_path, "train", "lora.yaml", "peft.method=qlora")
    assert qlora.returncode != 0 and "needs a GPU" in qlora.stderr, qlora.stderr[-2000:]
    assert not (tmp_path / "outputs/lora/prepared").exists()


@pytest.mark.full
@pytest.mark.slow
def test_demo_model_learns_subtraction_through_adapters(demo_run: Path, tmp_path: Path) -> None:
    """The LoRA demo as the README runs it: recipes/demo-lora.yaml on the addition model.
    Full tier alone (the LoRA demo to its accuracy); CI tier:
    test_lora_preempted_and_resumed_matches_an_uninterrupted_run and
    test_lora_on_two_processes_merges_and_evaluates_either_form (adapters trained, resumed, merged)."""
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs/demo-addition").symlink_to(demo_run / "outputs/demo-addition")
    base = demo_run / "outputs/demo-addition/final"
    before = digest(base)
    recipe = str(REPO / "recipes/demo-lora.yaml")
    untrained = run_ctrain(tmp_path, "eval", recipe, "--model", "outputs/demo-addition/final", "--max-examples", "100")
    assert untrained.returncode == 0, untrained.stderr[-3000:]
    start_accuracy = json.loads((tmp_path / "outputs/demo-lora/eval.json").read_text())["accuracy"]
    adapted = run_ctrain(tmp_path, "train", recipe, timeout=1500)
    assert adapted.returncode == 0, adapted.stderr[-3000:]
    evaluated = run_ctrain(tmp_path, "eval", recipe)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((tmp_path / "outputs/demo-lora/eval.json").read_text())
    print(f"\nLoRA demo: subtraction accuracy {start_accuracy:.3f} before, {result['accuracy']:.3f} after")
    assert start_accuracy < 0.1
    assert result["accuracy"] >= BAR and result["total"] == 500
    assert (tmp_path / "outputs/demo-lora/final/merged/model.safetensors").is_file()
    assert digest(base) == before, "the adapters changed the addition model's files"
