"""The job's preflight, rank side (the rank checks): is every GPU, and the network between the ranks, fit to train?

The preflight has two halves (docs/reliability.md, "Preflight", lists every check and its cost;
:mod:`ctrain.protocol` names them; neither is :mod:`ctrain.train.preflight`, the checks before a run):

- the node checks, in the sbatch library (``ctrain_preflight``), on each node's host before the
  training step: node-local scratch and image-cache space, the shared project directory, the GPUs'
  health as ``nvidia-smi`` reports it;
- the rank checks, here, in every rank of ``ctrain train`` (or ``python -m ctrain.train.health`` under a
  launcher, which ``ctrain preflight`` runs): the image's CUDA against the node's driver, before
  torch is imported; then, with the process group, each GPU's memory and matmul rate against its
  peers', and an all-reduce across all ranks with its bandwidth and the transport NCCL chose.

A node that fails a check is written to the run's directory's ``unfit`` file (``$CTRAIN_RUN_DIR``,
else ``$CTRAIN_PIDS``), one line ``HOST CHECK MESSAGE`` (:class:`ctrain.protocol.UnfitLine`; the
library's node checks write the same file); the batch script requeues the job without it, as
it does for a lost node. Warnings (NCCL on sockets where the node has InfiniBand or EFA, a bandwidth
far below the fabric's) are logged and cost nothing else. Torch is imported only inside the
functions that need it: the driver check runs before the training stack is loaded.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrain import protocol
from ctrain.errors import NodeUnfit

# The protocol's names, here as before: CTRAIN_PREFLIGHT (off | quick | full; the library sets it from
# slurm.preflight), the run's directory's variable (CTRAIN_PIDS, read after CTRAIN_RUN_DIR), its
# unfit file ("HOST CHECK MESSAGE" per failed check) and NCCL_DEBUG_FILE's name in it.
PREFLIGHT_ENV = protocol.PREFLIGHT_ENV
PIDS_ENV = protocol.RUN_DIR_OLD_ENV
UNFIT_FILE = protocol.UNFIT_FILE
NCCL_LOG_PREFIX = protocol.NCCL_LOG_PREFIX
SLOW_FRACTION = 0.5  # a rank whose matmul rate is below this share of its peers' median is named
# A rank's matmul rate is the best of slices this long: another process on the node's cores lowers some
# slices, a throttled or failing device every one (a CPU quota's 100 ms periods fit 2.5 times in each).
MATMUL_SLICE_SECONDS = 0.25
FABRIC_FRACTION = 0.25  # an all-reduce bus bandwidth below this share of the fabric's rate is a warning
MEMORY_SHARE = 0.9  # the share of a GPU's free memory that must be allocatable
MAX_TEXT = 1024 * 1024  # bytes read from torch's version.py or an NCCL log


@dataclass(frozen=True)
class Level:
    """How long each rank check runs; ``quick`` (the default) costs about a second."""

    matmul_seconds: float
    allreduce_mib: int  # per rank, on GPUs; a sixteenth of it on CPUs (gloo)
    allreduce_iterations: int
    fill_memory: bool  # write the allocated GPU memory, not only allocate it


LEVELS: dict[str, Level] = {
    "quick": Level(matmul_seconds=0.2, allreduce_mib=64, allreduce_iterations=5, fill_memory=False),
    "full": Level(matmul_seconds=1.0, allreduce_mib=512, allreduce_iterations=20, fill_memory=True),
}
CHOICES = ("off", *LEVELS)



@dataclass
class Finding:
    """One check's outcome on one rank: ``problem`` set means the node is unfit."""

    host: str
    rank: int
    device: str
    rate: float = 0.0  # matmul TFLOP/s
    problems: list[tuple[str, str]] = field(default_factory=list)  # (check, message)


def level_from_env() -> str:
    """The preflight level this process runs (``quick`` outside the library)."""
    value = os.environ.get(PREFLIGHT_ENV, "quick")
    return value if value in CHOICES else "quick"


# --- the image's CUDA against the node's driver (stdlib: before torch is imported) ------------------


def image_cuda() -> tuple[int, int] | None:
    """The CUDA version the installed torch was built for, read from torch/version.py without importing it."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "version.py"
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_TEXT).decode("utf-8", "replace")
    except OSError:
        return None
    match = re.search(r"^cuda\b[^=\n]*=\s*['\"](\d+)\.(\d+)", text, re.MULTILINE)
    return (int(match.group(1)), int(match.group(2))) if match else None


def driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA the node's driver supports (libcuda's cuDriverGetVersion); None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, version.value % 1000 // 10


def gpus_expected() -> bool:
    """Whether Slurm or the launcher gave this process GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    try:
        on_node = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    except ValueError:
        on_node = 0
    return on_node > 0 or bool(visible and visible not in ("-1", "NoDevFiles"))


def cuda_problem(image: tuple[int, int] | None, driver: tuple[int, int] | None,
                 expected: bool) -> tuple[str, str] | None:  # fmt: skip
    """(severity, message) when the image's CUDA cannot run on the driver: ``unfit`` or ``warn``; else None."""
    if image is None or not expected:
        return None
    built = f"{image[0]}.{image[1]}"
    if driver is None:
        return ("unfit", f"the job has GPUs but the NVIDIA driver's libcuda.so.1 cannot be loaded here (the image's "
                         f"torch is built for CUDA {built}): is the driver installed on this node, and does the "
                         f"container bind it (Apptainer --nv, pyxis with enroot's NVIDIA hook)?")  # fmt: skip
    supports = f"{driver[0]}.{driver[1]}"
    if driver[0] < image[0]:
        return ("unfit", f"driver too old: the image's torch is built for CUDA {built}, this node's driver supports "
                         f"CUDA {supports}; update the driver, or build the image with a torch for CUDA "
                         f"{driver[0]}.x (image.torch_index in ctrain.yaml)")  # fmt: skip
    if driver < image:
        return ("warn", f"the image's torch is built for CUDA {built}, the driver supports {supports}: it runs "
                        "through CUDA's minor-version compatibility, but kernels that need a newer driver (PTX "
                        f"compiled at run time) fail; a driver for CUDA {built} or newer avoids that")  # fmt: skip
    return None


# --- the network: what NCCL chose and what the node has ------------------------------------------


def nccl_transports(text: str) -> dict[str, Any]:
    """What an NCCL INFO log says about the transports: ``{"paths": [...], "network": str | None}``.

    ``paths`` are the channel transports (``P2P``, ``SHM``, ``NET/Socket``, ``NET/IB``, ``NET/OFI``
    or ``NET/AWS Libfabric``), from lines like ``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM``;
    ``network`` is the plugin NCCL loaded (``Using network Socket``).
    """
    paths: set[str] = set()
    for match in re.finditer(r"\bvia (P2P|SHM|NET/[A-Za-z][\w ]*?)(?:/|\s|$)", text):
        paths.add(match.group(1).strip())
    network = re.search(r"Using network ([^\n]+)", text)
    return {"paths": sorted(paths), "network": network.group(1).strip() if network else None}


def fabric(root: Path = Path("/sys/class/infiniband")) -> dict[str, Any]:
    """The node's RDMA devices: ``{"kind": "efa" | "ib" | None, "devices": [...], "gbps": total port rate}``."""
    devices: list[str] = []
    gbps = 0.0
    kind = None
    try:
        entries = sorted(root.iterdir())[:64]
    except OSError:
        return {"kind": None, "devices": [], "gbps": 0.0}
    for entry in entries:
        devices.append(entry.name)
        try:
            driver = os.path.basename(os.readlink(entry / "device" / "driver"))
        except OSError:
            driver = ""
        kind = "efa" if driver == "efa" or entry.name.startswith(("efa", "rdmap")) else kind or "ib"
        for rate in sorted((entry / "ports").glob("*/rate"))[:16]:
            try:
                match = re.match(r"\s*([\d.]+)\s*Gb/sec", rate.read_text()[:200])
            except OSError:
                continue
            if match:
                gbps += float(match.group(1))
    return {"kind": kind, "devices": devices, "gbps": gbps}


def network_warnings(transports: dict[str, Any], nodes: int, bus_gbps: float | None, node_fabric: dict[str, Any],
                     gpus: bool) -> list[str]:  # fmt: skip
    """What a user should change, from the transports NCCL chose, the node's fabric and the bandwidth."""
    paths = transports["paths"]
    warnings = []
    sockets = "NET/Socket" in paths or (transports["network"] or "").startswith("Socket")
    if nodes > 1 and sockets and node_fabric["kind"] == "efa":
        warnings.append(
            "NCCL runs between the nodes over TCP sockets, but this node has EFA "
            f"({', '.join(node_fabric['devices'])}): "
            "the image lacks the aws-ofi-nccl plugin or libfabric's EFA provider (FI_PROVIDER=efa); set slurm.efa "
            "and build the image with the plugin (docs/cluster.md)")  # fmt: skip
    elif nodes > 1 and sockets and node_fabric["kind"] == "ib":
        warnings.append(
            f"NCCL runs between the nodes over TCP sockets, but this node has InfiniBand "
            f"({', '.join(node_fabric['devices'])}): bind /dev/infiniband into the container (slurm.mounts), and "
            "check NCCL_IB_HCA and NCCL_SOCKET_IFNAME")  # fmt: skip
    elif nodes == 1 and gpus and any(p.startswith("NET/") for p in paths):
        warnings.append(
            "the GPUs of this node exchange data over the network transport, not NVLink/PCIe peer-to-peer or "
            "shared memory: NCCL_P2P_DISABLE or NCCL_SHM_DISABLE is set, or the container hides the GPUs from "
            "each other")  # fmt: skip
    if nodes > 1 and bus_gbps is not None and node_fabric["gbps"] and bus_gbps < FABRIC_FRACTION * node_fabric["gbps"]:
        warnings.append(
            f"the all-reduce reached {bus_gbps:.1f} Gb/s of bus bandwidth, under {FABRIC_FRACTION:.0%} of this "
            f"node's {node_fabric['gbps']:.0f} Gb/s fabric")  # fmt: skip
    return warnings


def read_nccl_logs(directory: Path) -> str:
    """The NCCL INFO lines this job's ranks wrote under the preflight's NCCL_DEBUG_FILE (bounded)."""
    text = []
    left = MAX_TEXT
    for path in sorted(directory.glob(f"{NCCL_LOG_PREFIX}.*"))[:64]:
        try:
            with open(path, "rb") as handle:
                chunk = handle.read(left).decode("utf-8", "replace")
        except OSError:
            continue
        text.append(chunk)
        left -= len(chunk)
        if left <= 0:
            break
    return "\n".join(text)


def ask_nccl_for_its_transports(directory: Path | None) -> bool:
    """Have NCCL log its INIT and NET lines to files in DIRECTORY (before torch starts NCCL), unless
    the user set NCCL_DEBUG: their setting wins, and the transport is then reported as unknown."""
    if directory is None or "NCCL_DEBUG" in os.environ:
        return False
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    os.environ["NCCL_DEBUG_FILE"] = str(directory / f"{NCCL_LOG_PREFIX}.%h.%p")
    return True


# --- the peers' rates ------------------------------------------------------------------------------


def slow_ranks(findings: list[Finding]) -> list[tuple[Finding, float]]:
    """The ranks whose matmul rate is under SLOW_FRACTION of the median rate of their peers.

    Each GPU is a peer of its own; the CPU ranks of one host share its cores, so a host is one
    peer, at its best rank's rate: two CPU ranks of one busy host differ by what they take from
    each other, which says nothing of the host."""
    def peer(f: Finding) -> tuple[Any, ...]:
        return (f.host,) if f.device == "CPU" else (f.host, f.rank)

    rate: dict[tuple[Any, ...], float] = {}
    for f in findings:
        if f.rate > 0:
            rate[peer(f)] = max(rate.get(peer(f), 0.0), f.rate)
    if len(rate) < 2:
        return []
    median = statistics.median(rate.values())
    return [(f, median) for f in findings if f.rate <= 0 or rate[peer(f)] < SLOW_FRACTION * median]


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """An all-reduce's bus bandwidth in Gb/s (nccl-tests' definition: 2(n-1)/n of the algorithm's)."""
    if seconds <= 0 or world < 2:
        return 0.0
    return nbytes / seconds * 2 * (world - 1) / world * 8 / 1e9


def record_unfit(directory: Path, host: str, check: str, message: str) -> None:
    """Append one failed check to the run's unfit file (the batch script requeues without HOST)."""
    protocol.append_unfit(directory, protocol.UnfitLine(host, check, message))


def pids_dir() -> Path | None:
    """The run's directory under the library (``CTRAIN_RUN_DIR``, else ``CTRAIN_PIDS``), else None."""
    return protocol.run_dir()


def host_name() -> str:
    """This node's name as Slurm knows it, the rule of the library's node checks
    (``${SLURMD_NODENAME:-$(uname -n)}``): only the job's own node names in the unfit file count
    (``ctrain_unfit_nodes``), and a host name can be a longer one (``node1.cluster.local``)."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename or socket.gethostname()


# --- the rank checks -------------------------------------------------------------------------------


def check_driver(log: Any) -> None:
    """The image's CUDA against the node's driver, before torch is imported; raises NodeUnfit."""
    problem = cuda_problem(image_cuda(), driver_cuda(), gpus_expected())
    if problem is None:
        return
    severity, message = problem
    if severity == "warn":
        log.warning("preflight: %s: cuda: %s", host_name(), message)
        return
    directory = pids_dir()
    if directory is not None:
        record_unfit(directory, host_name(), "cuda", message)
    raise NodeUnfit(f"preflight: {host_name()}: cuda: {message}")


def _matmul_rate(torch: Any, device: Any, seconds: float) -> float:
    """TFLOP/s of square matmuls on DEVICE for about SECONDS (bf16 on GPUs, fp32 on CPUs): the best of its
    slices of MATMUL_SLICE_SECONDS (one slice where SECONDS is shorter)."""
    cuda = device.type == "cuda"
    n = 4096 if cuda else 256
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda *_: None)
    for _ in range(2):
        a @ b
    sync(device)
    width = min(seconds, MATMUL_SLICE_SECONDS)
    best, end = 0.0, time.perf_counter() + seconds
    while True:
        count, start = 0, time.perf_counter()
        while True:
            for _ in range(8):
                a @ b
            count += 8
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= width:
                break
        best = max(best, 2 * n**3 * count / elapsed / 1e12)
        if time.perf_counter() >= end:
            return best


def _memory_problem(torch: Any, device: Any, fill: bool) -> str | None:
    """Allocate MEMORY_SHARE of the GPU's free memory (and write it, FILL); the problem, or None."""
    free, total = torch.cuda.mem_get_info(device)
    size = int(free * MEMORY_SHARE)
    try:
        block = torch.empty(size, dtype=torch.uint8, device=device)
        if fill:
            block.fill_(1)
        torch.cuda.synchronize(device)
        del block
    except RuntimeError as exc:  # torch.OutOfMemoryError and CUDA errors
        return (f"GPU {device.index}: {size / 2**30:.1f} GiB of its {free / 2**30:.1f} GiB free could not be "
                f"allocated: {exc}")
    finally:
        torch.cuda.empty_cache()
    if total and free < 0.5 * total:
        return (f"GPU {device.index}: only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free before the job started "
                "(another process holds the rest: nvidia-smi on the node names it)")  # fmt: skip
    return None


def rank_checks(level_name: str, device: Any, log: Any, nccl_logs: bool = False) -> dict[str, Any]:
    """Every rank's GPU checks and the all-reduce, in the process group that is already started.

    Every rank learns every rank's finding (one all_gather), so all agree on whether a node is unfit
    and all raise NodeUnfit together; rank 0 logs the summary and records the unfit nodes. Returns
    the summary (rates, bandwidth, transports, warnings, seconds).
    """
    import torch
    import torch.distributed as dist

    level = LEVELS[level_name]
    started = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    cuda = device.type == "cuda"
    host = host_name()
    mine = Finding(host, rank, f"GPU {device.index}" if cuda else "CPU")
    if cuda:
        problem = _memory_problem(torch, device, level.fill_memory)
        if problem:
            mine.problems.append(("gpu-memory", problem))
    try:
        mine.rate = _matmul_rate(torch, device, level.matmul_seconds)
    except RuntimeError as exc:
        mine.problems.append(("matmul", f"{mine.device}: a matmul failed: {exc}"))
    findings = [mine]
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        findings = gathered
    for finding, median in slow_ranks(findings):
        unit = "TFLOP/s"
        finding.problems.append(("matmul", f"rank {finding.rank} ({finding.device}) multiplies at {finding.rate:.3g} "
                                           f"{unit}, under {SLOW_FRACTION:.0%} of its peers' median {median:.3g} "
                                           f"{unit} (a throttled, failing or shared device)"))  # fmt: skip
    unfit = [(f.host, check, message) for f in findings for check, message in f.problems]
    summary: dict[str, Any] = {
        "level": level_name,
        "ranks": world,
        "rates": [round(f.rate, 3) for f in findings],
        "unfit": unfit,
    }
    bus = None
    if world > 1 and not unfit:
        nbytes = level.allreduce_mib * 2**20 // (1 if cuda else 16)
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(level.allreduce_iterations):
            dist.all_reduce(tensor)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / level.allreduce_iterations
        bus = bus_bandwidth(nbytes, seconds, world)
        summary.update(allreduce_mib=nbytes / 2**20, allreduce_seconds=round(seconds, 6), bus_gbps=round(bus, 2))
        del tensor
    nodes = len({f.host for f in findings})
    directory = pids_dir()
    if cuda and nccl_logs and directory is not None and world > 1:
        transports = nccl_transports(read_nccl_logs(directory))
    elif world > 1:
        transports = {"paths": [dist.get_backend()], "network": None}
    else:
        transports = {"paths": [], "network": None}
    summary["transports"] = transports
    summary["warnings"] = network_warnings(transports, nodes, bus, fabric(), cuda) if rank == 0 else []
    if cuda:
        # The memory probe allocated most of the GPU (MEMORY_SHARE): the peak a training logs
        # ("GPU allocated ... peak") must be its own, so the probes' is forgotten here.
        torch.cuda.reset_peak_memory_stats(device)
    summary["seconds"] = round(time.perf_counter() - started, 3)
    if rank == 0:
        _log_summary(log, summary, findings, cuda)
        if unfit and directory is not None:
            for node, check, message in unfit:
                record_unfit(directory, node, check, message)
    if unfit:
        node, check, message = unfit[0]
        raise NodeUnfit(f"preflight: {node}: {check}: {message}")
    return summary


def _log_summary(log: Any, summary: dict[str, Any], findings: list[Finding], cuda: bool) -> None:
    rates = [f.rate for f in findings if f.rate > 0]
    spread = f"{min(rates):.3g}-{max(rates):.3g} TFLOP/s" if rates else "no rate"
    what = "GPU" if cuda else "CPU"
    line = f"preflight ({summary['level']}): {summary['ranks']} rank(s), matmul {spread} per {what}"
    if "bus_gbps" in summary:
        transports = summary["transports"]
        via = ", ".join(transports["paths"]) or "transport unknown (NCCL_DEBUG set by the job)"
        if transports["network"]:
            via += f"; network {transports['network']}"
        line += (f", all-reduce of {summary['allreduce_mib']:.0f} MiB {summary['allreduce_seconds'] * 1e3:.1f} ms "
                 f"= {summary['bus_gbps']:.1f} Gb/s bus bandwidth via {via}")  # fmt: skip
    line += f"; {summary['seconds']:.2f} s"
    log.info("%s", line)
    for node, check, message in summary["unfit"]:
        log.error("preflight: %s: unfit: %s: %s", node, check, message)
    for warning in summary["warnings"]:
        log.warning("preflight: %s", warning)


def main() -> int:
    """``python -m ctrain.train.health`` under torchrun: the rank checks alone (``ctrain preflight``, own scripts)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    log = logging.getLogger("ctrain.train.health")
    level = level_from_env()
    if level == "off":
        level = "quick"
    try:
        check_driver(log)
        import torch
        import torch.distributed as dist

        nccl = ask_nccl_for_its_transports(pids_dir()) if torch.cuda.is_available() else False
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if torch.cuda.is_available():
                torch.cuda.set_device(local)
                device = torch.device("cuda", local)
                dist.init_process_group("nccl", device_id=device)
            else:
                device = torch.device("cpu")
                dist.init_process_group("gloo")
        else:
            device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        summary = rank_checks(level, device, log, nccl_logs=nccl)
        if int(os.environ.get("RANK", "0")) == 0:
            import json

            print("preflight-json " + json.dumps(summary), flush=True)
    except NodeUnfit as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if "torch" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
