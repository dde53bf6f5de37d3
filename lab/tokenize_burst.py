"""The API server's tokenization under a burst: N chat requests arriving at once through
`PromptTokenizer.render_chat` (the chat template, then the prompt's encoding, off the event loop), with mixed-chat's
prompts and the benchmark tokenizer of a preset's vocabulary (what `profile_serve.sh` serves). Prints the
time until every request has its ids and the mean and largest wait of one request, per burst size.

    PYTHONPATH=src python lab/tokenize_burst.py [--sizes 64,256,512] [--rounds 5] [--label TREE]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64,256,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--label", default="tree")
    args = p.parse_args()
    from tokenmill.bench.serve_datasets import mixed_chat_requests, write_tokenizer_dir
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.server.prompts import PromptTokenizer
    cfg = {"vocab_size": 151936, "eos_token_id": 151645, "bos_token_id": None}
    tok = Tokenizer(write_tokenizer_dir(tempfile.mkdtemp(), 151936, cfg))
    prompts = PromptTokenizer(tok, 40960)

    async def one(text: str) -> float:
        t0 = time.perf_counter()
        await prompts.render_chat([{"role": "user", "content": text}], True)
        return time.perf_counter() - t0

    async def burst(texts: list[str]) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        waits = await asyncio.gather(*(one(t) for t in texts))
        return time.perf_counter() - t0, waits

    for n in (int(s) for s in args.sizes.split(",")):
        texts = [r.prompt for r in mixed_chat_requests(n, 11)]
        asyncio.run(burst(texts))                      # warm-up
        rows = [asyncio.run(burst(texts)) for _ in range(args.rounds)]
        total = statistics.median(r[0] for r in rows) * 1e3
        mean = statistics.median(statistics.mean(r[1]) for r in rows) * 1e3
        worst = statistics.median(max(r[1]) for r in rows) * 1e3
        print(f"| {args.label} | {n} | {total:.1f} | {mean:.1f} | {worst:.1f} |", flush=True)


if __name__ == "__main__":
    main()
