"""The CPU's decode attention in groups that fit the cache (`attention._decode_chunks`) against the batch
attended at once (DECODE_CHUNK_BYTES past any batch), one thread.

    PYTHONPATH=src python lab/cpu_decode_groups.py            # `paged_attention_torch`, the bundled model's heads
    PYTHONPATH=src python lab/cpu_decode_groups.py --engine   # the offline engine, 32 prompts, 128 tokens out

Prints a markdown row per case: medians of three interleaved turns (ms a call), or each turn's seconds.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tokenmill.layers import attention as A

ONE_BATCH = 1 << 60


def timed(f, n: int = 20) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def batch(num: int, lo: int, hi: int, hq: int = 6, hkv: int = 2, d: int = 64, bs: int = 16):
    """`num` decodes of lo-hi positions over a scattered paged float32 cache."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (num,), generator=g)
    blocks = [-(-n // bs) for n in lens.tolist()]
    perm = torch.randperm(sum(blocks) + 4, generator=g)
    table = torch.zeros(num, max(blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used:used + n].int()
        used += n
    k, v = (torch.randn(len(perm), bs, hkv, d, generator=g) for _ in range(2))
    return torch.randn(num, hq, d, generator=g), k, v, table, lens.int(), torch.arange(num + 1, dtype=torch.int32)


def attention_cases() -> None:
    shipped = A.DECODE_CHUNK_BYTES
    print("| decodes | contexts | one batch | groups | ratio |\n|---|---|---|---|---|")
    for num, lo, hi in ((4, 100, 380), (16, 100, 380), (32, 100, 380), (32, 160, 224), (64, 100, 380)):
        args = batch(num, lo, hi)
        f = lambda: A.paged_attention_torch(*args, 0.125)     # noqa: E731
        one, groups = [], []
        for _ in range(3):
            A.DECODE_CHUNK_BYTES = ONE_BATCH
            one.append(timed(f))
            A.DECODE_CHUNK_BYTES = shipped
            groups.append(timed(f))
        o, n = statistics.median(one), statistics.median(groups)
        print(f"| {num} | {lo}-{hi} | {o:.2f} | {n:.2f} | {o / n:.2f}x |", flush=True)


def engine_turns() -> None:
    from tokenmill import LLM, SamplingParams
    llm = LLM("src/tokenmill/assets/tiny", device="cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(rng.randint(64, 256))] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4))
    shipped = A.DECODE_CHUNK_BYTES
    for label, budget in (("one batch", ONE_BATCH), ("groups", shipped)) * 2:
        A.DECODE_CHUNK_BYTES = budget
        t = time.perf_counter()
        llm.generate(prompts, params)
        print(f"{label}: {time.perf_counter() - t:.2f} s", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--engine", action="store_true")
    torch.set_num_threads(1)
    engine_turns() if p.parse_args().engine else attention_cases()
