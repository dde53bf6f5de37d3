"""Request sets for the online benchmark (`tokenmill bench serve`), plus an offline tokenizer for presets.

- `random`: seeded lengths in inclusive ranges. Completions send token ids below `vocab_limit`; chat sends
  a user message of random English words (about one token per word).
- `sharegpt`: a ShareGPT-format JSON file; the first human turn is the prompt, the first gpt turn's length
  (tokens if a tokenizer is given, else characters / 4) is `max_tokens`.
- `mixed-chat`: user messages of 50 to 1,000 characters in English, Chinese or both, composed from the
  sentence templates and word lists below, with `max_tokens` uniform in 100..300. Fully determined by the
  seed, so every backend sees the very same requests.

`write_tokenizer_dir` builds a byte-level BPE tokenizer (trained on the same templates) whose ids fill the
whole vocabulary of a random-weight preset: random outputs then always decode to text, so streamed chunks
carry content, and the eos/bos ids sit where the preset's config puts them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from tokenmill.bench.datasets import parse_range, read_sharegpt


@dataclass(frozen=True)
class ServeRequest:
    prompt: str | list[int]     # completions: text or token ids; chat: the user message
    max_tokens: int
    prompt_len: int | None = None   # known only for token-id prompts; the server's usage is authoritative


EN_WORDS = (
    "model server request token batch cache memory latency throughput query answer question user system "
    "engine kernel block table schedule queue stream python function error result value number list string "
    "weather travel city river mountain coffee music book history science garden kitchen market school "
    "friend family morning evening summer winter computer network database file report plan project team "
    "quickly carefully simple useful different important small large new old fast slow clear short long"
).split()
EN_TEMPLATES = (
    "Can you explain how a {a} works together with a {b}?",
    "Please write a short paragraph about {a} and {b}.",
    "I am planning a trip to a {a} near the {b}; what should I pack?",
    "What is the difference between a {a} and a {b} in practice?",
    "Summarize the following notes about the {a}: the {b} was {c} and the {a} was {c}.",
    "Translate this sentence into Chinese: the {a} is {c} today.",
    "Write a Python function that returns the {a} of a {b}.",
    "Give me three tips to make my {a} more {c}.",
    "My {a} keeps failing with an error about the {b}. How do I fix it?",
    "Tell me a story about a {a}, a {b} and a {c} {a}.",
    "List the pros and cons of using a {c} {a} for the {b}.",
    "Why does the {a} become {c} when the {b} is {c}?",
)
ZH_WORDS = (
    "模型 服务 请求 缓存 内存 延迟 吞吐量 问题 答案 用户 系统 引擎 调度 队列 数据 函数 错误 结果 天气 旅行 "
    "城市 河流 山 咖啡 音乐 书 历史 科学 花园 厨房 市场 学校 朋友 家人 早上 晚上 夏天 冬天 电脑 网络 "
    "数据库 文件 报告 计划 项目 团队 快速 仔细 简单 有用 不同 重要 小 大 新 旧"
).split()
ZH_TEMPLATES = (
    "请解释一下{a}和{b}之间的关系。",
    "帮我写一段关于{a}的短文，要提到{b}。",
    "我下周要去一个有{a}的地方旅行，需要准备什么？",
    "{a}和{b}有什么不同？请举例说明。",
    "请总结下面的内容：{a}很{c}，{b}也很{c}。",
    "把这句话翻译成英文：今天的{a}很{c}。",
    "用Python写一个函数，计算{a}里的{b}。",
    "给我三个建议，让我的{a}变得更{c}。",
    "我的{a}一直报错，提示和{b}有关，怎么解决？",
    "讲一个关于{a}和{b}的故事。",
    "使用{c}的{a}来处理{b}有哪些优点和缺点？",
    "为什么{b}变{c}的时候{a}也会变{c}？",
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _sentence(rng: np.random.Generator, lang: str) -> str:
    templates, words = (EN_TEMPLATES, EN_WORDS) if lang == "en" else (ZH_TEMPLATES, ZH_WORDS)
    t = templates[int(rng.integers(len(templates)))]
    a, b, c = (words[int(i)] for i in rng.integers(len(words), size=3))
    return t.format(a=a, b=b, c=c)


def mixed_chat_text(rng: np.random.Generator, num_chars: int) -> str:
    """About `num_chars` characters: English, Chinese, or sentences of both mixed, cut at `num_chars`."""
    mode = ("en", "zh", "mix")[int(rng.integers(3))]
    parts: list[str] = []
    length = 0
    while length < num_chars:
        lang = mode if mode != "mix" else ("en", "zh")[int(rng.integers(2))]
        s = _sentence(rng, lang)
        if parts and lang == "en":
            s = " " + s
        parts.append(s)
        length += len(s)
    return "".join(parts)[:num_chars].rstrip() or "Hello."


def mixed_chat_requests(num_prompts: int, seed: int = 0, chars_range: tuple[int, int] = (50, 1000),
                        output_len_range: tuple[int, int] = (100, 300)) -> list[ServeRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prompts):
        n_chars = int(rng.integers(chars_range[0], chars_range[1] + 1))
        max_tokens = int(rng.integers(output_len_range[0], output_len_range[1] + 1))
        out.append(ServeRequest(mixed_chat_text(rng, n_chars), max_tokens))
    return out


def random_serve_requests(num_prompts: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                          chat: bool, vocab_limit: int = 1000, seed: int = 0) -> list[ServeRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prompts):
        n_in = int(rng.integers(input_len_range[0], input_len_range[1] + 1))
        n_out = int(rng.integers(output_len_range[0], output_len_range[1] + 1))
        if chat:
            prompt = " ".join(EN_WORDS[int(i)] for i in rng.integers(len(EN_WORDS), size=n_in))
            out.append(ServeRequest(prompt, n_out))
        else:
            ids = rng.integers(1, vocab_limit, size=n_in).tolist()
            out.append(ServeRequest(ids, n_out, n_in))
    return out


def sharegpt_serve_requests(path: str, num_prompts: int, seed: int = 0, tokenizer=None,
                            max_output_len: int = 1024, min_len: int = 4) -> list[ServeRequest]:
    pairs = read_sharegpt(path)
    out = []
    for idx in np.random.default_rng(seed).permutation(len(pairs)).tolist():
        if pairs[idx] is None:
            continue
        human, gpt = pairs[idx]
        n_out = len(tokenizer.encode(gpt, add_special_tokens=False)) if tokenizer is not None else len(gpt) // 4
        if n_out < min_len or len(human) < min_len:
            continue
        out.append(ServeRequest(human, min(n_out, max_output_len)))
        if len(out) == num_prompts:
            break
    return out


def build_serve_requests(args, chat: bool) -> list[ServeRequest]:
    if args.dataset == "mixed-chat":
        return mixed_chat_requests(args.num_prompts, args.seed, parse_range(args.mixed_chat_chars),
                                   parse_range(args.mixed_chat_output_len))
    if args.dataset == "random":
        return random_serve_requests(args.num_prompts, parse_range(args.input_len_range),
                                     parse_range(args.output_len_range), chat, args.random_vocab_limit, args.seed)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return sharegpt_serve_requests(args.dataset, args.num_prompts, args.seed, tokenizer)


def dataset_summary(requests: list[ServeRequest]) -> dict:
    chars = [len(r.prompt) for r in requests if isinstance(r.prompt, str)]
    out = [r.max_tokens for r in requests]
    return {"num_requests": len(requests), "prompt_chars_min": min(chars, default=None),
            "prompt_chars_max": max(chars, default=None), "max_tokens_min": min(out, default=None),
            "max_tokens_max": max(out, default=None), "max_tokens_total": sum(out)}


def save_serve_requests(requests: list[ServeRequest], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in requests], f, ensure_ascii=False)


# ----- offline tokenizer for random-weight presets ---------------------------------------------------------
def _corpus(seed: int = 0, num_sentences: int = 4000) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [" ".join(EN_WORDS), "".join(ZH_WORDS), *EN_TEMPLATES, *ZH_TEMPLATES]
    lines += [_sentence(rng, ("en", "zh")[i % 2]) for i in range(num_sentences)]
    return lines


def _special_ids(vocab_size: int, hf_config: dict | None) -> dict[str, int]:
    """<|im_end|> at the config's first eos id, <|endoftext|> at its bos (or second eos) id, the rest at
    the highest free ids."""
    cfg = hf_config or {}
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    bos = cfg.get("bos_token_id")
    wanted = {"<|im_end|>": eos[0] if eos else None,
              "<|endoftext|>": bos if bos is not None and bos not in eos[:1] else (eos[1] if len(eos) > 1 else None)}
    ids = {k: int(v) for k, v in wanted.items() if v is not None and 0 <= int(v) < vocab_size}
    free = vocab_size - 1
    for name in CHATML_SPECIALS:
        if name not in ids:
            while free in ids.values():
                free -= 1
            ids[name] = free
    return ids


def write_tokenizer_dir(path: str, vocab_size: int, hf_config: dict | None = None, base_vocab: int = 4000) -> str:
    """Save a tokenizer with exactly `vocab_size` ids and a ChatML template to `path` (no network).

    Ids not produced by the trained BPE are filler tokens (' w<id>'), so every id decodes to text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = _special_ids(vocab_size, hf_config)
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=max(300, min(base_vocab, min(specials.values()))), show_progress=False,
                                  max_token_length=7,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator(_corpus(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = {t: i for t, i in model["vocab"].items() if i not in specials.values()}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    used = set(vocab.values()) | set(specials.values())
    for i in range(vocab_size):
        if i not in used:
            vocab[f"\u0120w{i}"] = i        # \u0120 is the byte-level form of a space
    for name, i in specials.items():
        vocab[name] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in CHATML_SPECIALS])
    for name, i in specials.items():
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name), i)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """python -m tokenmill.bench.serve_datasets --model preset:qwen3-4b --output DIR"""
    import argparse

    p = argparse.ArgumentParser(description="write an offline ChatML tokenizer covering a model's vocabulary")
    p.add_argument("--model", required=True, help="preset:NAME or a model directory (for vocab_size and eos ids)")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    from tokenmill.models.presets import is_preset, preset_config
    if is_preset(args.model):
        cfg = preset_config(args.model)
    else:
        import os
        with open(os.path.join(args.model, "config.json")) as f:
            cfg = json.load(f)
    write_tokenizer_dir(args.output, int(cfg["vocab_size"]), cfg)
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
