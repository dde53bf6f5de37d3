"""CPU seconds (user + system, all threads) that the serving processes used, from /proc, for a level of
`scripts/device/profile_serve.sh`: a snapshot before and one after, then the level's line.

    before=$(python lab/proc_cpu.py snapshot SERVED_PID CORE_PID)     # the same after the level
    python lab/proc_cpu.py level "$before" "$after" [BUSY_SECONDS]

BUSY_SECONDS: the time the level's requests ran (requests over req/s), within the snapshots' window, which
also holds the benchmark client's start (~13 s on the H200 host for four client processes): the shares of a
core are given over it as well.

The API server(s) are the served process and its live descendants but the engine core (with its own).
"""
from __future__ import annotations

import json
import os
import sys
import time


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def with_descendants(pid: int) -> float:
    return cpu_seconds(pid) + sum(cpu_seconds(p) for p in descendants(pid))


def snapshot(served: int, core: int) -> dict:
    core_seconds = with_descendants(core)
    return {"time": time.time(), "api": with_descendants(served) - core_seconds, "core": core_seconds}


def level(before: dict, after: dict, busy: float | None = None) -> str:
    wall = after["time"] - before["time"]
    api, core = after["api"] - before["api"], after["core"] - before["core"]
    line = (f"CPU over the level ({wall:.1f} s): API server(s) {api:.1f} s ({api / wall:.0%} of a core), "
            f"engine core {core:.1f} s ({core / wall:.0%})")
    if busy:
        line += (f"; over the {busy:.1f} s its requests ran: API server(s) {api / busy:.0%} of a core, "
                 f"engine core {core / busy:.0%}")
    return line


if __name__ == "__main__":
    if sys.argv[1] == "snapshot":
        print(json.dumps(snapshot(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        print(level(json.loads(sys.argv[2]), json.loads(sys.argv[3]),
                    float(sys.argv[4]) if len(sys.argv) > 4 else None))
