"""What a short chat prompt's trip to the tokenizer costs while the event loop streams: the API server's
`PromptTokenizer` (a thread of this process) against a tokenizer process of its own (its own interpreter
lock; texts and ids pickled over a pipe the loop watches). A uvloop loop is kept busy as a streaming API
server keeps it: every STEP_MS a callback holds the interpreter BUSY_MS (the outputs of one engine step),
and a chat of `--words` words arrives every `--every-ms` ms; each chat's wait from its arrival to its ids is
recorded. Run from the repository root on a CPU machine:

    PYTHONPATH=src python lab/tokenizer_trip_bench.py [--busy-ms 3.5] [--step-ms 8] [--every-ms 26] [--requests 400]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import time

import uvloop

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.server.prompts import PromptTokenizer

MODEL = os.path.join(os.path.dirname(__file__), "..", "src", "tokenmill", "assets", "tiny")


def _tokenizer_process(conn, path: str) -> None:
    tokenizer = Tokenizer(path)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        key, messages = msg
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        conn.send((key, text, tokenizer.encode_batch([text], False)[0]))


class ProcessTokenizer:
    def __init__(self, path: str):
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_tokenizer_process, args=(child, path), daemon=True)
        self.proc.start()
        self.waiting: dict[int, asyncio.Future] = {}
        self.keys = 0

    def attach(self, loop) -> None:
        loop.add_reader(self.conn.fileno(), self._readable)

    def _readable(self) -> None:
        while self.conn.poll():
            key, text, ids = self.conn.recv()
            self.waiting.pop(key).set_result((text, ids))

    async def render_chat(self, messages, add_generation_prompt=True):
        self.keys += 1
        done = asyncio.get_running_loop().create_future()
        self.waiting[self.keys] = done
        self.conn.send((self.keys, messages))
        return await done

    def close(self, loop) -> None:
        loop.remove_reader(self.conn.fileno())
        self.conn.send(None)
        self.proc.join(5)


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def run(kind: str, args) -> list[float]:
    loop = asyncio.get_running_loop()
    if kind == "thread":
        tok = PromptTokenizer(Tokenizer(MODEL), 4096)
    else:
        tok = ProcessTokenizer(MODEL)
        tok.attach(loop)
        await tok.render_chat([{"role": "user", "content": "warm up"}])
    stop = False

    async def streaming():
        while not stop:
            _burn(args.busy_ms / 1e3)
            await asyncio.sleep(max(0.0, (args.step_ms - args.busy_ms) / 1e3))
    streamer = asyncio.ensure_future(streaming())
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "walrus", "token", "mill", "serve"]
    waits: list[float] = []

    async def one():
        text = " ".join(rng.choice(words) for _ in range(args.words))
        start = time.perf_counter()
        await tok.render_chat([{"role": "user", "content": text}], True)
        waits.append(time.perf_counter() - start)
    tasks = []
    for _ in range(args.requests):
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(rng.expovariate(1e3 / args.every_ms))
    await asyncio.gather(*tasks)
    stop = True
    await streamer
    if kind == "process":
        tok.close(loop)
    return waits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--busy-ms", type=float, default=3.5)
    p.add_argument("--step-ms", type=float, default=8.0)
    p.add_argument("--every-ms", type=float, default=26.0)
    p.add_argument("--words", type=int, default=150)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print("| tokenizer | round | wait p50 ms | p90 | max |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        for kind in ("thread", "process"):
            w = sorted(uvloop.run(run(kind, args)))
            print(f"| {kind} | {r + 1} | {statistics.median(w) * 1e3:.2f} | {w[int(len(w) * 0.9)] * 1e3:.2f} | "
                  f"{w[-1] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
