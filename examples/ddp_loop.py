"""A plain PyTorch DDP training loop, with no ctrain import: what ctrain gives any script.

    sbatch sbatch/apptainer_multinode.sbatch -- examples/ddp_loop.py --steps 200

torchrun (started by the sbatch scripts on every node) sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; the script only has to read them, as any torchrun script does. It
gets the image, the launch, requeue at the time limit, and the end of the step when a node or a
rank is lost. It does not get a checkpoint at a signal or the hang watchdog: examples/train_clm.py
and ctrain.train.script show the opt-in for those.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step_seconds", type=float, default=0.0, help="sleep per step (a slower model)")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    target = torch.arange(16, dtype=torch.float32) / 16
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 16, generator=generator)
        loss = ((model(x.to(device)).squeeze(1) - (x @ target).to(device)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 and rank == 0:
            print(f"step {step}/{args.steps} loss {loss.item():.5f} on {world} processes", flush=True)
        time.sleep(args.step_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
