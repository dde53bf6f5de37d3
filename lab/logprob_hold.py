"""What a request's logprobs cost the API server's event loop in the output processor, in process: a
4,000-token prompt's logprobs with 20 alternatives taken from one core report, and n = 128 x 200 tokens
x 21 entries taken over 200 reports, then a full garbage collection while that request is held (what
every full collection of the server walks; the server freezes its start-up objects, so compare the
collection against the one before the request).

    PYTHONPATH=src python lab/logprob_hold.py
"""
from __future__ import annotations

import gc
import os
import random
import time

import numpy as np

import tokenmill
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.step_outputs import StepOutputs
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams


def main() -> None:
    tok = Tokenizer(os.path.join(os.path.dirname(tokenmill.__file__), "assets/tiny"))
    vocab, rng = 4000, random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(4000)]
    raw = [None] + [(-rng.random(), rng.randrange(1, 50), [rng.randrange(vocab) for _ in range(20)],
                     sorted((-rng.random() for _ in range(20)), reverse=True)) for _ in range(len(prompt) - 1)]
    times = []
    for _ in range(3):          # the first fills the token texts' memo
        processor = OutputProcessor(tok)
        processor.add(1, "p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=20))
        t0 = time.perf_counter()
        processor.process(StepOutputs(prompt_logprobs=[(1, raw)]), 0.0)
        times.append(time.perf_counter() - t0)
    print(f"prompt logprobs, 4,000 tokens x 21: {min(times) * 1e3:.1f} ms of process()")

    gc.collect()
    t0 = time.perf_counter()
    gc.collect()
    print(f"full collection, no request held: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    n, tokens, k = 128, 200, 20
    processor = OutputProcessor(tok)
    processor.add(2, "n", [1, 2, 3], SamplingParams(n=n, max_tokens=tokens, logprobs=k, ignore_eos=True))
    spent = 0.0
    for _ in range(tokens):
        rows = {j: ([-rng.random() for _ in range(k + 1)], [rng.randrange(vocab) for _ in range(k + 1)],
                    rng.randrange(1, 30)) for j in range(n)}
        step = StepOutputs(np.full(n, 2, np.int64), np.arange(n, dtype=np.int32),
                           np.array([rng.randrange(vocab) for _ in range(n)], np.int64), logprobs=rows)
        t0 = time.perf_counter()
        processor.process(step, 0.0)
        spent += time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    print(f"n = {n} x {tokens} tokens x {k + 1}: {spent * 1e3:.0f} ms of process() over {tokens} reports; "
          f"full collection while held {min(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
