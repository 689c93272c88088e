"""``ctrain bench``: run the cases, compare the loss curves, sweep GPU counts, print a table, write JSON.

Every case runs in a fresh process of its own, one after another: a ``ctrain bench`` of that one
case (for a sweep over GPU counts, a ``torchrun`` of it, one process per GPU) whose rank 0 writes a
JSON file that this process collects. A case changes process-wide state that must not reach the
next one: Liger's kernels replace transformers' Llama classes, the fast engine sets the
compiler's memory budget. One case asked for alone runs in this process. The table adds
weak-scaling efficiency, per-device throughput at N devices over that of the same case at one.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ctrain import proc, ui
from ctrain.bench.run import CASES, STRATEGIES, Case, cannot_run, run_case
from ctrain.bench.spec import BenchSpec
from ctrain.errors import CommandError, ConfigError, CtrainError


def pick_cases(names: list[str]) -> list[Case]:
    """The named cases; none named is an error (an empty run would replace earlier results with nothing)."""
    if not names:
        raise ConfigError(f"--cases names no case; valid: {', '.join(CASES)}")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ConfigError(f"unknown bench case {', '.join(unknown)}; valid: {', '.join(CASES)}")
    return [CASES[n] for n in names]


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CtrainError("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    return device


def environment(device: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpus_visible"] = torch.cuda.device_count()
        if proc.which("nvidia-smi"):
            out = proc.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], check=False)
            env["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return env


# Reference and compared case of the loss check, the first pair a run has both of.
LOSS_PAIRS = (("seeds", "ctrain-same-batches"), ("sft8b-trl-best", "sft8b-ctrain-same-batches"))


def compare_losses(
    results: list[dict[str, Any]], reference: str = LOSS_PAIRS[0][0], other: str = LOSS_PAIRS[0][1]
) -> dict | None:
    """Per-step loss of the fast kernels against the seeds' settings on the same batches."""
    by_case = {r["case"]: dict(r["losses"]) for r in results if "error" not in r}
    if reference not in by_case or other not in by_case:
        return None
    ref, new = by_case[reference], by_case[other]
    steps = sorted(set(ref) & set(new))
    if not steps:
        return None
    diffs = [abs(new[s] - ref[s]) for s in steps]
    drop = ref[steps[0]] - ref[steps[-1]]
    # Batch-to-batch noise of the reference curve: spread of its step-to-step changes.
    jumps = [ref[b] - ref[a] for a, b in itertools.pairwise(steps)]
    mean_jump = sum(jumps) / len(jumps) if jumps else 0.0
    noise = (sum((j - mean_jump) ** 2 for j in jumps) / len(jumps)) ** 0.5 if jumps else 0.0
    return {
        "reference": reference,
        "compared": other,
        "steps": len(steps),
        "first_loss": ref[steps[0]],
        "last_loss": ref[steps[-1]],
        "loss_drop": drop,
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "max_rel_diff": max(d / ref[s] for d, s in zip(diffs, steps)),
        "reference_step_noise": noise,
        "per_step": [(s, ref[s], new[s]) for s in steps],
    }


def case_spec(case: Case, tiny: bool, layers: int | None = None) -> BenchSpec:
    """The model shape a case runs on: its own, or the tiny one that checks the code on a CPU; with
    ``layers``, that many decoder layers of it (named so: a check that fits fewer GPUs)."""
    from dataclasses import replace

    from ctrain.bench.spec import TINY

    spec = TINY if tiny else case.spec
    if layers is None:
        return spec
    if not 1 <= layers <= spec.layers:
        raise ConfigError(
            f"--layers {layers}: {case.name}'s model has {spec.layers} decoder layers; give 1 to {spec.layers}"
        )
    return replace(spec, name=f"{spec.name}-{layers}-layers", layers=layers)


def run_here(
    cases: list[Case],
    *,
    tiny: bool,
    device: str,
    warmup: int,
    steps: int,
    strategy: str,
    profile: Path | None,
    layers: int | None = None,
) -> list[dict[str, Any]]:
    """The cases one after another in this process (one rank of a torchrun, or the only process)."""
    results = []
    for case in cases:
        ui.info(f"bench: {case.name}: {case.description}")
        prof = profile / case.name if profile else None
        try:
            spec = case_spec(case, tiny, layers)
            r = run_case(case, spec, device=device, warmup=warmup, steps=steps, strategy=strategy, profile_dir=prof)
        except Exception as exc:  # one failing case must not lose the others' numbers
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise
            ui.info(f"bench: {case.name} failed:\n{traceback.format_exc()}")
            results.append({"case": case.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append(r)
        ui.info(f"bench: {case.name}: {r['tokens_per_s']:,.0f} tokens/s, {r['peak_memory_gib']:.1f} GiB peak")
    return results


def _worker(
    case: Case,
    *,
    warmup: int,
    steps: int,
    tiny: bool,
    device: str,
    json_path: Path,
    out: Path,
    profile: bool,
    strategy: str = "ddp",
    attention_check: bool = False,
    layers: int | None = None,
) -> list[str]:
    """``ctrain bench`` arguments that run ``case`` alone and write its JSON to ``json_path``."""
    args = ["-m", "ctrain", "bench", "--cases", case.name, "--warmup", str(warmup), "--steps", str(steps)]
    args += ["--strategy", strategy, "--json", str(json_path), "--device", device, "--out", str(out)]
    args += (["--tiny"] if tiny else []) + (["--profile"] if profile else [])
    args += ["--layers", str(layers)] if layers else []
    return args + ([] if attention_check else ["--no-attention-check"])


def _collect(
    case: Case, launcher: list[str], worker: list[str], json_path: Path, label: str, env: dict[str, str]
) -> dict[str, Any]:
    """Run one worker and read back what it wrote; a worker that dies leaves an error row instead."""
    json_path.unlink(missing_ok=True)
    try:
        proc.stream([*launcher, *worker], prefix=f"[{label}] ", env=env)
    except CommandError as exc:  # keep the other cases' numbers
        last = [line for line in exc.stderr.splitlines() if line.strip()]
        error = f"its process failed (exit {exc.returncode}): {last[-1] if last else 'no output'}"
        return {"results": [{"case": case.name, "error": error}]}
    return json.loads(json_path.read_text())


def _one_gpu(device: str) -> dict[str, str]:
    """Environment of a one-GPU worker: one process seeing several GPUs would get nn.DataParallel,
    which TRL refuses."""
    env = {"PYTHONUNBUFFERED": "1"}
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return env


def run_isolated(
    cases: list[Case],
    *,
    tiny: bool,
    device: str,
    warmup: int,
    steps: int,
    out: Path,
    profile: bool,
    extra: dict[str, Any],
    attention_check: bool = True,
    layers: int | None = None,
) -> list[dict[str, Any]]:
    """Each case in a fresh process of its own, one after another (see the module's docstring).

    The first process also checks the varlen attention against the reference, so this process
    never holds the GPU; its finding goes into ``extra``.
    """
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ctrain-bench-") as tmp:  # each worker's JSON, read back here
        for case in cases:
            if (why := cannot_run(case, device == "cuda")) is not None:  # known here: no process for it
                results.append({"case": case.name, "error": why})
                ui.info(f"bench: {case.name} not run: {why}")
                continue
            path = Path(tmp) / f"{case.name}.json"
            check, attention_check = attention_check, False
            worker = _worker(
                case, warmup=warmup, steps=steps, tiny=tiny, device=device, json_path=path, out=out,
                profile=profile, attention_check=check, layers=layers,
            )  # fmt: skip
            doc = _collect(case, [sys.executable], worker, path, case.name, _one_gpu(device))
            if check and "attention_check" in doc:
                extra["attention_check"] = doc["attention_check"]
            results.extend(doc["results"])
    return results


def sweep(
    cases: list[Case],
    gpus: list[int],
    strategies: list[str],
    *,
    warmup: int,
    steps: int,
    tiny: bool,
    out: Path,
    profile: bool = False,
    layers: int | None = None,
) -> list[dict[str, Any]]:
    """Weak scaling: one ``torchrun`` (or plain process for 1 GPU) per GPU count, strategy and case."""
    results: list[dict[str, Any]] = []
    for n in gpus:
        for strategy in strategies if n > 1 else ["ddp"]:
            label = f"{n}gpu-{strategy if n > 1 else 'single'}"
            launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run"]
            launcher += [] if n == 1 else ["--standalone", f"--nproc_per_node={n}"]
            env = _one_gpu("cuda") if n == 1 else {"PYTHONUNBUFFERED": "1"}
            for case in cases:
                ui.info(f"bench: {label}: {case.name}")
                path = out / label / f"{case.name}.json"
                worker = _worker(
                    case,
                    warmup=warmup,
                    steps=steps,
                    tiny=tiny,
                    device="cuda",
                    json_path=path,
                    out=out / label,
                    profile=profile,
                    strategy=strategy,
                    layers=layers,
                )
                doc = _collect(case, launcher, worker, path, f"{label} {case.name}", env)
                results.extend({"world_size": n, **row} for row in doc["results"])
    return results


def add_scaling(results: list[dict[str, Any]]) -> None:
    """Weak-scaling efficiency of each multi-device result against the single-device one of its case."""
    ok = [r for r in results if "error" not in r]
    single = {r["case"]: r["tokens_per_s_per_device"] for r in ok if r["world_size"] == 1}
    for r in ok:
        base = single.get(r["case"])
        multi = r["world_size"] > 1 and base
        r["scaling_efficiency"] = r["tokens_per_s_per_device"] / base if multi else None


def _ratio(rate: float, base: float | None, name: str) -> str:
    if not base:
        return "-"
    return f"{rate / base:.2f}x {name}"  # two places: the targets (1.3x, 1.5x) sit within 0.1 of the results


def render(results: list[dict[str, Any]], losses: dict | None) -> str:
    # Each case against its baseline (seeds for full fine-tuning, lora-trl-best for adapters), same size.
    rates = {(r["case"], r["world_size"]): r["tokens_per_s"] for r in results if "error" not in r}
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["case"], "failed: " + r["error"][:80]] + [""] * 10)
            continue
        eff = r.get("scaling_efficiency")
        baseline = r.get("baseline", "seeds")
        rows.append(
            [
                r["case"],
                r["strategy"],
                r["world_size"],
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s_per_device']:,.0f}",
                _ratio(r["tokens_per_s"], rates.get((baseline, r["world_size"])), baseline),
                f"{100 * r['mfu_6n']:.1f}%",
                f"{100 * r['mfu_with_attention']:.1f}%",
                f"{r['peak_memory_gib']:.1f}",
                f"{r['step_ms']:.0f}",
                f"{r.get('first_step_seconds', 0):.1f}",
                f"{100 * eff:.1f}%" if eff else "-",
            ]
        )
    header = ["case", "strategy", "gpus", "tokens/s", "per gpu", "vs baseline", "mfu 6N", "mfu +attn", "peak GiB"]
    text = ui.table([*header, "step ms", "first step s", "scaling"], rows)
    if losses:
        text += (
            f"\nloss check ({losses['compared']} vs {losses['reference']}, same batches, {losses['steps']} steps): "
            f"loss {losses['first_loss']:.4f} -> {losses['last_loss']:.4f}, "
            f"max |diff| {losses['max_abs_diff']:.4f} (max rel {100 * losses['max_rel_diff']:.2f}%), "
            f"mean |diff| {losses['mean_abs_diff']:.4f}; step-to-step noise of {losses['reference']} "
            f"{losses['reference_step_noise']:.4f}"
        )
    return text


def write(path: Path, results: list[dict[str, Any]], env: dict[str, Any], losses: dict | None, extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"environment": env, "results": results, "loss_check": losses, **extra}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def bench(
    *,
    cases: list[str],
    device: str,
    tiny: bool,
    warmup: int,
    steps: int,
    gpus: list[int] | None,
    strategies: list[str],
    json_path: Path | None,
    out: Path,
    profile: bool,
    attention_check: bool = True,
    layers: int | None = None,
) -> str:
    """Run the benchmark as asked; returns the table, empty on ranks other than 0 (which write no JSON)."""
    chosen = pick_cases(cases)
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise ConfigError(f"unknown strategy {', '.join(bad)}; valid: {', '.join(STRATEGIES)}")
    if steps < 1 or warmup < 1:
        raise ConfigError("--steps and --warmup must be at least 1")
    device = resolve_device(device)
    env = environment(device)
    specs = [case_spec(case, tiny, layers) for case in chosen]  # before any work: a bad --layers stops here
    extra: dict[str, Any] = {"specs": {spec.name: vars(spec) for spec in specs}}
    if gpus:
        if device != "cuda":
            raise ConfigError("--gpus needs CUDA devices")
        if any(case.fast is None for case in chosen) and any(s != "ddp" for s in strategies):
            raise ConfigError("only the fast-engine cases sweep strategies other than DDP")
        results = sweep(
            chosen, gpus, strategies, warmup=warmup, steps=steps, tiny=tiny, out=out, profile=profile, layers=layers
        )
    elif len(chosen) > 1:
        results = run_isolated(
            chosen,
            tiny=tiny,
            device=device,
            warmup=warmup,
            steps=steps,
            out=out,
            profile=profile,
            extra=extra,
            attention_check=attention_check,
            layers=layers,
        )
    else:
        if device == "cuda" and attention_check and int(os.environ.get("RANK", "0")) == 0:
            from ctrain.fast.attention import self_check

            try:
                extra["attention_check"] = self_check("cuda")
            except Exception as exc:  # noqa: BLE001 - reported; the cases below show whether training works
                extra["attention_check"] = {"error": f"{type(exc).__name__}: {exc}"}
            ui.info(f"bench: varlen attention vs reference: {extra['attention_check']}")
        strategy = strategies[0] if strategies else "ddp"
        results = run_here(
            chosen,
            tiny=tiny,
            device=device,
            warmup=warmup,
            steps=steps,
            strategy=strategy,
            profile=out if profile else None,
            layers=layers,
        )
    add_scaling(results)
    losses = next((found for pair in LOSS_PAIRS if (found := compare_losses(results, *pair))), None)
    if int(os.environ.get("RANK", "0")) != 0:
        return ""
    write(json_path or out / "bench.json", results, env, losses, extra)
    return render(results, losses)
