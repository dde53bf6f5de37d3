"""What a fresh engine's first large burst of prompts pays once: three bursts of 62 different mixed-chat
prompts (one token out each) on a new engine with an empty Triton cache, each timed, with the Triton
kernels compiled during it (new entries in the cache) and the steps that ran eagerly.

    TRITON_CACHE_DIR=$(mktemp -d) python lab/first_burst.py preset:qwen3-4b quantization=fp8 kv_cache_dtype=fp8
"""
from __future__ import annotations

import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from concurrency_sim import chat_prompts  # noqa: E402


def cache_kernels(root: str) -> set[str]:
    return {os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "*", "*.json"))
            if not os.path.basename(p).startswith("__grp__")}


def main() -> None:
    import torch
    from tokenmill import LLM, SamplingParams
    from tokenmill.models.presets import resolve_model_path
    model, *engine_args = sys.argv[1:]
    extra = {k: (int(v) if v.isdigit() else v) for k, v in (a.split("=", 1) for a in engine_args)}
    path = resolve_model_path(model)
    root = os.environ["TRITON_CACHE_DIR"]
    prompts = [p for p in chat_prompts(path, 62 * 4) if len(p[0]) < 2000][:62 * 3]
    t0 = time.perf_counter()
    llm = LLM(path, max_num_seqs=256, **extra)
    print(f"engine built in {time.perf_counter() - t0:.1f} s; {len(cache_kernels(root))} kernels in the cache")
    runner = llm.engine.runner
    eager = []
    forward = runner._eager_forward

    def counted(inp, *a, **k):
        eager.append(len(inp.input_ids))
        return forward(inp, *a, **k)
    runner._eager_forward = counted
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for burst in range(3):
        ids = [{"prompt_token_ids": p} for p, _ in prompts[62 * burst:62 * (burst + 1)]]
        before, eager[:] = cache_kernels(root), []
        sync()
        t = time.perf_counter()
        llm.generate(ids, params)
        sync()
        dt = time.perf_counter() - t
        new = sorted(cache_kernels(root) - before)
        print(f"burst {burst}: {sum(len(p['prompt_token_ids']) for p in ids)} prompt tokens in {dt * 1e3:.0f} ms, "
              f"eager steps of {eager} tokens, {len(new)} kernels compiled: {[os.path.basename(n) for n in new]}")


if __name__ == "__main__":
    main()
