"""The preparation of a Responses request under truncation "auto" whose conversation is just past the context, in
process, on the bundled tiny model's tokenizer and context (2,048 tokens): the whole `prepare` (bisection over the
items dropped: render, encode and check at each step) and the part of it spent building sampling parameters, for a
plain conversation, one whose 50 tools are forced (tool_choice "required": a grammar), and one with a json_schema
text.format.

    PYTHONPATH=src python lab/truncation_prepare.py
"""
from __future__ import annotations

import asyncio
import os
import statistics
import time

import tokenmill
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.server.protocol.responses import ResponsesRequest
from tokenmill.server.responses import prepare
from tokenmill.server.serving import Serving

TINY = os.path.join(os.path.dirname(tokenmill.__file__), "assets/tiny")


class Engine:
    model_name, max_model_len, dead, on_output = "tiny", 2048, False, None

    def __init__(self):
        self.tokenizer = Tokenizer(TINY)


def conversation(items: int) -> list[dict]:
    # ~21 tokens an item on this tokenizer: `items` past ~100 is past the context
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"turn {i}: the quick brown fox jumps over the lazy dog again"} for i in range(items)]


TOOLS = [{"type": "function", "name": f"tool_{i}", "description": "a tool",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}} for i in range(50)]
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(50)}}


async def measure(serving: Serving, body: dict, runs: int) -> tuple[float, float, int, int]:
    builds, spent = 0, 0.0
    params = serving.params

    async def counted(*args, **kwargs):
        nonlocal builds, spent
        builds += 1
        t0 = time.perf_counter()
        try:
            return await params(*args, **kwargs)
        finally:
            spent += time.perf_counter() - t0
    serving.params = counted
    req = ResponsesRequest.model_validate(body)
    totals, in_params = [], []
    for _ in range(runs):
        builds, spent = 0, 0.0
        t0 = time.perf_counter()
        chat, _, prompt, _ = await prepare(serving, req, [])
        totals.append(time.perf_counter() - t0)
        in_params.append(spent)
    serving.params = params
    return statistics.median(totals), statistics.median(in_params), builds, len(prompt)


async def main() -> None:
    serving = Serving(Engine(), ["tiny"], 1024)
    base = {"input": conversation(120), "max_output_tokens": 16, "truncation": "auto", "temperature": 0}
    cases = {"plain": base,
             "50 tools, required": {**base, "tools": TOOLS, "tool_choice": "required"},
             "json_schema (50 fields)": {**base, "text": {"format": {"type": "json_schema", "name": "x",
                                                                      "schema": SCHEMA}}}}
    for name, body in cases.items():
        await measure(serving, body, 3)           # warm: the tokenizer's and the grammar's caches
        total, params, builds, prompt = await measure(serving, body, 30)
        print(f"{name:>26}: prepare {total * 1e3:6.2f} ms, of which params {params * 1e3:5.2f} ms "
              f"({builds} builds); prompt {prompt} tokens")


if __name__ == "__main__":
    asyncio.run(main())
