"""``ctrain bench``: the command over :mod:`ctrain.bench.suite`."""

from __future__ import annotations

from pathlib import Path

import click


def _ints(value: str | None) -> list[int] | None:
    try:
        return [int(v) for v in value.split(",")] if value else None
    except ValueError:
        raise click.BadParameter(f"expected comma-separated GPU counts such as 1,2,4, got {value!r}") from None


@click.command()
@click.option(
    "--cases",
    default="seeds,ctrain-same-batches,ctrain",
    show_default=True,
    help="Comma-separated cases: seeds, ctrain-same-batches, ctrain, ctrain-16k, ctrain-eager, "
    "ctrain-sync, ctrain-unbalanced, ctrain-bucket25, ctrain-bucket200, ctrain-bf16-reduce, ctrain-no-allreduce; "
    "LoRA on a Llama-3.1-8B shape: lora-seeds, lora-trl-best, lora-trl-checkpointed, lora-ctrain, "
    "lora-ctrain-ungrouped, lora-ctrain-hf, qlora-trl, qlora-ctrain, qlora-ctrain-checkpointed; "
    "full SFT of the Llama-3.1-8B shape sharded over --gpus: sft8b-seeds, sft8b-trl-best, sft8b-trl-no-liger, "
    "sft8b-ctrain, sft8b-ctrain-bf16-reduce, sft8b-ctrain-same-batches, sft8b-ctrain-same-batches-bf16-reduce.",
)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--tiny", is_flag=True, help="A tiny model and data set: checks the code in about a minute on a CPU.")
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    help="Only this many decoder layers of each case's model: the same code on fewer GPUs (a loss check), "
    "not the model's throughput.",
)
@click.option("--warmup", default=8, show_default=True, help="Steps before timing starts (compilation, allocator).")
@click.option("--steps", default=30, show_default=True, help="Timed steps.")
@click.option("--gpus", help="Weak-scaling sweep of the cases over GPU counts, e.g. 1,2,4 (torchrun per count).")
@click.option(
    "--strategy",
    "strategies",
    default="ddp",
    show_default=True,
    help="Multi-GPU strategies for --gpus, comma-separated: ddp, fsdp, fsdp-no-reshard, zero2.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Directory for JSON results and profiles.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the JSON here instead of OUT/bench.json.",
)
@click.option(
    "--export",
    "export_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write the first case's problem (chats, tokenizer, a random bf16 model) under this new directory "
    "for `ctrain train`, print the overrides that use it, and measure nothing.",
)
@click.option("--profile", is_flag=True, help="Profile 3 steps of each case after timing (OUT/CASE/).")
@click.option("--no-attention-check", is_flag=True, hidden=True, help="Skip the varlen attention check (workers).")
def bench(
    cases: str,
    device: str,
    tiny: bool,
    layers: int | None,
    warmup: int,
    steps: int,
    gpus: str | None,
    strategies: str,
    out: Path,
    json_path: Path | None,
    export_dir: Path | None,
    profile: bool,
    no_attention_check: bool,
) -> None:
    """Measure training throughput: TRL with the seeds' settings against ctrain's fast path.

    \b
    The fixed problem: a 374M-parameter Llama trained from scratch on 6000 synthetic chats
    (SFT, max length 2048). Prints tokens/s, MFU and peak memory, and whether the fast path's
    loss curve matches the seeds' settings on the same batches. The LoRA cases train adapters on a
    random Llama-3.1-8B-shaped base (one GPU): TRL + PEFT against ctrain's LoRA recipe; the sft8b
    cases train all of its weights in 4096-token rows, sharded over the GPUs of a --gpus sweep.
      ctrain bench                              one GPU: seeds vs ctrain
      ctrain bench --cases ctrain --gpus 1,2,4 --strategy ddp,fsdp
      ctrain bench --cases lora-seeds,lora-trl-best,lora-ctrain,qlora-trl   8B LoRA, one GPU
      ctrain bench --cases sft8b-seeds,sft8b-trl-best,sft8b-ctrain --gpus 4   8B full SFT, FSDP2
      ctrain bench --device cpu --tiny          smoke test
      ctrain bench --cases sft8b-ctrain --export DIR   the 8B case's inputs for ctrain train
    """
    from ctrain.train import stack

    stack.require("bench")
    if export_dir is not None:
        from ctrain.bench.export import export
        from ctrain.bench.suite import case_spec, pick_cases, resolve_device

        case = pick_cases([c for c in cases.split(",") if c][:1])[0]
        overrides = export(case_spec(case, tiny, layers), export_dir, resolve_device(device))
        click.echo(" ".join(overrides))
        return
    from ctrain.bench.suite import bench as run_bench

    table = run_bench(
        cases=[c for c in cases.split(",") if c],
        device=device,
        tiny=tiny,
        warmup=warmup,
        steps=steps,
        gpus=_ints(gpus),
        strategies=[s for s in strategies.split(",") if s],
        json_path=json_path,
        out=out,
        profile=profile,
        attention_check=not no_attention_check,
        layers=layers,
    )
    if table:
        click.echo(table)
