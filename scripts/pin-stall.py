"""How much a training thread stalls while another thread reserves host memory for staging:
torch's pinned allocation, pageable memory touched by a torch op, and pageable memory registered
with cudaHostRegister through ctypes (which lets go of the interpreter). The training thread's
loop mimics a step's use of the GPU and of torch's pinned-memory allocator (a batch pinned and sent)."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
import time

import torch

GIB = int(sys.argv[1]) if len(sys.argv) > 1 else 8
CHUNK = 1 << 30  # reserved as tensors of 1 GiB, as a state dict's tensors are


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the same library, so the same context)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                return ctypes.CDLL(line.split()[-1])
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")):
        return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


def reserve(how: str, keep: list) -> None:
    lib = cudart() if how == "register" else None
    for _ in range(GIB):
        if how == "pinned":
            keep.append(torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True))
        else:
            buffer = torch.empty(CHUNK, dtype=torch.uint8)
            buffer.zero_()
            if lib is not None:
                assert lib.cudaHostRegister(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(CHUNK), 0) == 0
            keep.append(buffer)


def main() -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for how in ("none", "pinned", "touched", "register"):
        keep: list = []
        worker = threading.Thread(target=reserve, args=(how, keep)) if how != "none" else None
        gaps, started = [], time.perf_counter()
        if worker is not None:
            worker.start()
        deadline = started + 3
        while (worker is not None and worker.is_alive()) or time.perf_counter() < deadline:
            t = time.perf_counter()
            batch = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
            batch.to("cuda", non_blocking=True)
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            gaps.append(time.perf_counter() - t)
        took = time.perf_counter() - started
        gaps.sort()
        copy = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
        t = time.perf_counter()
        for buffer in keep:
            buffer.copy_(copy, non_blocking=True)
        torch.cuda.synchronize()
        rate = (len(keep) / (time.perf_counter() - t)) if keep else 0
        print(f"{how:9s} {GIB} GiB in {took:5.1f} s: training loop {len(gaps)} iterations, median {gaps[len(gaps) // 2] * 1e3:.1f} ms, "
              f"longest {gaps[-1] * 1e3:.0f} ms, over 100 ms: {sum(g > 0.1 for g in gaps)}; copy into it {rate:.1f} GiB/s")
        del keep


if __name__ == "__main__":
    main()
