"""The API server's CPU time per streamed token, on the serving path alone (`lab/fake_engine.py`): one
`tokenmill serve` with the fake engine core, `tokenmill bench serve` against it at each level, and the
API server process's CPU seconds (user + system, from /proc) over each level divided by the tokens it
streamed. Run from the repository root on a CPU machine:

    python lab/fake_serving_cpu.py [LEVELS=64,256] [OUTPUT_TOKENS=200] [REQUESTS_PER_SLOT=4]

SERVER_ARGS adds arguments to `tokenmill serve` (e.g. "--stream-interval 4"). SRC=path serves another tree's src (e.g. `git archive REV src | tar x -C .ab_old`, then SRC=.ab_old/src).
With SPY=prefix, py-spy samples the API server during each level into prefix-cN.txt (collapsed stacks, for
lab/collapsed_top.py); ENDPOINT picks the endpoint (default /v1/chat/completions).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from proc_cpu import cpu_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(levels: list[int], output_tokens: int, per_slot: int, endpoint: str) -> None:
    env = dict(os.environ, FAKE_STEP_MS=os.environ.get("FAKE_STEP_MS", "8"),
               PYTHONPATH=f"{ROOT}/lab:{os.path.abspath(os.environ.get('SRC', f'{ROOT}/src'))}")
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", f"{ROOT}/src/tokenmill/assets/tiny",
                               "--port", "0", "--log-level", "warning", "--engine-factory", "fake_engine:make",
                               *os.environ.get("SERVER_ARGS", "").split()],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in server.stdout:
            m = re.search(r"on (http://[\d.]+:\d+)", line)
            if m:
                url = m.group(1)
                break
        else:
            raise RuntimeError("the server did not start")
        rows = []
        for c in levels:
            spy = None
            if os.environ.get("SPY"):
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--format", "raw", "-r", "200",
                                        "-o", f"{os.environ['SPY']}-c{c}.txt"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                time.sleep(1)
            before = cpu_seconds(server.pid)
            start = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "tokenmill.bench", "serve", "--base-url", url, "--endpoint", endpoint,
                 "--dataset", "random", "--input-len-range", "64:256",
                 "--output-len-range", f"{output_tokens}:{output_tokens}", "--num-prompts", str(c * per_slot),
                 "--max-concurrency", str(c), "--no-progress", "--output-dir", "/tmp/fake-serving-cpu",
                 "--name", f"c{c}"], capture_output=True, text=True, env=env, timeout=600).stdout
            wall = time.monotonic() - start
            spent = cpu_seconds(server.pid) - before
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            row = next((line for line in out.splitlines() if line.startswith("| tokenmill")), "")
            tokens = c * per_slot * output_tokens
            rows.append((c, spent, wall, tokens, row))
        print("| level | API server CPU s | wall s | us of API CPU a token | bench serve's row |")
        print("|---|---|---|---|---|")
        for c, spent, wall, tokens, row in rows:
            print(f"| c{c} | {spent:.2f} | {wall:.1f} | **{spent / tokens * 1e6:.1f}** | {row} |")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([int(x) for x in (args[0] if args else "64,256").split(",")], int(args[1]) if len(args) > 1 else 200,
         int(args[2]) if len(args) > 2 else 4,
         os.environ.get("ENDPOINT", "/v1/chat/completions"))
