"""The API server's and engine core's resident memory over rounds of mixed requests, on the serving path
alone (`lab/fake_engine.py`): completions and chat, streamed and not, with and without logprobs, batches
of prompts, Responses (stored unless STORE=0), /tokenize, and a share of streaming clients that leave
after their first line. A leak shows as RSS that grows every round; the Responses store grows up to its
bound (server/response_store.py, 256 MB). Run from the repository root on a CPU machine:

    python lab/soak_rss.py [ROUNDS=10] [REQUESTS=2000] [CONCURRENCY=64]

MODEL=path serves that model with the real engine on the CPU instead, with SERVER_ARGS (e.g. a small KV
cache, to preempt), and each round also prints the KV blocks free after it and the preemptions so far; the
batches of prompts then ask for n=3 (the fake engine gives one sequence a request).
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) // 1024


def request(rng: random.Random, store: bool, n_best: int = 1) -> tuple[str, dict]:
    words = ["alpha", "beta", "gamma", "delta", "x" * rng.randrange(1, 50)]
    text = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 80)))
    n, stream, kind = rng.randrange(4, 40), rng.random() < 0.5, rng.randrange(6)
    if kind == 0:
        return "/v1/completions", {"prompt": text, "max_tokens": n, "stream": stream, "logprobs": rng.choice([None, 3])}
    if kind == 1:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": n,
                                        "stream": stream, "logprobs": rng.random() < 0.3}
    if kind == 2:
        return "/v1/responses", {"input": text, "max_output_tokens": n, "stream": stream, "store": store}
    if kind == 3:
        return "/v1/completions", {"prompt": [text, text[:20]], "max_tokens": n, "n": n_best, "stop": ["zz"]}
    if kind == 4:
        return "/tokenize", {"prompt": text}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": n, "stream": True}


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, store: bool, n_best: int):
    path, body = request(rng, store, n_best)
    body["model"] = "tiny"
    try:
        if body.get("stream") and rng.random() < 0.3:          # a client that leaves mid-stream
            async with client.stream("POST", url + path, json=body) as r:
                async for _ in r.aiter_lines():
                    break
            return "left"
        return (await client.post(url + path, json=body)).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


async def round_of(url: str, rng: random.Random, requests: int, concurrency: int, store: bool,
                   n_best: int) -> Counter:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def go():
            async with gate:
                return await one(client, url, rng, store, n_best)
        return Counter(await asyncio.gather(*(go() for _ in range(requests))))


def main(rounds: int, requests: int, concurrency: int) -> None:
    store = os.environ.get("STORE", "1") != "0"
    model = os.environ.get("MODEL")
    env = dict(os.environ, FAKE_STEP_MS=os.environ.get("FAKE_STEP_MS", "1"), PYTHONPATH=f"{ROOT}/lab:{ROOT}/src")
    engine = ["--device", "cpu", *shlex.split(os.environ.get("SERVER_ARGS", ""))] if model else \
        ["--engine-factory", "fake_engine:make"]
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", model or f"{ROOT}/src/tokenmill/assets/tiny",
                               "--port", "0", "--log-level", "warning", "--served-model-name", "tiny", *engine],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in server.stdout:
            m = re.search(r"on (http://[\d.]+:\d+) \(engine pid (\d+)\)", line)
            if m:
                url, core = m.group(1), int(m.group(2))
                break
        else:
            raise RuntimeError("the server did not start")
        rng, start = random.Random(0), time.monotonic()
        for i in range(rounds):
            answers = asyncio.run(round_of(url, rng, requests, concurrency, store, 3 if model else 1))
            metrics = httpx.get(url + "/metrics").text

            def metric(name):
                found = re.search(rf"tokenmill:{name}\{{[^}}]*\}} (\S+)", metrics)
                return found.group(1) if found else "?"
            blocks = (f", KV blocks free {metric('num_free_blocks')} of {metric('num_total_blocks')}, preemptions "
                      f"{metric('num_preemptions_total')}") if model else ""
            print(f"round {i}: {time.monotonic() - start:.0f} s, API server RSS {rss_mb(server.pid)} MB, engine core "
                  f"RSS {rss_mb(core)} MB, running {metric('num_requests_running')}{blocks}, answers {dict(answers)}",
                  flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [10, 2000, 64][len(args):]))
