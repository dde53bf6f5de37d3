"""What an API server process costs to start: `tokenmill serve MODEL` started RUNS times on the CPU, each
until /health answers and one chat request has streamed back; then the API server process's CPU seconds
(user + system, from /proc), its resident memory, whether it has mapped libtorch, and the seconds from
the command to /health. The engine core is another process and not counted. Linux only.

    python lab/api_server_footprint.py [MODEL] [--runs 3]      # no MODEL: the default (SmolLM2's GGUF)
"""
from __future__ import annotations

import argparse
import json
import os
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


def one_run(model: str | None) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *([model] if model else []), "--port", str(port),
           "--device", "cpu", "--log-level", "warning", "--num-kv-blocks", "128", "--max-model-len", "512"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {proc.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        ready = time.monotonic() - t0
        name = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                           "stream": True}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{proc.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
        with open(f"/proc/{proc.pid}/maps") as f:
            torch = "libtorch" in f.read()
        return dict(ready_s=ready, cpu_s=cpu, rss_mb=rss, torch=torch)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs = [one_run(args.model) for _ in range(args.runs)]
    print("| model | runs | ready s (median) | API server CPU s (median) | resident MB (median) | libtorch mapped |")
    print("|---|---|---|---|---|---|")
    med = {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "cpu_s", "rss_mb")}
    print(f"| {args.model or 'default'} | {len(runs)} | {med['ready_s']:.2f} | {med['cpu_s']:.2f} | "
          f"{med['rss_mb']:.0f} | {sum(r['torch'] for r in runs)} of {len(runs)} |")


if __name__ == "__main__":
    main()
