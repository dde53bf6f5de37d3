"""The scheduler alone at a fixed concurrency, with and without trimming steps to the graph below them
(`engine/step_fit.py`): the rows a step computes (its tokens padded to its CUDA graph), with no model.

    PYTHONPATH=src python lab/step_padding.py [--levels 64,256] [--num-prompts 512]

Requests are mixed-chat's (seed 0) as the chat template tokenizes them with the benchmark's offline
tokenizer of qwen3-4b's vocabulary (`write_tokenizer_dir`); every request generates its max_tokens. The
graphs' sizes are those of the default engine (256 seats, graphs up to 2,048 tokens, budget 8,192). Prints,
per level and side: steps, mean tokens a step, mean rows computed (padded), padding share, requests whose
first token in steps from its arrival (mean, p99), and rows computed in all against the untrimmed side.
"""
from __future__ import annotations

import argparse
import tempfile

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.runner.cuda_graphs import CudaGraphRunner, MixedSizes
from tokenmill.sampling_params import SamplingParams


def prompts(num: int) -> list[tuple[int, int]]:
    from transformers import AutoTokenizer
    from tokenmill.bench.serve_datasets import mixed_chat_requests, write_tokenizer_dir
    tok = AutoTokenizer.from_pretrained(write_tokenizer_dir(tempfile.mkdtemp(), 151936))
    out = []
    for r in mixed_chat_requests(num):
        text = tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True,
                                       tokenize=False)
        out.append((len(tok(text)["input_ids"]), r.max_tokens))
    return out


def sizes(max_num_seqs: int = 256) -> MixedSizes:
    class Config:
        cuda_graph_max_tokens, max_num_batched_tokens = 2048, 8192
    g = CudaGraphRunner.__new__(CudaGraphRunner)
    g.max_num_seqs, g.config = max_num_seqs, Config
    keys = [k for k in g._keys() if k[0] == "mixed"]
    return MixedSizes(tuple(sorted({k[1] for k in keys})), tuple(sorted({k[2] for k in keys})))


def run(reqs: list[tuple[int, int]], concurrency: int, trim: bool) -> dict:
    sched = Scheduler(BlockManager(40000, 16), 256, 8192, 32768)
    mixed = sizes()
    sched.step_sizes = mixed if trim else None
    todo = list(enumerate(reqs))
    live, arrived, ttft, steps, tokens, rows = 0, {}, [], 0, 0, 0
    while todo or sched.has_unfinished():
        while todo and live < concurrency:
            i, (n_in, n_out) = todo.pop(0)
            sched.add(Request(str(i), [10 + (i * 7919 + j) % 100000 for j in range(n_in)], SamplingParams(max_tokens=n_out), n_out, seed=0))
            arrived[str(i)] = steps
            live += 1
        out = sched.schedule()
        steps += 1
        t, s = out.total_tokens, len(out.requests)
        tokens += t
        decode = all(n == 1 for n in out.num_new_tokens)
        padded = None if decode else mixed.padded(t, s)
        rows += t if decode or padded is None else padded[0]
        sched.update_after_step(out)
        for req in out.requests:
            if req.num_computed_tokens == req.num_tokens:
                if req.num_output_tokens == 0:
                    ttft.append(steps - arrived[req.request_id])
                req.append_token(3)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    live -= 1
    return dict(steps=steps, tokens=tokens, rows=rows, ttft=sorted(ttft))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--levels", default="64,256")
    p.add_argument("--num-prompts", type=int, default=512)
    args = p.parse_args()
    reqs = prompts(args.num_prompts)
    print("| C | side | steps | tokens/step | rows/step | padding | first token, steps: mean / p99 | rows vs untrimmed |")
    print("|---|---|---|---|---|---|---|---|")
    for c in [int(x) for x in args.levels.split(",")]:
        base = run(reqs, c, False)
        for side, r in (("untrimmed", base), ("trimmed", run(reqs, c, True))):
            t = r["ttft"]
            print(f"| {c} | {side} | {r['steps']} | {r['tokens'] / r['steps']:.1f} | {r['rows'] / r['steps']:.1f} | "
                  f"{1 - r['tokens'] / r['rows']:.1%} | {sum(t) / len(t):.2f} / {t[int(0.99 * len(t))]} | {r['rows'] / base['rows']:.3f} |")


if __name__ == "__main__":
    main()
