"""Seconds from spawning `tokenmill serve MODEL ...` to its first 200 of /health, source trees in turns
(one start of each tree per round, so that a machine's load falls on all alike), and the CPU seconds of
the whole process tree (server, engine core, API servers) until it has exited; each start on stderr as it
ends, with the machine's load average. Linux only.

    python lab/serve_start_time.py --trees OLD/src src --runs 3 -- src/tokenmill/assets/tiny
    python lab/serve_start_time.py --trees OLD/src src --runs 3 -- src/tokenmill/assets/tiny --api-server-count 2
    python lab/serve_start_time.py --trees OLD/src src --runs 3 -- preset:qwen3-4b --device cuda   # GPU machine

The CPU unless the flags name a --device.
"""
from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(tree: str, serve_args: list[str]) -> tuple[float, float]:
    port = free_port()
    # the tree first, then what PYTHONPATH held (the GPU machine's server wheels)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(tree),
                                                                     os.environ.get("PYTHONPATH")])))
    device = [] if "--device" in serve_args else ["--device", "cpu"]
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *serve_args, "--port", str(port), *device,
           "--log-level", "warning"]
    cpu0, t0 = children_cpu(), time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.01)
        ready = time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return ready, children_cpu() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", required=True, help="source directories (each holding tokenmill/)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the model and serve's flags")
    args = ap.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    results: dict[str, list[tuple[float, float]]] = {tree: [] for tree in args.trees}
    for _ in range(args.runs):
        for tree in args.trees:
            results[tree].append(one_start(tree, serve_args))
            ready, cpu = results[tree][-1]
            print(f"{tree}: {ready:.2f} s to /health, {cpu:.2f} CPU s (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
    print(f"serve {' '.join(serve_args)}: {args.runs} starts a tree")
    print("| tree | to /health s, best | median | CPU s of all its processes, median |")
    print("|---|---|---|---|")
    for tree, runs in results.items():
        ready = [r for r, _ in runs]
        print(f"| {tree} | {min(ready):.2f} | {statistics.median(ready):.2f} | "
              f"{statistics.median(c for _, c in runs):.2f} |")


if __name__ == "__main__":
    main()
