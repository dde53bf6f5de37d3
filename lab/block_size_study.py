"""Block-size study: output tok/s and KV waste of one block size on the offline workloads of `tokenmill
bench throughput` (random token ids, eos ignored, greedy, the engine's default flags).

    python lab/block_size_study.py run --model DIR --block-size 64 --output RESULT.json
    python lab/block_size_study.py summary RESULT.json ...        (the markdown table)

Workloads: `default` (NUM_PROMPTS requests, 100-1,024 in and out, as `bench throughput`) and `long`
(64 requests, 6,000-8,000 in, 64-256 out). One process per block size: Triton compiles the attention
kernels for each page size, and the KV cache is allocated once at start-up.

KV waste: the slots reserved in partly filled blocks against the tokens whose K/V is stored.
- computed, from the workload's lengths: a request of L = prompt + output tokens stores L - 1 (the last
  sampled token is never fed back); at its longest it holds ceil((L - 1) / B) blocks ("final"); over its
  life, each decode step n (prompt_len <= n <= L - 1 stored) holds ceil(n / B) ("life", slack summed over
  those steps against tokens summed over them).
- measured, from the block manager after every engine step of the timed run: blocks in use x B against
  the running requests' num_computed_tokens, summed over steps ("mean"), and at the step with the most
  blocks in use ("peak"). Reading these is a sum over the running requests per step, next to a step of
  milliseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

WORKLOADS = ("default", "long")


def computed_waste(lengths: list[tuple[int, int]], block_size: int) -> dict:
    """`lengths`: (prompt, output) tokens per request."""
    final_slack = final_tokens = life_slack = life_tokens = 0
    for prompt, output in lengths:
        stored = prompt + output - 1
        final_tokens += stored
        final_slack += -(-stored // block_size) * block_size - stored
        for n in range(prompt, stored + 1):
            life_tokens += n
            life_slack += -(-n // block_size) * block_size - n
    return {"computed_final_waste": final_slack / final_tokens, "computed_life_waste": life_slack / life_tokens,
            "computed_final_slack_tokens": final_slack, "computed_final_stored_tokens": final_tokens}


def run(args) -> int:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import parse_range, random_requests, special_token_ids

    with open(os.path.join(args.model, "config.json")) as f:
        hf_config = json.load(f)
    llm = LLM(model=args.model, block_size=args.block_size, device=args.device, dtype=args.dtype,
              max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, seed=0)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[1] * 16, [2] * 24], warm, use_tqdm=False)
    engine, bm = llm.engine, llm.engine.block_manager
    step = engine.step
    sample = {}

    def sampled_step():
        out = step()
        reserved = bm.num_used_blocks * args.block_size
        stored = sum(r.num_computed_tokens for r in engine.scheduler.running)
        sample["reserved"] += reserved
        sample["stored"] += stored
        if reserved > sample["peak_reserved"]:
            sample["peak_reserved"], sample["peak_stored"] = reserved, stored
        return out

    engine.step = sampled_step
    result = {"block_size": args.block_size, "num_total_blocks": bm.num_blocks, "workloads": {}}
    for name in args.workloads.split(","):
        n, in_range, out_range = ((args.num_prompts, args.input_len_range, args.output_len_range) if name == "default"
                                  else (args.long_prompts, args.long_input_len_range, args.long_output_len_range))
        requests = random_requests(n, parse_range(in_range), parse_range(out_range), hf_config["vocab_size"], special_token_ids(hf_config),
                                   args.seed)
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        sample.update(reserved=0, stored=0, peak_reserved=0, peak_stored=0)
        preemptions = engine.scheduler.num_preemptions
        t0 = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        lengths = [(r.prompt_len, r.output_len) for r in requests]
        result["workloads"][name] = {
            "num_requests": n, "prompt_tokens": sum(p for p, _ in lengths), "output_tokens": out_tokens,
            "requested_output_tokens": sum(o for _, o in lengths), "elapsed_s": elapsed,
            "output_tok_s": out_tokens / elapsed, "num_preemptions": engine.scheduler.num_preemptions - preemptions,
            "measured_mean_waste": (sample["reserved"] - sample["stored"]) / max(sample["stored"], 1),
            "measured_peak_waste": (sample["peak_reserved"] - sample["peak_stored"]) / max(sample["peak_stored"], 1),
            "measured_peak_reserved_tokens": sample["peak_reserved"],
            **computed_waste(lengths, args.block_size),
        }
        print(f"block {args.block_size} {name}: {out_tokens / elapsed:,.0f} out tok/s in {elapsed:.2f} s",
              file=sys.stderr, flush=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def summary(paths: list[str]) -> str:
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: r["block_size"])
    base = {name: w["output_tok_s"] for r in runs[:1] for name, w in r["workloads"].items()}
    lines = [f"| workload | block size | output tok/s | vs {runs[0]['block_size']} | elapsed s | KV waste computed final | "
             "computed life | measured mean | measured peak | peak reserved tokens | preemptions |",
             "|" + "---|" * 11]
    names = sorted({n for r in runs for n in r["workloads"]}, key=WORKLOADS.index)
    for name in names:
        for r in runs:
            w = r["workloads"].get(name)
            if w is None:
                continue
            lines.append(f"| {name} ({w['num_requests']} req) | {r['block_size']} | {w['output_tok_s']:,.0f} | "
                         f"{w['output_tok_s'] / base[name]:.3f} | {w['elapsed_s']:.2f} | "
                         f"{w['computed_final_waste']:.2%} | {w['computed_life_waste']:.2%} | "
                         f"{w['measured_mean_waste']:.2%} | {w['measured_peak_waste']:.2%} | "
                         f"{w['measured_peak_reserved_tokens']:,} | {w['num_preemptions']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="block-size study (see the module docstring)")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True, help="a model directory (bench prepare gives a preset's)")
    r.add_argument("--block-size", type=int, required=True)
    r.add_argument("--workloads", default="default,long")
    r.add_argument("--num-prompts", type=int, default=256, help="requests of the default workload")
    r.add_argument("--input-len-range", default="100,1024", help="prompt lengths of the default workload")
    r.add_argument("--output-len-range", default="100,1024", help="output lengths of the default workload")
    r.add_argument("--long-prompts", type=int, default=64, help="requests of the long workload")
    r.add_argument("--long-input-len-range", default="6000,8000")
    r.add_argument("--long-output-len-range", default="64,256")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="auto")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    r.add_argument("--max-model-len", type=int, default=None)
    r.add_argument("--num-kv-blocks", type=int, default=None)
    r.add_argument("--output", required=True)
    s = sub.add_parser("summary")
    s.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.command == "run":
        return run(args)
    print(summary(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
