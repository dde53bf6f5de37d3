"""Engine factories for `tokenmill serve --api-server-count N` that look, while the core loads, for the API
server processes its parent spawned. Nothing here imports torch: a core that only fails starts in a second."""
from __future__ import annotations

import os
import sys
import time
import urllib.request


def api_servers_beside(want: int = 2, timeout: float = 10.0) -> list[int]:
    """From an engine core of `tokenmill serve --api-server-count N`: the pids of the processes that its
    parent spawned beside it (the API servers; not the resource tracker), waiting up to `timeout` for `want`."""
    deadline = time.monotonic() + timeout
    while True:
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    spawned = b"spawn_main" in f.read()
            except (OSError, ValueError):
                continue                   # gone meanwhile
            if ppid == os.getppid() and spawned:
                pids.append(int(entry))
        if len(pids) >= want or time.monotonic() > deadline:
            return sorted(pids)
        time.sleep(0.02)


def _idle(pids: list[int], timeout: float) -> None:
    """Waits (up to `timeout`) until the processes `pids` sleep and have used no CPU for 0.3 s: done with
    their start, waiting for this core."""
    def cpu(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])
    deadline = time.monotonic() + timeout
    before = [cpu(p) for p in pids]
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = [cpu(p) for p in pids]
        if now == before and all(state == "S" for state, _ in now):
            return
        before = now


def _listening_port(pids: list[int]) -> int:
    """The TCP port on which the processes `pids` hold a listening socket."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:         # LISTEN
                    return int(fields[1].rsplit(":", 1)[1], 16)
    raise AssertionError(f"processes {pids} hold no listening socket")


def make(config):
    """slow_engine's `make`, once the API server processes run (at most 10 s later) and have finished their
    start (at most 10 s more): says on stderr which ran while this core was loading, and what /health
    answered them meanwhile."""
    from slow_engine import make        # torch, imported while the API servers import theirs
    pids = api_servers_beside()
    _idle(pids, 10.0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{_listening_port(pids)}/health", timeout=0.5) as r:
            health = f"status {r.status}"
    except OSError as e:              # an HTTP error status, no answer in time, a refused connection
        health = f"no answer ({type(e).__name__})"
    print(f"engine core loading beside API server processes {pids}; /health: {health}", file=sys.stderr,
          flush=True)
    return make(config)


def fail(config):
    """A core that fails to load once the API server processes run (at most 10 s later), naming them."""
    raise ValueError(f"cannot load the model (API server processes {api_servers_beside()} were starting)")
