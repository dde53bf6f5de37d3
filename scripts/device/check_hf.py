"""GPU correctness against Hugging Face transformers on the same random bf16 weights.

For each model: 32 prompts of mixed length, greedy, 16 new tokens, through tokenmill twice (first pass:
long prompts are prefilled in chunks; second pass: the same prompts hit the prefix cache). Every
position tokenmill computes is compared, teacher-forced, with one HF forward pass over prompt + the
tokens tokenmill generated: relative error of log-softmax and top-1 agreement. Greedy agreement is
checked two ways: HF's teacher-forced argmax at each generated position, and real HF `generate()` on a
subset of prompts.

Top-1 agreement is also given by the HF float32 reference's margin, its top log-prob minus its second:
at a near-tie, rounding decides the argmax; random weights make near-ties common.

Usage: python scripts/device/check_hf.py --model preset:qwen3-4b [--model preset:nanbeige4.1-3b]
       [--dtype float32] (tokenmill and HF both computing in float32 on the same bf16-valued weights: the
       engine's own agreement with HF, below bf16's rounding noise)
       [--device cpu ...] (a CPU smoke run on a small model)
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


# lower bounds of the margin bins (nats) for the top-1 breakdown
MARGINS = (0.0, 0.01, 0.03, 0.1, 0.3)


def run_tokenmill(path, prompts, new_tokens, batched_tokens, device, dtype):
    llm = LLM(path, dtype=dtype, device=device, max_model_len=2048, max_num_batched_tokens=batched_tokens,
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
    if device != "cpu":
        torch.cuda.empty_cache()
    return passes, stats


def _metrics(mine: torch.Tensor, ref: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Relative error of the log-softmax rows, and per row whether the argmaxes agree."""
    return ((mine - ref).norm() / ref.norm()).item(), (mine.argmax(-1) == ref.argmax(-1)).cpu()


def _margin_bins(margins: torch.Tensor) -> torch.Tensor:
    """Index into MARGINS of each row's margin bin."""
    return torch.bucketize(margins.cpu(), torch.tensor(MARGINS[1:]), right=True)


def compare(path, prompts, passes, generate_subset, device, dtype):
    """tokenmill (`dtype`) against HF in the same dtype (the same weights and precision) and against HF
    in float32 (the precise reference); HF `dtype` against HF float32 gives the noise floor of `dtype`
    itself."""
    from transformers import AutoModelForCausalLM
    low = getattr(torch, dtype)
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    hf16 = hf32 if low == torch.float32 else AutoModelForCausalLM.from_pretrained(
        path, dtype=low, attn_implementation="sdpa").to(device).eval()
    report = []
    for p_idx, (tokens, logits, cached) in enumerate(passes):
        keys = ("tm_vs_hf16", "tm_vs_hf32", "hf16_vs_hf32")
        acc = {k: [[], 0] for k in keys}
        by_margin = {k: torch.zeros(len(MARGINS), dtype=torch.long) for k in keys}
        in_bin = torch.zeros(len(MARGINS), dtype=torch.long)
        total, greedy_ok = 0, 0
        for prompt, gen, lg in zip(prompts, tokens, logits):
            seq = torch.tensor([prompt + gen], device=device)
            with torch.no_grad():
                ref16 = hf16(seq).logits[0].float().log_softmax(-1)
                ref32 = hf32(seq).logits[0].float().log_softmax(-1)
            positions = sorted(pos for pos in lg if pos < seq.shape[1])
            idx = torch.tensor(positions, device=device)
            mine = torch.stack([lg[pos] for pos in positions]).to(device)
            top2 = ref32[idx].topk(2, dim=-1).values
            bins = _margin_bins(top2[:, 0] - top2[:, 1])
            in_bin += torch.bincount(bins, minlength=len(MARGINS))
            for key, (x, y) in {"tm_vs_hf16": (mine, ref16[idx]), "tm_vs_hf32": (mine, ref32[idx]),
                                "hf16_vs_hf32": (ref16[idx], ref32[idx])}.items():
                err, agree = _metrics(x, y)
                acc[key][0].append(err)
                acc[key][1] += int(agree.sum())
                by_margin[key] += torch.bincount(bins[agree], minlength=len(MARGINS))
            total += len(positions)
            hf_next = ref16[len(prompt) - 1: len(prompt) - 1 + len(gen)].argmax(-1).tolist()
            greedy_ok += int(hf_next == gen)
        row = {"pass": p_idx, "positions": total, "greedy_match_teacher_forced": f"{greedy_ok}/{len(prompts)}",
               "prompts_with_cache_hits": sum(1 for c in cached if c > 0)}
        for key, (errs, agree) in acc.items():
            row[key] = {"max_rel_err": max(errs), "mean_rel_err": sum(errs) / len(errs), "top1": agree / total,
                        "top1_by_margin": {f">={m}": [int(a), int(n)] for m, a, n in
                                           zip(MARGINS, by_margin[key].tolist(), in_bin.tolist())}}
        report.append(row)
    tokens = passes[0][0]
    match = 0
    for prompt, gen in list(zip(prompts, tokens))[:generate_subset]:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = hf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(gen),
                                min_new_tokens=len(gen), do_sample=False, pad_token_id=0)
        match += int(out[0, len(prompt):].tolist() == gen)
    del hf16, hf32
    if device != "cpu":
        torch.cuda.empty_cache()
    return report, f"{match}/{generate_subset}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--generate-subset", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="tokenmill's and the low-precision HF model's")
    args = ap.parse_args()
    results = {}
    for model in args.model or ["preset:qwen3-4b"]:
        t0 = time.time()
        path = resolve_model_path(model)
        vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
        prompts = make_prompts(args.num_prompts, vocab)
        passes, stats = run_tokenmill(path, prompts, args.new_tokens, args.batched_tokens, args.device,
                                      args.dtype)
        report, generate_match = compare(path, prompts, passes, args.generate_subset, args.device, args.dtype)
        results[model] = {"dtype": args.dtype, "passes": report, "hf_generate_match": generate_match,
                          "preemptions": stats["num_preemptions"], "seconds": time.time() - t0}
        print(json.dumps({model: results[model]}, indent=1), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"check_hf_{args.dtype}.json"), "w") as f:
            json.dump(results, f, indent=1)
    low = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(args.dtype, args.dtype)

    labels = {"tm_vs_hf16": f"tokenmill {low} vs HF {low}", "tm_vs_hf32": f"tokenmill {low} vs HF fp32",
              "hf16_vs_hf32": f"HF {low} vs HF fp32"}
    if args.dtype == "float32":  # one reference: the other two rows would repeat or compare HF with itself
        labels = {"tm_vs_hf32": labels["tm_vs_hf32"]}
    print(f"\n| model | pass | compared | max rel err (log-softmax) | mean rel err | top-1 agree | greedy 16 (teacher-forced vs HF {low}) | cache-hit prompts | HF {low} generate match |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, r in results.items():
        for p in r["passes"]:
            for key, label in labels.items():
                m = p[key]
                print(f"| {model} | {p['pass']} | {label} | {m['max_rel_err']:.2e} | {m['mean_rel_err']:.2e} | "
                      f"{m['top1']:.4f} | {p['greedy_match_teacher_forced']} | "
                      f"{p['prompts_with_cache_hits']} | {r['hf_generate_match']} |")
    print("\n| model | pass | compared | " + " | ".join(f"top-1, HF fp32 margin >= {m}" for m in MARGINS) + " |")
    print("|---|---|---|" + "---|" * len(MARGINS))
    for model, r in results.items():
        for p in r["passes"]:
            for key, label in labels.items():
                bins = list(p[key]["top1_by_margin"].values())
                # agreement over every position at or above each margin (bins summed from the top)
                cells = []
                for i in range(len(bins)):
                    agree, n = sum(b[0] for b in bins[i:]), sum(b[1] for b in bins[i:])
                    cells.append(f"{agree / n:.4f} of {n}" if n else "-")
                print(f"| {model} | {p['pass']} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
