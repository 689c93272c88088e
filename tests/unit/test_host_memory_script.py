"""scripts/host-memory.py, which the GPU scripts use for a node's peak host memory: it finds a
process tree's children and counts memory they touch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host-memory.py"
# A parent whose child holds 300 MiB of touched memory for a second, then both end.
TREE = (
    "import subprocess, sys; subprocess.run([sys.executable, '-c', "
    "'import time; b = bytearray(300 * 2**20); time.sleep(1.5)'])"
)


def test_the_peak_counts_a_childs_memory(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", TREE])
    out = tmp_path / "memory.json"
    subprocess.run([sys.executable, str(SCRIPT), str(parent.pid), str(out), "0.1"], check=True, timeout=60)
    parent.wait(timeout=30)
    report = json.loads(out.read_text())
    assert report["processes"] >= 2, report
    assert 0.29 <= report["largest_process_rss_gib"] < 1.0, report
    assert report["peak_rss_sum_gib"] >= report["largest_process_rss_gib"] >= 0.29
    assert 0.29 <= report["peak_pss_sum_gib"] <= report["peak_rss_sum_gib"]
    assert 0.29 <= report["peak_anon_sum_gib"] <= report["peak_rss_sum_gib"], report
    assert report["series_s_rss_pss_anon_gib"] and report["series_s_rss_pss_anon_gib"][0][0] == 0.0


# A child that reads a 200 MiB file through a mapping, as a rank reads a checkpoint: resident, but
# backed by the file, not anonymous.
MAPPED = (
    "import mmap, sys, time; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
    "sum(m[i] for i in range(0, len(m), 4096)); time.sleep(1.5)"
)


def test_a_mapped_file_is_resident_but_not_anonymous(tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\1" * (200 * 2**20))
    child = subprocess.Popen([sys.executable, "-c", MAPPED, str(data)])
    out = tmp_path / "memory.json"
    subprocess.run([sys.executable, str(SCRIPT), str(child.pid), str(out), "0.1"], check=True, timeout=60)
    child.wait(timeout=30)
    report = json.loads(out.read_text())
    assert report["peak_rss_sum_gib"] >= 0.19, report
    assert report["peak_anon_sum_gib"] < 0.1, report
