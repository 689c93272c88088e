"""Recipes: schema, overrides, batch layout and the torch-free checks a login node runs before queueing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ctrain.errors import ConfigError
from ctrain.train.fingerprint import prepared_settings, settings_differences
from ctrain.train.layout import batch_layout
from ctrain.train.preflight import preflight
from ctrain.train.recipe import Recipe, load_recipe, recipe_keys
from ctrain.train.sources import resolve_source
from tests.plugins.train import REPO, TINY_RECIPE


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MINIMAL = "model:\n  path: {model}\ndata:\n  source: {source}\n"
# Overrides that turn the tiny recipe's new model into a pretrained one.
PRETRAINED = ["model.config=null", "model.config_overrides={}", "model.path=gpt2", "tokenizer.train=null"]


def test_unknown_key_lists_the_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, TINY_RECIPE.replace("  max_steps: 40", "  max_step: 40"))
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    text = str(err.value)
    assert "unknown key 'training.max_step'" in text and "did you mean 'max_steps'" in text
    assert "global_batch_size" in text and "save_steps" in text


def test_overrides_apply_on_top_and_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path, TINY_RECIPE)
    recipe = load_recipe(path, ["training.max_steps=7", "data.max_length=32", "model.config_overrides.hidden_size=64"])
    assert recipe.training.max_steps == 7
    assert recipe.data.max_length == 32
    assert recipe.model.config_overrides["hidden_size"] == 64
    with pytest.raises(ConfigError, match="'training.global_batch_size' must be an integer"):
        load_recipe(path, ["training.global_batch_size=many"])
    with pytest.raises(ConfigError, match="training.global_batch_size is 0; it must be at least 1"):
        load_recipe(path, ["training.global_batch_size=0"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.path=gpt2"], "set exactly one of model.path"),
        (["data.max_length=1"], "data.max_length is 1"),
        (["data.max_length=128"], r"data.max_length \(128\) is larger than the model's max_position_embeddings \(64"),
        (["data.eval_split=test"], "set at most one of data.eval_split"),
        (["training.learning_rate=0"], "training.learning_rate is 0.0"),
        (["training.preemption_signals=[SIGKILL]"], "'SIGKILL' is not a signal a process can catch"),
        (["training.preemption_signals=[SIG_DFL]"], "'SIG_DFL' is not a signal a process can catch"),
        (["training.preemption_signals=[SIG_IGN]"], "'SIG_IGN' is not a signal a process can catch"),
        (["training.max_steps=9223372036854775807"], "training.max_steps is 9223372036854775807; at most 1,000,000,000"),
        (["training.epochs=1e300"], "training.epochs is 1e[+]?300; at most 1,000,000"),
        (["training.save_steps=0"], "training.save_steps is 0"),
        (["tokenizer.train.vocab_size=100"], "vocab_size is 100"),
        (["data.streaming=true"], "data.streaming is for causal-LM pretraining"),
        (["task=clm", "training.engine=fast"], "training.engine: fast is the SFT fast path"),
        (["training.engine=fast", "training.torch_compile=true"], "turn training.torch_compile off, or use engine hf"),
        (["training.engine=fast", "training.liger_kernel=true"], "turn training.liger_kernel off, or use engine hf"),
        (["fast.gc_every=-1"], "fast.gc_every must be >= 0"),
        (["fast.activation_memory_budget=0"], r"fast.activation_memory_budget must be in \(0, 1\], got 0"),
        (["fast.activation_memory_budget=0.2", "training.gradient_checkpointing=true"],
         "fast.activation_memory_budget and training.gradient_checkpointing both choose what to recompute"),
        (["data.packing=true", "fast.activation_memory_budget=0.2", "training.engine=hf"],
         "fast.activation_memory_budget is a setting of the fast engine, and training.engine is hf: .* "
         r"remove it \(or set it to null\) and set training.gradient_checkpointing: true"),
        (["fast.activation_memory_budget=0.2"], "the fast engine, and data.packing is off"),
        (["data.packing=true", "fast.activation_memory_budget=0.2", "task=clm"], "the fast engine, and task clm"),
        (PRETRAINED + ["peft.method=lora", "data.packing=true", "training.fsdp=true", "fast.activation_memory_budget=0.2"],
         "the fast engine, and adapters on a sharded base"),
        (["training.deepspeed=ds.json", "training.fsdp=true"], "at most one of training.deepspeed and training.fsdp"),
        (["peft.method=lora"], "peft.method: lora adapts a pretrained model, and model.config makes a new one"),
        (["peft.method=none", "peft.merge=true"], "peft.merge folds trained adapters into the model: set peft.method"),
        (["peft.method=lora", "peft.r=0"], "peft.r is 0; the adapter rank must be between 1 and 65536"),
        # sizes with a ceiling: a typo never reaches the allocator or forks a million processes
        (["tokenizer.train.vocab_size=1000000000"], "vocab_size is 1000000000; it must be between 300 and 4194304"),
        (["data.num_proc=1000000"], "data.num_proc is 1000000; it must be between 1 and 1024"),
        (["training.dataloader_workers=100000"], "training.dataloader_workers is 100000; it must be between 0 and"),
        (["eval.max_new_tokens=1000000000"], "eval.max_new_tokens is 1000000000; at most 16777216"),
        (["eval.batch_size=1000000000"], "eval.batch_size is 1000000000; at most 16777216"),
        (["peft.method=lora", "peft.alpha=0"], "peft.alpha is 0.0; it must be positive"),
        (["peft.method=lora", "peft.dropout=1"], "peft.dropout is 1.0; it must be at least 0 and below 1"),
        (["peft.method=lora", "peft.target_modules=[]"], "peft.target_modules names no module"),
        (["peft.method=lora", "peft.target_modules=[all-linear, q_proj]"], "all-linear stands alone"),
        (["peft.r=8"], r"override 'peft.r=8': peft.method is not set: lora .* or none \(train every weight"),
        (["peft={}"], "peft.method is not set"),
        (["peft.method=dora"], "'peft.method' is 'dora'; valid values: none, lora, qlora"),
        (PRETRAINED + ["peft.method=qlora", "training.fsdp=true"], "does not combine with training.fsdp"),
        (PRETRAINED + ["peft.method=qlora", "model.dtype=float32"], "qlora computes in bfloat16"),
        (["eval.after_training=true", "data.eval_size=null"], "eval.after_training asks held-out examples: set "
                                                                "data.eval_size"),
        (["eval.after_training=true", "task=clm"], "eval.after_training asks held-out chats .* task clm"),
    ],
)
def test_impossible_settings_are_one_clear_error(tmp_path: Path, overrides: list[str], message: str) -> None:
    path = write(tmp_path, TINY_RECIPE)
    with pytest.raises(ConfigError, match=message):
        load_recipe(path, overrides)


def test_a_peft_section_must_say_its_method(tmp_path: Path) -> None:
    """Adapter settings without ``method`` would train every weight of the base (a full fine-tune that
    may not fit, found out in the queue): refused, at the section's line. No section trains every weight."""
    assert load_recipe(write(tmp_path, TINY_RECIPE)).peft.method == "none"
    text = TINY_RECIPE + "peft:\n  r: 16\n  alpha: 32\n  target_modules: all-linear\n"
    line = text.splitlines().index("peft:") + 1
    with pytest.raises(ConfigError, match=rf"r.yaml line {line}: peft.method is not set: lora "):
        load_recipe(write(tmp_path, text))
    assert not load_recipe(write(tmp_path, text), ["peft.method=none"]).peft.enabled
    assert load_recipe(write(tmp_path, text.replace("  r: 16\n", "  method: none\n  r: 16\n"))).peft.method == "none"


def test_from_scratch_needs_a_tokenizer(tmp_path: Path) -> None:
    text = TINY_RECIPE.replace("tokenizer:\n  train:\n    vocab_size: 300\n", "")
    with pytest.raises(ConfigError, match="needs tokenizer.path, or tokenizer.train"):
        load_recipe(write(tmp_path, text))


@pytest.mark.parametrize(
    ("world", "cap", "expected"),
    [(1, None, (64, 1)), (2, None, (32, 1)), (4, None, (16, 1)), (4, 8, (8, 2)), (16, 3, (2, 2)), (1, 5, (4, 16))],
)
def test_batch_layout_keeps_the_global_batch(world: int, cap: int | None, expected: tuple[int, int]) -> None:
    recipe = Recipe()
    recipe.training.global_batch_size = 64
    recipe.training.max_per_device_batch_size = cap
    per_device, accumulation = batch_layout(recipe.training, world)
    assert (per_device, accumulation) == expected
    assert per_device * accumulation * world == 64


def test_batch_that_does_not_divide_among_processes(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, TINY_RECIPE))
    with pytest.raises(ConfigError, match=r"global_batch_size \(16\) does not divide among 3 processes"):
        preflight(recipe, world_size=3)
    assert preflight(recipe, world_size=4) == []


def test_shipped_recipes_validate_offline() -> None:
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert {p.name for p in recipes} >= {"demo-addition.yaml", "llama-3.1-8b-sft-zero3.yaml", "gpt2-clm-wikitext.yaml"}
    for path in recipes:
        recipe = load_recipe(path)
        if path.name == "demo-lora.yaml":  # adapts the demo's model, which `ctrain train` makes first
            with pytest.raises(ConfigError, match="outputs/demo-addition/final does not exist"):
                preflight(recipe)
            continue
        for world in (1, 2, 4, 16):
            notes = preflight(recipe, world_size=world)
        if recipe.training.deepspeed:
            assert (REPO / recipe.training.deepspeed).is_file()
        if recipe.model.path:
            assert any("hub name" in note for note in notes), notes
    big = load_recipe(REPO / "recipes/llama-3.1-8b-sft-zero3.yaml")
    assert load_recipe(REPO / "recipes/llama-3.1-8b-lora.yaml").peft.method == "lora"
    assert load_recipe(REPO / "recipes/llama-3.1-8b-qlora.yaml").peft.method == "qlora"
    assert big.training.deepspeed == "configs/deepspeed/zero3.json"
    assert batch_layout(big.training, 16) == (2, 4)


def test_shipped_configs_parse() -> None:
    import yaml

    for path in (REPO / "configs/deepspeed").glob("*.json"):
        config = json.loads(path.read_text())
        assert config["train_micro_batch_size_per_gpu"] == "auto", path
        assert config["zero_optimization"]["stage"] in (2, 3), path
    for path in (REPO / "configs/accelerate").glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        assert "num_processes" not in config and "num_machines" not in config, f"{path} states a size"
        ds = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if ds:
            assert (REPO / ds).is_file()


def test_recipe_module_needs_no_torch() -> None:
    code = (
        "import sys; from ctrain.train import artifacts, fingerprint, layout, sources; "
        "from ctrain.train.recipe import load_recipe; from ctrain.train.preflight import preflight; "
        f"r = load_recipe({str(REPO / 'recipes/demo-addition.yaml')!r}); preflight(r, world_size=4); "
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'trl') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- what a recipe points at ----------------------------------------------------------------------


def test_missing_paths(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, MINIMAL.format(model="./no-model", source="data/train.jsonl")))
    with pytest.raises(ConfigError, match="model.path: ./no-model does not exist"):
        preflight(recipe)
    (tmp_path / "m").mkdir()
    recipe = load_recipe(write(tmp_path, MINIMAL.format(model=tmp_path / "m", source=tmp_path / "train.jsonl")))
    with pytest.raises(ConfigError, match="data.source: .*train.jsonl does not exist"):
        preflight(recipe)
    recipe = load_recipe(write(tmp_path, MINIMAL.format(model=tmp_path / "m", source=tmp_path / "*.parquet")))
    with pytest.raises(ConfigError, match=r"no files match .*\*.parquet"):
        preflight(recipe)


def test_missing_columns_name_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    data = jsonl(tmp_path / "d.jsonl", [{"question": "hi", "answer": "ho"}])
    recipe = load_recipe(write(tmp_path, MINIMAL.format(model=tmp_path / "m", source=data)))
    with pytest.raises(ConfigError) as err:
        preflight(recipe)
    assert "has columns question, answer" in str(err.value) and "'messages'" in str(err.value)
    recipe = load_recipe(
        write(tmp_path, MINIMAL.format(model=tmp_path / "m", source=data)),
        ["data.prompt_column=question", "data.completion_column=answer"],
    )
    assert preflight(recipe) == []
    csv_file = tmp_path / "d.csv"
    csv_file.write_text("title,body\na,b\n")
    recipe = load_recipe(write(tmp_path, "task: clm\n" + MINIMAL.format(model=tmp_path / "m", source=csv_file)))
    with pytest.raises(ConfigError, match="no column 'text' .*columns: title, body"):
        preflight(recipe)


def test_bad_json_lines_are_reported_with_the_line(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text("\n{not json}\n")
    recipe = load_recipe(write(tmp_path, MINIMAL.format(model=tmp_path / "m", source=data)))
    with pytest.raises(ConfigError, match=r"d.jsonl line 2 \(row 1\) is not valid JSON"):
        preflight(recipe)


def test_sequence_longer_than_the_model(tmp_path: Path) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    data = jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    recipe = load_recipe(write(tmp_path, MINIMAL.format(model=model, source=data)), ["data.max_length=2048"])
    with pytest.raises(ConfigError, match=r"data.max_length \(2048\) is larger .* \(1024, .*config.json\)"):
        preflight(recipe)


def test_deepspeed_config_must_exist_and_parse(tmp_path: Path) -> None:
    path = write(tmp_path, TINY_RECIPE)
    with pytest.raises(ConfigError, match="training.deepspeed: zero9.json does not exist"):
        preflight(load_recipe(path, ["training.deepspeed=zero9.json"]))
    broken = tmp_path / "ds.json"
    broken.write_text("{stage: 3")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        preflight(load_recipe(path, [f"training.deepspeed={broken}"]))


def test_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = Recipe()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    jsonl(tmp_path / "b.jsonl", [{"text": "y"}])
    recipe.data.source = "$DATA_ROOT/*.jsonl"
    source = resolve_source(recipe.data)
    assert (source.kind, source.format, len(source.files)) == ("files", "json", 2)
    recipe.data.source = "HuggingFaceH4/ultrachat_200k"
    assert resolve_source(recipe.data).kind == "hub"
    recipe.data.source = "builtin:addition"
    assert resolve_source(recipe.data).kind == "builtin"
    recipe.data.source = "builtin:multiplication"
    with pytest.raises(ConfigError, match="unknown builtin 'multiplication'; builtins: addition"):
        resolve_source(recipe.data)
    disk = tmp_path / "saved"
    disk.mkdir()
    (disk / "dataset_info.json").write_text(json.dumps({"features": {"messages": {}}}))
    recipe.data.source = str(disk)
    assert resolve_source(recipe.data).kind == "disk"


def test_prepared_settings_notice_what_changes_the_data(tmp_path: Path) -> None:
    path = write(tmp_path, TINY_RECIPE)
    base = prepared_settings(load_recipe(path))
    assert settings_differences(base, prepared_settings(load_recipe(path, ["training.max_steps=5"]))) == []
    changed = settings_differences(base, prepared_settings(load_recipe(path, ["data.max_length=32"])))
    assert changed == ["max_length: prepared 64, recipe 32"]
    assert settings_differences(base, prepared_settings(load_recipe(path, ["tokenizer.train.vocab_size=400"])))


def test_docs_describe_every_recipe_key() -> None:
    text = (REPO / "docs/training.md").read_text()
    missing = [key for key in recipe_keys() if f"`{key}`" not in text]
    assert not missing, f"docs/training.md does not describe: {', '.join(missing)}"


def test_docs_state_the_defaults_the_code_has() -> None:
    import re

    import yaml

    from ctrain.settings import to_mapping
    from ctrain.train.recipe import TokenizerTraining

    actual = to_mapping(Recipe())
    actual["tokenizer"]["train"] = to_mapping(TokenizerTraining())
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", (REPO / "docs/training.md").read_text(), re.MULTILINE)
    assert len(rows) > 50
    for key, documented in rows:
        value = actual
        for part in key.split("."):
            value = value[part]
        if key == "tokenizer.train":
            value = None
        rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        assert documented == rendered, f"docs/training.md says {key} defaults to {documented}, the code {rendered}"


def test_lora_targets_are_checked_against_the_model_without_weights() -> None:
    from transformers import AutoConfig

    from ctrain.train.model import check_adapters

    recipe = Recipe()
    recipe.model.path = "base"
    recipe.peft.method = "lora"
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=300)  # fmt: skip
    check_adapters(recipe, config)  # all-linear
    recipe.peft.target_modules = ["q_proj", "v_proj"]
    check_adapters(recipe, config)
    recipe.peft.target_modules = ["q_proj", "query"]
    with pytest.raises(ConfigError) as err:
        check_adapters(recipe, config)
    assert str(err.value) == (
        "peft.target_modules: llama has no linear layer named 'query'; its linear layers: down_proj, gate_proj, "
        "k_proj, o_proj, q_proj, up_proj, v_proj (or use all-linear)"
    )
    recipe.peft.target_modules = "all-linear"
    recipe.peft.modules_to_save = ["lm_heads"]
    with pytest.raises(ConfigError, match="peft.modules_to_save: llama has no module named 'lm_heads'"):
        check_adapters(recipe, config)


def test_adapters_need_peft_and_qlora_a_gpu(tmp_path: Path) -> None:
    from ctrain.train.trainer import plan

    recipe = load_recipe(write(tmp_path, TINY_RECIPE), [*PRETRAINED, "peft.method=qlora"])
    with pytest.raises(ConfigError, match="qlora loads the base model in 4 bits with bitsandbytes, which needs a GPU"):
        plan(recipe)
    lora = load_recipe(write(tmp_path, TINY_RECIPE), [*PRETRAINED, "peft.method=lora"])
    assert plan(lora).engine == "hf"
    budget = load_recipe(write(tmp_path, TINY_RECIPE), ["data.packing=true", "fast.activation_memory_budget=0.3"])
    with pytest.raises(ConfigError, match=r"needs the fast engine, which trains on GPUs, and this process has none \(cpu\)"):
        plan(budget)


def test_adapters_take_the_fast_engine_on_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine auto picks the fast path for LoRA SFT on a GPU, as for full fine-tuning."""
    import torch

    from ctrain.train.trainer import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    lora = load_recipe(write(tmp_path, TINY_RECIPE), [*PRETRAINED, "peft.method=lora", "data.packing=true"])
    assert (plan(lora).engine, plan(lora).precision) == ("fast", "bf16")
    sharded = load_recipe(write(tmp_path, TINY_RECIPE), [*PRETRAINED, "peft.method=lora", "training.fsdp=true"])
    assert plan(sharded).engine == "hf"
    fixed = load_recipe(write(tmp_path, TINY_RECIPE), [*PRETRAINED, "peft.method=lora", "training.engine=fast"])
    assert fixed.training.engine == "fast"


def test_only_what_a_recipe_uses_of_peft_and_deepspeed_is_imported(tmp_path: Path, monkeypatch) -> None:
    """ctrain.train.stack: a new model or a plain local one without adapters needs no PEFT; a hub
    name might be an adapter (transformers loads those through PEFT), and a local adapter is one."""
    from ctrain.train.model import ADAPTER_CONFIG
    from ctrain.train.stack import unused

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    path = write(tmp_path, TINY_RECIPE)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    (adapter / ADAPTER_CONFIG).write_text("{}")
    pretrained = ["model.config=null", "tokenizer.train=null"]
    assert unused(load_recipe(path)) == ["peft", "deepspeed"]
    assert unused(load_recipe(path, [*pretrained, f"model.path={base}"])) == ["peft", "deepspeed"]
    assert unused(load_recipe(path, [*pretrained, f"model.path={adapter}"])) == ["deepspeed"]
    assert unused(load_recipe(path, [*pretrained, "model.path=org/some-model"])) == ["deepspeed"]
    assert unused(load_recipe(path, [*pretrained, f"model.path={base}", "peft.method=lora"])) == ["deepspeed"]
    (tmp_path / "zero3.json").write_text("{}")
    assert unused(load_recipe(path, [f"training.deepspeed={tmp_path / 'zero3.json'}"])) == ["peft"]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert unused(load_recipe(path)) == ["peft"]


def test_a_run_directory_knows_the_settings_that_define_its_run(tmp_path: Path) -> None:
    """ctrain.train.rundir: the recipe copy a start leaves in the output directory against the next
    start's recipe; run-independent keys (RUN_INDEPENDENT) may change, the others refuse."""
    from ctrain.errors import ConfigError
    from ctrain.train import rundir
    from ctrain.train.artifacts import RECIPE_COPY
    from ctrain.train.recipe import RUN_INDEPENDENT

    keys = recipe_keys()
    sections = {key.split(".")[0] for key in keys}
    assert all(name in keys or name in sections for name in RUN_INDEPENDENT), RUN_INDEPENDENT - set(keys) - sections
    path = write(tmp_path, TINY_RECIPE)
    out = tmp_path / "out"
    trial = load_recipe(path, [f"training.output_dir={out}", "training.max_steps=30"])
    assert rundir.differences(out, trial) == []  # nothing recorded yet
    out.mkdir()
    (out / RECIPE_COPY).write_text(trial.to_yaml())
    same = load_recipe(path, [f"training.output_dir={out}", "training.max_steps=30", "training.logging_steps=7",
                              "training.save_steps=3", "logging.report_to=[tensorboard]", "eval.max_new_tokens=2"])  # fmt: skip
    assert rundir.check(out, same) == []
    real = load_recipe(path, [f"training.output_dir={out}", "model.config_overrides.hidden_size=64"])
    with pytest.raises(ConfigError, match=r"holds a run with other settings \(model.config_overrides.hidden_size: 32 "
                                          r"-> 64; training.max_steps: 30 -> 40\).*training.resume=continue"):  # fmt: skip
        rundir.check(out, real)
    going_on = load_recipe(path, [f"training.output_dir={out}", "training.resume=continue"])
    assert rundir.check(out, going_on) == ["training.max_steps: 30 -> 40"]
    (out / RECIPE_COPY).write_text("[unclosed")  # a damaged record is not a reason to stop training
    assert rundir.check(out, real) == []


# --- training.trainer_args: any TrainingArguments / SFTConfig field the schema does not name --------


def test_trainer_args_reach_the_trainers_arguments(tmp_path: Path) -> None:
    """A field the recipe schema lacks (adam_beta2) goes through to TRL's SFTConfig as written."""
    from ctrain.train.trainer import plan, training_arguments

    recipe = load_recipe(write(tmp_path, TINY_RECIPE), ["training.trainer_args.adam_beta2=0.95",
                                                        "training.trainer_args.neftune_noise_alpha=5"])  # fmt: skip
    args = training_arguments(recipe, plan(recipe), tmp_path / "out", [])
    assert (type(args).__name__, args.adam_beta2, args.neftune_noise_alpha) == ("SFTConfig", 0.95, 5)
    clm = load_recipe(write(tmp_path, TINY_RECIPE), ["task=clm", "training.trainer_args.adam_beta2=0.9"])
    assert type(training_arguments(clm, plan(clm), tmp_path / "out", [])).__name__ == "TrainingArguments"


def test_a_trainer_arg_the_library_lacks_names_the_nearest(tmp_path: Path) -> None:
    """Checked against the installed TRL/transformers, at `ctrain train --check` (preflight) as at the run."""
    recipe = load_recipe(write(tmp_path, TINY_RECIPE), ["training.trainer_args.adam_beta=0.95"])
    with pytest.raises(ConfigError, match=r"training.trainer_args.adam_beta is not a field of trl's SFTConfig "
                                          r"\(the version installed here\): did you mean adam_beta(1|2) or adam_beta(2|1)\?"):
        preflight(recipe)


def test_a_trainer_arg_that_ctrain_sets_names_the_recipe_key(tmp_path: Path) -> None:
    """Two ways to set the learning rate would be one too many: the recipe's key is named instead."""
    path = write(tmp_path, TINY_RECIPE)
    with pytest.raises(ConfigError, match=r"training.trainer_args.learning_rate is set by ctrain from "
                                          r"training.learning_rate; remove it"):  # fmt: skip
        load_recipe(path, ["training.trainer_args.learning_rate=1e-3"])
    with pytest.raises(ConfigError, match=r"'\$\(x\)' is not a field name"):
        load_recipe(path, ["training.trainer_args={'$(x)': 1}"])


def test_owned_args_are_exactly_what_ctrain_sets(tmp_path: Path) -> None:
    """recipe.OWNED_ARGS (which refuses trainer_args early, on a login node) and the values the run
    sets are one list: a field ctrain starts setting must be refused in trainer_args too."""
    from ctrain.train.recipe import OWNED_ARGS
    from ctrain.train.trainer import argument_values, plan

    set_by_run: set[str] = set()
    for task in ("sft", "clm"):
        recipe = load_recipe(write(tmp_path, TINY_RECIPE), [f"task={task}"])
        set_by_run |= set(argument_values(recipe, plan(recipe), tmp_path / "out", []))
    assert set_by_run <= set(OWNED_ARGS), sorted(set_by_run - set(OWNED_ARGS))
    assert set(OWNED_ARGS) - set_by_run == {"gradient_checkpointing"}  # the old name of activation_checkpointing


@pytest.mark.parametrize(
    ("args", "ok"),
    [({"adam_beta2": 5}, False), ({"adam_beta1": -0.1}, False), ({"adam_epsilon": 0}, False),
     ({"max_grad_norm": "big"}, False), ({"label_smoothing_factor": 1}, False), ({"adam_beta2": True}, False),
     ({"adam_beta2": 0.95, "adam_epsilon": 1e-8, "max_grad_norm": 0, "label_smoothing_factor": 0.1}, True)],
)
def test_optimizer_trainer_args_out_of_range_are_refused_before_training(args: dict, ok: bool) -> None:
    """torch raises on these only when the optimizer is made, after the data and model have loaded."""
    from transformers import TrainingArguments

    from ctrain.train.preflight import check_trainer_args

    if ok:
        check_trainer_args(args, TrainingArguments)
        return
    with pytest.raises(ConfigError, match=rf"training.trainer_args.{next(iter(args))} is .*; it must be a number"):
        check_trainer_args(args, TrainingArguments)

