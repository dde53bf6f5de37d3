"""CPU seconds (user + system, all threads) that processes have used, from /proc: one line per PID, the
process's own and with its live descendants' (API server processes that a parent started, say).

    python lab/proc_cpu.py PID [PID ...]   ->   "PID own_seconds with_descendants_seconds" lines
"""
from __future__ import annotations

import os
import sys


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


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        pid = int(arg)
        own = cpu_seconds(pid)
        print(pid, f"{own:.2f}", f"{own + sum(cpu_seconds(p) for p in descendants(pid)):.2f}")
