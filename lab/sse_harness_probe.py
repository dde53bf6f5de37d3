"""What the HTTP path alone does to ITL: a fake OpenAI chat server (FastAPI, uvicorn with uvloop and
httptools, orjson, as `tokenmill serve` runs) streams every request's tokens at exactly `--interval` apart,
and `tokenmill bench serve`'s own client (`run_level`) reads them at each concurrency. Any ITL beyond the
interval is the server process's and the client's, not an engine's.

    PYTHONPATH=src python lab/sse_harness_probe.py [--interval 0.010] [--tokens 100] [--levels 64,256,512]
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

SERVER = r'''
import asyncio, sys, orjson, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
port, interval, tokens = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
app = FastAPI()

@app.post("/v1/chat/completions")
async def chat(req: Request):
    await req.body()
    async def gen():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(tokens):
            await asyncio.sleep(max(0.0, t0 + i * interval - loop.time()))
            yield b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}) + b"\n\n"
        yield b"data: " + orjson.dumps({"choices": [], "usage": {"prompt_tokens": 1,
                                                                  "completion_tokens": tokens}}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")
'''


def main() -> int:
    import numpy as np

    from tokenmill.bench.serve_levels import run_level
    from tokenmill.bench.serve_datasets import ServeRequest

    p = argparse.ArgumentParser()
    p.add_argument("--interval", type=float, default=0.010)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--levels", default="64,256,512")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(a.interval), str(a.tokens)])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        print(f"tokens {a.interval * 1000:.1f} ms apart, {a.tokens} per request")
        print("| concurrency | ok | tokens/s | ITL p50 ms | ITL p95 | ITL p99 |\n|---|---|---|---|---|---|")
        for c in map(int, a.levels.split(",")):
            reqs = [ServeRequest("hi", a.tokens) for _ in range(c)]
            res, dur = asyncio.run(run_level(f"http://127.0.0.1:{port}", "/v1/chat/completions", "m", reqs, c,
                                             progress=False))
            itl = np.concatenate([r.itl for r in res if r.itl]) * 1000
            print(f"| {c} | {sum(r.success for r in res)}/{c} | {sum(r.output_tokens for r in res) / dur:,.0f} | "
                  f"{np.percentile(itl, 50):.1f} | {np.percentile(itl, 95):.1f} | {np.percentile(itl, 99):.1f} |")
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
