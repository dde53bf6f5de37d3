"""GPU correctness against Hugging Face transformers on the same random bf16 weights.

For each model: 32 prompts of mixed length, greedy, 16 new tokens, through tokenmill twice (first pass:
long prompts are prefilled in chunks; second pass: the same prompts hit the prefix cache). Every
position tokenmill computes is compared, teacher-forced, with one HF forward pass over prompt + the
tokens tokenmill generated: relative error of log-softmax and top-1 agreement. Greedy agreement is
checked two ways: HF's teacher-forced argmax at each generated position, and real HF `generate()` on a
subset of prompts.

Usage: python scripts/device/check_hf.py --model preset:qwen3-4b [--model preset:nanbeige4.1-3b]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models.presets import resolve_model_path


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000, vocab - 1000) for _ in range(300)]
    prompts = []
    for i in range(n):
        length = rng.choice([7, 33, 120, 260, 700, 1100])
        body = [rng.randrange(1000, vocab - 1000) for _ in range(length)]
        prompts.append(shared[: rng.randrange(50, 300)] + body if i % 3 == 0 else body)
    return prompts


def run_tokenmill(path, prompts, new_tokens, batched_tokens):
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=batched_tokens,
              gpu_memory_utilization=0.45)
    runner = llm.engine.runner
    passes = []
    for _ in range(2):
        logits: dict[str, dict[int, torch.Tensor]] = {}

        def hook(requests, num_new, qsl, hidden):
            starts = qsl.tolist()
            for i, (req, n) in enumerate(zip(requests, num_new)):
                rows = hidden[starts[i]:starts[i] + n]
                lg = runner.model.compute_logits(rows).float().log_softmax(-1).cpu()
                first = req.num_computed_tokens
                store = logits.setdefault(req.request_id, {})
                for j in range(n):
                    store[first + j] = lg[j]
        runner.hidden_hook = hook
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        runner.hidden_hook = None
        passes.append(([o.outputs[0].token_ids for o in outs],
                       [logits[o.request_id] for o in outs], [o.num_cached_tokens for o in outs]))
    stats = llm.engine.get_stats()
    del llm
    torch.cuda.empty_cache()
    return passes, stats


def compare(path, prompts, passes, generate_subset):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    report = []
    for p_idx, (tokens, logits, cached) in enumerate(passes):
        errs, agree, total, greedy_ok = [], 0, 0, 0
        for prompt, gen, lg in zip(prompts, tokens, logits):
            seq = torch.tensor([prompt + gen], device="cuda")
            with torch.no_grad():
                ref = hf(seq).logits[0].float().log_softmax(-1).cpu()
            positions = sorted(pos for pos in lg if pos < seq.shape[1])
            mine = torch.stack([lg[pos] for pos in positions])
            theirs = ref[positions]
            errs.append(((mine - theirs).norm() / theirs.norm()).item())
            agree += (mine.argmax(-1) == theirs.argmax(-1)).sum().item()
            total += len(positions)
            hf_next = ref[len(prompt) - 1: len(prompt) - 1 + len(gen)].argmax(-1).tolist()
            greedy_ok += int(hf_next == gen)
        report.append({"pass": p_idx, "max_rel_err": max(errs), "mean_rel_err": sum(errs) / len(errs),
                       "top1_agreement": agree / total, "positions": total,
                       "greedy_match_teacher_forced": f"{greedy_ok}/{len(prompts)}",
                       "prompts_with_cache_hits": sum(1 for c in cached if c > 0)})
    tokens = passes[0][0]
    match = 0
    for prompt, gen in list(zip(prompts, tokens))[:generate_subset]:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(gen),
                              min_new_tokens=len(gen), do_sample=False, pad_token_id=0)
        match += int(out[0, len(prompt):].tolist() == gen)
    del hf
    torch.cuda.empty_cache()
    return report, f"{match}/{generate_subset}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--generate-subset", type=int, default=8)
    args = ap.parse_args()
    results = {}
    for model in args.model or ["preset:qwen3-4b"]:
        t0 = time.time()
        path = resolve_model_path(model)
        vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
        prompts = make_prompts(args.num_prompts, vocab)
        passes, stats = run_tokenmill(path, prompts, args.new_tokens, args.batched_tokens)
        report, generate_match = compare(path, prompts, passes, args.generate_subset)
        results[model] = {"passes": report, "hf_generate_match": generate_match,
                          "preemptions": stats["num_preemptions"], "seconds": time.time() - t0}
        print(json.dumps({model: results[model]}, indent=1), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_hf.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n| model | pass | max rel err | mean rel err | top-1 agree | greedy (teacher-forced) | cache-hit prompts | HF generate match |")
    print("|---|---|---|---|---|---|---|---|")
    for model, r in results.items():
        for p in r["passes"]:
            print(f"| {model} | {p['pass']} | {p['max_rel_err']:.2e} | {p['mean_rel_err']:.2e} | "
                  f"{p['top1_agreement']:.4f} | {p['greedy_match_teacher_forced']} | "
                  f"{p['prompts_with_cache_hits']} | {r['hf_generate_match']} |")


if __name__ == "__main__":
    main()
