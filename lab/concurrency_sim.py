"""The engine core alone at a fixed concurrency: what `tokenmill bench serve` at `--max-concurrency C`
asks of the engine, without HTTP, tokenization or a client.

    PYTHONPATH=src python lab/concurrency_sim.py preset:qwen3-4b --levels 64,256 --num-prompts 512 \
        --out DIR [--profile-levels 64,256] [engine args as key=value]

The requests are mixed-chat's (`bench.serve_datasets.mixed_chat_requests`, seed 0; each level its own) as the chat endpoint
tokenizes them (ChatML through the offline tokenizer of the model's vocabulary), ignore_eos, greedy. Each
level keeps C requests in the engine: a finished one is replaced by the next before the next step. It
reports req/s, output tok/s, the mean sequences, tokens and rows computed (padded to the step's CUDA graph)
per step, the share of steps with prefill tokens; for each of --profile-levels C, one more level at C (its
own prompts) reports the CUDA kernel time per step by kernel, from torch.profiler over 200 steps of its
steady state. Writes DIR/LABEL.json; prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def chat_prompts(model_path: str, num_prompts: int) -> list[tuple[list[int], int]]:
    from transformers import AutoTokenizer
    from tokenmill.bench.serve_datasets import mixed_chat_requests, write_tokenizer_dir
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    tok_dir = write_tokenizer_dir(tempfile.mkdtemp(prefix="sim-tok-"), int(cfg["vocab_size"]), cfg)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for r in mixed_chat_requests(num_prompts):
        text = tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True,
                                       tokenize=False)
        out.append((tok(text)["input_ids"], r.max_tokens))
    return out


def run_level(engine, prompts, concurrency: int, profile_steps: int = 0) -> dict:
    from tokenmill import SamplingParams
    shapes = []
    runner = engine.runner
    execute = runner.execute

    graphs = runner.graph_runner
    replay, replayed, rows_computed = graphs.replay, [], []

    def counted(requests, num_new_tokens, *args, **kwargs):
        shapes.append((len(requests), sum(num_new_tokens)))
        before = len(replayed)
        launched = execute(requests, num_new_tokens, *args, **kwargs)
        # the rows the step computed: its graph's tokens, or its own when it ran eagerly
        rows_computed.append(replayed[-1][1] if len(replayed) > before else shapes[-1][1])
        return launched
    runner.execute = counted
    graphs.replay = lambda key, *args: replayed.append(key) or replay(key, *args)
    todo = list(prompts)
    in_flight, done, out_tokens = 0, 0, 0
    base = f"c{concurrency}-"
    next_id = [0]

    def add():
        ids, max_tokens = todo.pop(0)
        ids = ids[:engine.max_model_len // 2]      # a model with a short context (tiny test models) only
        engine.add_request(f"{base}{next_id[0]}", ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                      ignore_eos=True))
        next_id[0] += 1
    prof = kernels = None
    t0 = time.perf_counter()
    steps = 0
    while todo or in_flight:
        while todo and in_flight < concurrency:
            add()
            in_flight += 1
        report = engine.step()
        steps += 1
        out_tokens += len(report.tokens)
        finished = len(report.finished)
        done += finished
        in_flight -= finished
        if profile_steps and steps == 100:
            import torch
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
            prof.__enter__()
            prof_steps = len(shapes)
        if prof is not None and steps == 100 + profile_steps:
            import torch
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            prof.__exit__(None, None, None)
            kernels = _kernel_table(prof, len(shapes) - prof_steps)
            profiled_shapes = shapes[prof_steps:]
            prof = None
    wall = time.perf_counter() - t0
    runner.execute, graphs.replay = execute, replay
    rows = [s[0] for s in shapes]
    tokens = [s[1] for s in shapes]
    mixed = sum(t > r for r, t in shapes)
    res = dict(concurrency=concurrency, requests=done, wall_s=wall, req_s=done / wall, out_tok_s=out_tokens / wall,
               steps=len(shapes), ms_per_step=1e3 * wall / max(len(shapes), 1),
               rows_per_step=sum(rows) / len(rows), tokens_per_step=sum(tokens) / len(tokens),
               computed_per_step=sum(rows_computed) / len(rows_computed),
               mixed_share=mixed / len(shapes))
    if kernels is not None:
        res["kernels_ms_per_step"] = kernels
        res["profiled_rows_per_step"] = sum(s[0] for s in profiled_shapes) / len(profiled_shapes)
        res["profiled_tokens_per_step"] = sum(s[1] for s in profiled_shapes) / len(profiled_shapes)
    return res


def _kernel_table(prof, steps: int) -> dict:
    table = {}
    for e in prof.key_averages():
        # device time of kernels and copies; on the CPU (tests of this script) the operators' own time
        ms = (e.self_device_time_total if e.self_device_time_total else e.self_cpu_time_total) / 1e3
        if ms > 0 and not e.key.startswith(("cuda", "cu", "Activity Buffer", "Buffer Flush")):
            table[e.key] = round(ms / steps, 4)
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--levels", default="64,256")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--profile-levels", default="", help="comma-separated levels to profile")
    p.add_argument("--label", default="sim")
    p.add_argument("--out", required=True)
    p.add_argument("engine_args", nargs="*")
    args = p.parse_intermixed_args()
    from tokenmill import LLM
    from tokenmill.models.presets import resolve_model_path
    path = resolve_model_path(args.model)
    levels = [int(x) for x in args.levels.split(",")]
    extra = {k: (int(v) if v.isdigit() else v) for k, v in (a.split("=", 1) for a in args.engine_args)}
    extra.setdefault("max_num_seqs", max(levels))
    n = args.num_prompts
    profiled = [int(x) for x in args.profile_levels.split(",") if x]
    # each level its own prompts: a level after another would otherwise find its prompts in the prefix cache
    prompts = chat_prompts(path, 32 + n * (len(levels) + len(profiled)))
    engine = LLM(path, **extra).engine
    run_level(engine, prompts[:32], 16)        # compiles and warms outside the levels
    results = []
    runs = [(c, 0) for c in levels] + [(c, 200) for c in profiled]
    for i, (c, profile_steps) in enumerate(runs):
        results.append(run_level(engine, prompts[32 + i * n:32 + (i + 1) * n], c, profile_steps))
        r = results[-1]
        print(f"| {args.label}{' (profiled)' if profile_steps else ''} | {c} | {r['requests']} | {r['req_s']:.2f} | {r['out_tok_s']:,.0f} | "
              f"{r['ms_per_step']:.2f} | {r['rows_per_step']:.1f} | {r['tokens_per_step']:.1f} | "
              f"{r['computed_per_step']:.1f} | "
              f"{r['mixed_share']:.2f} |", flush=True)
        if "kernels_ms_per_step" in r:
            total = sum(r["kernels_ms_per_step"].values())
            print(f"kernel time per step {total:.3f} ms ({r['profiled_rows_per_step']:.1f} rows, "
                  f"{r['profiled_tokens_per_step']:.1f} tokens):")
            for name, ms in list(r["kernels_ms_per_step"].items())[:14]:
                print(f"  {ms:.3f} ms {100 * ms / total:4.1f}% {name[:90]}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.label}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
