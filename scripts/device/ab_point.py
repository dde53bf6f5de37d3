"""One side of ab_refactor.sh: one engine (the defaults of `tokenmill bench throughput`), then
- batch-1 decode: one 32-token prompt, 128 greedy tokens (ignore_eos), the engine's ms per step (median
  of 3 runs after a warm-up) and the device time of one replay of the ("decode", 1) CUDA graph;
- offline throughput: 256 requests of uniform random ids, 100-1,024 tokens in and 100-1,024 out (seed 0),
  greedy with ignore_eos, in one `generate`: output tokens per second.
Only the public `LLM` API and the runner's `graphs` table, so it runs against older sources too.
Prints one JSON line.

Usage: python scripts/device/ab_point.py MODEL LABEL [NUM_PROMPTS [MAX_LEN]]   (256 and 1024 by default;
smaller for a smoke run on the CPU)
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from tokenmill import LLM, SamplingParams

model, label = sys.argv[1:3]
num_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 256
max_len = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
t0 = time.perf_counter()
llm = LLM(model)
ready_s = time.perf_counter() - t0
greedy = dict(temperature=0.0, ignore_eos=True)

one = SamplingParams(max_tokens=min(128, max_len), **greedy)
prompt = [[100 + j for j in range(32)]]
llm.generate(prompt, one, use_tqdm=False)
steps = []
for _ in range(3):
    sync()
    t = time.perf_counter()
    out = llm.generate(prompt, one, use_tqdm=False)
    steps.append(1e3 * (time.perf_counter() - t) / len(out[0].outputs[0].token_ids))
graphs = getattr(llm.engine.runner, "graphs", {})
graph = graphs.get(("decode", 1)) if isinstance(graphs, dict) else None
replay_ms = float("nan")
if graph is not None:
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 200

rng = np.random.default_rng(0)
vocab = llm.engine.runner.vocab_size
lo = min(100, max_len)
in_lens, out_lens = rng.integers(lo, max_len + 1, size=num_prompts), rng.integers(lo, max_len + 1, size=num_prompts)
prompts = [rng.integers(min(1000, vocab // 4), vocab - min(1000, vocab // 4), size=n).tolist()
           for n in in_lens.tolist()]
params = [SamplingParams(max_tokens=int(n), **greedy) for n in out_lens.tolist()]
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - t
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"model": model.split(":")[-1], "label": label, "ready_s": round(ready_s, 1),
                  "step_ms": sorted(steps)[1], "graph_replay_ms": replay_ms,
                  "output_tok_s": tokens / elapsed, "elapsed_s": elapsed}))
