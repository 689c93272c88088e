"""The preflight's rank side (ctrain.train.health): the driver rule, NCCL's transports from its own log
lines, the peers' rates, the warnings, and the unfit record the batch script reads (ctrain_unfit_nodes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctrain.errors import NodeUnfit
from ctrain.train import exits, goodput, health

REPO = Path(__file__).resolve().parents[2]

# Lines as NCCL 2.27 wrote them on 2 H200 (scripts/gpu-preflight.sh), and across two testbed nodes.
NVLINK = """vm:878:901 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
vm:878:901 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM
vm:878:878 [0] NCCL INFO Using network Socket
"""
SOCKETS = """vm:951:980 [0] NCCL INFO NET/IB : No device found.
vm:951:980 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
vm:951:980 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0
vm:951:951 [0] NCCL INFO Using network Socket
"""
MIXED = """n1:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
n1:1:1 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
n1:1:1 [0] NCCL INFO Using network IB
"""


def test_nccl_transports_are_read_from_its_info_lines() -> None:
    assert health.nccl_transports(NVLINK) == {"paths": ["P2P"], "network": "Socket"}
    assert health.nccl_transports(SOCKETS) == {"paths": ["NET/Socket"], "network": "Socket"}
    assert health.nccl_transports(MIXED) == {"paths": ["NET/IB", "SHM"], "network": "IB"}
    assert health.nccl_transports("") == {"paths": [], "network": None}


@pytest.mark.parametrize(
    ("image", "driver", "expected", "severity", "words"),
    [
        ((13, 0), (12, 8), True, "unfit", "driver too old: the image's torch is built for CUDA 13.0, this node's "
                                          "driver supports CUDA 12.8"),
        ((12, 8), (12, 4), True, "warn", "minor-version compatibility"),
        ((12, 4), None, True, "unfit", "libcuda.so.1 cannot be loaded"),
        ((13, 0), (13, 0), True, None, None),
        ((13, 0), (13, 1), True, None, None),
        ((13, 0), None, False, None, None),  # no GPUs asked for: a CPU job on a GPU image
        (None, None, True, None, None),  # a CPU-only torch
    ],
)
def test_the_images_cuda_against_the_nodes_driver(image, driver, expected, severity, words) -> None:
    problem = health.cuda_problem(image, driver, expected)
    if severity is None:
        assert problem is None
    else:
        assert problem is not None and problem[0] == severity and words in problem[1], problem


def test_the_image_cuda_is_read_without_importing_torch() -> None:
    code = ("import sys; from ctrain.train import health; v = health.image_cuda(); "
            "print('torch' in sys.modules, v)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    import torch

    assert out[0] == "False"  # the check ran before anything imported torch
    assert (out[1] == "None") == (torch.version.cuda is None)


def test_a_rank_below_half_its_peers_median_is_named() -> None:
    findings = [health.Finding("n1", 0, "GPU 0", 690.0), health.Finding("n1", 1, "GPU 1", 171.0),
                health.Finding("n2", 2, "GPU 0", 680.0), health.Finding("n2", 3, "GPU 1", 700.0)]  # fmt: skip
    slow = health.slow_ranks(findings)
    assert [(f.rank, m) for f, m in slow] == [(1, 685.0)]
    assert health.slow_ranks(findings[:1]) == []  # nobody to compare with
    assert health.slow_ranks([health.Finding("n", r, "CPU", 0.1 + r / 100) for r in range(4)]) == []


def test_cpu_ranks_of_one_host_are_one_peer_and_a_slow_host_is_still_named() -> None:
    # Two ranks sharing one busy host's cores differ by what they take from each other: not a finding.
    busy = [health.Finding("vm", 0, "CPU", 0.0237), health.Finding("vm", 1, "CPU", 0.0842)]
    assert health.slow_ranks(busy) == []
    # Hosts are compared by their best rank: node2 at 15% of node1 is named, with every rank it has.
    nodes = [health.Finding("node1", 0, "CPU", 0.08), health.Finding("node1", 1, "CPU", 0.03),
             health.Finding("node2", 2, "CPU", 0.012), health.Finding("node2", 3, "CPU", 0.011)]  # fmt: skip
    assert [f.rank for f, _ in health.slow_ranks(nodes)] == [2, 3]


def test_bus_bandwidth_is_nccl_tests_definition() -> None:
    # 512 MiB in 1.721 ms on 2 ranks (scripts/gpu-preflight.sh on 2 H200): 2(n-1)/n = 1.
    assert health.bus_bandwidth(512 * 2**20, 0.001721, 2) == pytest.approx(2495.1, rel=1e-3)
    assert health.bus_bandwidth(2**20, 0.001, 4) == pytest.approx(2**20 / 0.001 * 1.5 * 8 / 1e9)
    assert health.bus_bandwidth(2**20, 0.0, 2) == 0.0 and health.bus_bandwidth(2**20, 1.0, 1) == 0.0


def _fabric(tmp_path: Path, name: str, driver: str, rate: str) -> Path:
    root = tmp_path / "infiniband"
    device = root / name
    (device / "ports" / "1").mkdir(parents=True)
    (device / "ports" / "1" / "rate").write_text(rate)
    drivers = tmp_path / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (device / "device").mkdir()
    os.symlink(drivers, device / "device" / "driver")
    return root


def test_sockets_where_the_node_has_efa_or_infiniband_is_a_warning_naming_the_fix(tmp_path: Path) -> None:
    sockets = health.nccl_transports(SOCKETS)
    efa = health.fabric(_fabric(tmp_path / "a", "rdmap0s31", "efa", "100 Gb/sec (4X EDR)\n"))
    assert efa == {"kind": "efa", "devices": ["rdmap0s31"], "gbps": 100.0}
    [warning] = health.network_warnings(sockets, 2, 80.0, efa, True)
    assert "over TCP sockets, but this node has EFA (rdmap0s31)" in warning and "aws-ofi-nccl" in warning
    ib = health.fabric(_fabric(tmp_path / "b", "mlx5_0", "mlx5_core", "400 Gb/sec (4X NDR)\n"))
    warnings = health.network_warnings(sockets, 2, 20.0, ib, True)
    assert "InfiniBand (mlx5_0)" in warnings[0] and "/dev/infiniband" in warnings[0]
    assert "reached 20.0 Gb/s of bus bandwidth, under 25% of this node's 400 Gb/s fabric" in warnings[1]
    # IB in use at a fair rate, one node over NVLink, the testbed's sockets without a fabric: nothing to say.
    assert health.network_warnings(health.nccl_transports(MIXED), 2, 300.0, ib, True) == []
    assert health.network_warnings(health.nccl_transports(NVLINK), 1, 2000.0, ib, True) == []
    assert health.network_warnings(sockets, 2, 5.0, health.fabric(tmp_path / "none"), True) == []
    # One node's GPUs over the network transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1).
    [alone] = health.network_warnings(sockets, 1, 21.9, health.fabric(tmp_path / "none"), True)
    assert "NCCL_P2P_DISABLE or NCCL_SHM_DISABLE" in alone


def test_nccl_is_asked_for_its_transports_only_when_the_job_did_not_set_nccl_debug(tmp_path: Path,
                                                                                    monkeypatch) -> None:  # fmt: skip
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    assert not health.ask_nccl_for_its_transports(tmp_path)
    monkeypatch.delenv("NCCL_DEBUG")
    for name in ("NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert health.ask_nccl_for_its_transports(tmp_path)
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["NCCL_DEBUG_FILE"].startswith(str(tmp_path))
    (tmp_path / "nccl-preflight.n1.12").write_text(SOCKETS)
    assert health.nccl_transports(health.read_nccl_logs(tmp_path))["paths"] == ["NET/Socket"]


def test_a_rank_names_its_node_as_slurm_does(monkeypatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    assert health.host_name() == "node7"  # not the host's own, possibly longer, name
    monkeypatch.delenv("SLURMD_NODENAME")
    assert health.host_name() == os.uname().nodename


def test_an_unfit_node_is_recorded_for_the_batch_script_and_its_ranks_exit_to_be_requeued(tmp_path: Path) -> None:
    health.record_unfit(tmp_path, "node2", "matmul", "rank 1 (CPU)\nmultiplies $(reboot) slowly")
    health.record_unfit(tmp_path, "not a node", "disk", "x")
    lines = (tmp_path / health.UNFIT_FILE).read_text().splitlines()
    assert lines == ["node2 matmul rank 1 (CPU) multiplies $(reboot) slowly", "not_a_node disk x"]
    # The batch script takes only the job's own nodes from the file, and treats the rest as data.
    script = f"""source {REPO / 'sbatch/lib/ctrain.sh'}
scontrol() {{ printf '%s\\n' node1 node2 node3; }}
SLURM_JOB_NODELIST=node[1-3]
ctrain_unfit_nodes {tmp_path / health.UNFIT_FILE}"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out == "node2\n"
    record = exits.classify(NodeUnfit("preflight: node2: matmul: slow"), 1)
    assert record.cause == "unfit" and record.retry  # not an end: the batch script requeues without the node


def test_the_preflights_seconds_reach_the_report(tmp_path: Path) -> None:
    timeline = tmp_path / "1.timeline"
    timeline.write_text("100 0 start 90 2 0\n101 0 preflight 0.42 0\n103 0 process\n104 0 checked 0.31\n"
                        "105 0 data\n106 0 train 0\n110 0 end 20\n111 0 exited 0\n111 0 decided finished none\n")  # fmt: skip
    result, lines = goodput.report(timeline, "1")
    assert result["runs"][0]["preflight_seconds"] == 0.7
    assert "preflight 0.7 s" in lines[2]


def test_rank_checks_on_two_cpu_processes(tmp_path: Path) -> None:
    """`python -m ctrain.train.health` under torchrun: both ranks pass, with a rate, a bandwidth and gloo."""
    env = {**os.environ, "CTRAIN_PIDS": str(tmp_path), "OMP_NUM_THREADS": "1"}
    # Both ranks on one core: they share it evenly, whatever else the machine runs (another test, on a
    # 2-core machine), so the rate check compares like with like; across cores a busy one is a slow rank.
    core = min(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "ctrain.train.health"], capture_output=True, text=True, env=env, timeout=300,
                         preexec_fn=lambda: os.sched_setaffinity(0, {core}))  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "preflight (quick): 2 rank(s), matmul " in run.stdout and "Gb/s bus bandwidth via gloo" in run.stdout
    assert not (tmp_path / health.UNFIT_FILE).exists()


def test_the_logged_mfu_counts_6n_trained_4n_frozen_and_4bit_weights_at_their_number() -> None:
    """The convention the log names: a LoRA base is 4N, not 6N (it logged 74.5 % where 4N is 49.3 %
    on an 8B model), and QLoRA's packed weights are not half their number."""
    from types import SimpleNamespace

    import torch

    from ctrain.train.model import flops_per_token

    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
    assert flops_per_token(model) == (6.0 * (32 + 16), "6N")
    model[0].weight.requires_grad_(False)
    assert flops_per_token(model) == (4.0 * 32 + 6.0 * 16, "6N trained + 4N frozen")
    packed = torch.nn.Parameter(torch.zeros(16, dtype=torch.uint8), requires_grad=False)  # 32 weights, 2 a byte
    packed.quant_state = SimpleNamespace(shape=torch.Size([8, 4]))
    model[0].weight = packed
    assert flops_per_token(model) == (4.0 * 32 + 6.0 * 16, "6N trained + 4N frozen")


def test_a_ranks_matmul_rate_is_its_best_slice_so_a_busy_moment_does_not_name_it(monkeypatch) -> None:
    """Another process took the rank's core for its first half second (the other test worker on CI's two
    cores): that slice's rate is a tenth of the rest, and the rate is the rest's, not the window's mean."""
    clock = [0.0]

    class Matrix:
        def __matmul__(self, other: object) -> Matrix:
            clock[0] += 0.01 if clock[0] < 0.5 else 0.001  # busy, then the core to itself
            return self

    class Torch:
        float32 = bfloat16 = None

        @staticmethod
        def randn(*_: object, **__: object) -> Matrix:
            return Matrix()

    class Device:
        type = "cpu"

    monkeypatch.setattr(health.time, "perf_counter", lambda: clock[0])
    rate = health._matmul_rate(Torch(), Device(), 1.0)
    free = 2 * 256**3 / 0.001 / 1e12  # one product a millisecond
    assert 0.95 * free <= rate <= 1.05 * free, (rate, free)
