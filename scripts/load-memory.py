#!/usr/bin/env python3
"""The memory of loading a recipe's model the way `ctrain train` loads it under FSDP, and nothing
else: every rank reads the checkpoint (``ctrain.train.model.build_model``, the weights straight
onto its own GPU, in the dtype training keeps). Run it under torchrun with 1 process and then with
one per GPU, with scripts/host-memory.py sampling the tree, to see what of a node's host memory
grows with its GPU count (more processes than GPUs share them, round robin: a one-GPU machine
still shows the host side of 4 ranks). Each rank prints one JSON line: its host RSS and anonymous
memory after the load, its peak RSS, its GPU's peak allocation, the seconds the load took.
``--via-host`` loads as ctrain does without FSDP (and as most scripts do): into host memory first,
then to the GPU; the baseline. ``--widen-on-host`` reads straight to the GPU as transformers does
when asked for float32 from a bf16 checkpoint (each tensor widened in host memory, then moved), as
ctrain did before it read the stored dtype and widened on the GPU (``ctrain.train.model._read_dtype``).
  torchrun --nproc_per_node=N scripts/load-memory.py [--via-host | --widen-on-host] RECIPE [KEY=VALUE ...]
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

GIB = 2**30


def status_kib(field: str) -> int:
    """A size from /proc/self/status (RssAnon, RssFile, VmRSS), in KiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main() -> None:
    import torch
    import torch.distributed as dist

    from ctrain.train.model import build_model, load_config
    from ctrain.train.recipe import load_recipe
    from ctrain.train.tokenizer import load_tokenizer

    args = sys.argv[1:]
    via_host, widen_on_host = args[:1] == ["--via-host"], args[:1] == ["--widen-on-host"]
    if via_host or widen_on_host:
        args = args[1:]
    recipe = load_recipe(args[0], args[1:])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")  # barriers only, and NCCL refuses two ranks on one GPU
    config = load_config(recipe)
    if widen_on_host:
        config.dtype = None  # no stored dtype: read in the training dtype, as before
    tokenizer = load_tokenizer(recipe)
    precision = "bf16" if cuda else "fp32"
    dist.barrier()
    start = time.perf_counter()
    model = build_model(recipe, config, tokenizer, precision, device.type, None if via_host else device)
    if via_host:
        model.to(device)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    report = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "via": "host" if via_host else "gpu, widened on the host" if widen_on_host else "gpu",
        "load_s": round(seconds, 1),
        "weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, 2),
        "rss_gib": round(status_kib("VmRSS") / 2**20, 2),
        "rss_anon_gib": round(status_kib("RssAnon") / 2**20, 2),
        "rss_file_gib": round(status_kib("RssFile") / 2**20, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    if cuda:
        report["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
    print(json.dumps(report), flush=True)
    time.sleep(2)  # the sampler's interval: every rank is seen holding what it loaded
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
