"""What a closed loop of C clients allows: the steps a `tokenmill bench serve --max-concurrency C` run of
mixed-chat must take, whatever the engine, and the mean step time a req/s figure then asks for.

    python lab/closed_loop_bound.py [--levels 64,256] [--num-prompts 512] [--targets 64:90,256:150]

Each of C clients sends its next request when its last one ends, and a request of max_tokens L (the
benchmark sets ignore_eos) takes L steps: its prefill step, which samples its first token, then L - 1
decode steps. With every request admitted at once (max_num_seqs >= C) the run takes as many steps as its
busiest client's requests add up to, and the mean sequences a step is the tokens over those steps: the
tail, where clients with shorter requests have finished, keeps that mean below C. req/s is then
num_prompts / (steps x mean step time).
"""
from __future__ import annotations

import argparse
import heapq

from tokenmill.bench.serve_datasets import mixed_chat_requests


def closed_loop(output_lens: list[int], concurrency: int) -> tuple[int, float]:
    """(steps, mean sequences a step) of requests of these output lengths sent in order by
    `concurrency` clients, each taking the next as its last ends."""
    clients = [(0, i) for i in range(concurrency)]
    end = busy = 0
    for n in output_lens:
        free_at, i = heapq.heappop(clients)
        heapq.heappush(clients, (free_at + n, i))
        end, busy = max(end, free_at + n), busy + n
    return end, busy / end


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--levels", default="64,256")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--targets", default="64:90,256:150", help="C:req/s pairs to turn into a mean step time")
    args = p.parse_args()
    lens = [r.max_tokens for r in mixed_chat_requests(args.num_prompts)]
    targets = dict(tuple(map(float, t.split(":"))) for t in args.targets.split(",") if t)
    print("| C | steps | sequences a step | of C | mean step for the target |")
    print("|---|---|---|---|---|")
    for c in map(int, args.levels.split(",")):
        steps, rows = closed_loop(lens, c)
        need = (f"{targets[c]:g} req/s: {1e3 * args.num_prompts / targets[c] / steps:.2f} ms"
                if c in targets else "-")
        print(f"| {c} | {steps} | {rows:.1f} | {rows / c:.1%} | {need} |")


if __name__ == "__main__":
    main()
