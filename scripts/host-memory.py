#!/usr/bin/env python3
"""Peak host memory of a process tree, the node's view: every SECONDS the resident and proportional
set sizes (RSS, PSS from /proc/PID/smaps_rollup) of PID and all its descendants are summed; PSS
counts a page shared by N processes (a checkpoint file mapped by every rank) once in all, RSS in
each. Anonymous memory (the heap: what no file backs and the kernel cannot drop) is summed too:
the part of a node's memory that grows with each rank it runs. Runs until PID ends, then writes
one JSON object to OUT: the peaks, and the sums over time (every 2 s at most) so a run's phases
(loading, training, saving) can be told apart.
  scripts/host-memory.py PID OUT [SECONDS]
"""

from __future__ import annotations

import json
import sys
import time

GIB = 2**30


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children(p))
    return found


def sizes(pid: int) -> tuple[int, int, int]:
    """RSS, PSS and anonymous memory of one process in bytes (zeros once it is gone)."""
    rss = pss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Anonymous:"):
                    anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss, anon


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    pid, out = int(sys.argv[1]), sys.argv[2]
    every = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    peak = {"rss_sum": 0, "pss_sum": 0, "anon_sum": 0, "processes": 0}
    per_process: dict[int, int] = {}
    start = time.monotonic()
    at = 0.0
    series: list[tuple[float, float, float, float]] = []
    while alive(pid):
        rss_sum = pss_sum = anon_sum = 0
        pids = tree(pid)
        for p in pids:
            rss, pss, anon = sizes(p)
            rss_sum, pss_sum, anon_sum = rss_sum + rss, pss_sum + pss, anon_sum + anon
            per_process[p] = max(per_process.get(p, 0), rss)
        now = time.monotonic() - start
        if pss_sum > peak["pss_sum"]:
            at = now
        if not series or now - series[-1][0] >= 2.0:
            series.append((round(now, 1), round(rss_sum / GIB, 2), round(pss_sum / GIB, 2), round(anon_sum / GIB, 2)))
        peak = {"rss_sum": max(peak["rss_sum"], rss_sum), "pss_sum": max(peak["pss_sum"], pss_sum),
                "anon_sum": max(peak["anon_sum"], anon_sum), "processes": max(peak["processes"], len(pids))}  # fmt: skip
        time.sleep(every)
    report = {
        "peak_pss_sum_gib": round(peak["pss_sum"] / GIB, 2),
        "peak_rss_sum_gib": round(peak["rss_sum"] / GIB, 2),
        "peak_anon_sum_gib": round(peak["anon_sum"] / GIB, 2),
        "peak_pss_at_s": round(at, 1),
        "largest_process_rss_gib": round(max(per_process.values(), default=0) / GIB, 2),
        "processes": peak["processes"],
        "seconds": round(time.monotonic() - start, 1),
        "interval_s": every,
        "series_s_rss_pss_anon_gib": series,
    }
    with open(out, "w") as handle:
        json.dump(report, handle)
        handle.write("\n")


if __name__ == "__main__":
    main()
