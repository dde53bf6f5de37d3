"""Benchmark request sets: seeded random token ids, or a ShareGPT-format JSON file.

Prompts are token ids, so random workloads need no tokenizer. Every request carries the exact number of
output tokens it must produce; backends run with eos ignored so the work is identical across backends.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def parse_range(text: str | tuple[int, int]) -> tuple[int, int]:
    """'100,1024' -> (100, 1024); a single number 'N' -> (N, N)."""
    if isinstance(text, tuple):
        lo, hi = text
    else:
        parts = [p for p in str(text).replace(":", ",").split(",") if p.strip()]
        if len(parts) not in (1, 2):
            raise ValueError(f"expected 'LO,HI' or 'N', got {text!r}")
        lo, hi = int(parts[0]), int(parts[-1])
    if not 1 <= lo <= hi:
        raise ValueError(f"length range must satisfy 1 <= lo <= hi, got ({lo}, {hi})")
    return lo, hi


def special_token_ids(hf_config: dict) -> set[int]:
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf_config.get(key)
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ids


def sampleable_token_ids(vocab_size: int, specials: set[int]) -> np.ndarray:
    """Ids a random prompt may use: special tokens sit at the end of real vocabularies, so everything from
    the first special id in the upper half on is excluded, and lower special ids one by one."""
    upper = [i for i in specials if vocab_size // 2 <= i < vocab_size]
    hi = min(upper) if upper else vocab_size
    low = np.array(sorted(i for i in specials if 0 <= i < hi), dtype=np.int64)
    return np.setdiff1d(np.arange(hi, dtype=np.int64), low)


def random_requests(num_prompts: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                    vocab_size: int, specials: set[int] = frozenset(), seed: int = 0) -> list[BenchRequest]:
    """Uniform integer input/output lengths within the inclusive ranges, uniform token ids."""
    rng = np.random.default_rng(seed)
    (ilo, ihi), (olo, ohi) = input_len_range, output_len_range
    input_lens = rng.integers(ilo, ihi + 1, size=num_prompts)
    output_lens = rng.integers(olo, ohi + 1, size=num_prompts)
    allowed = sampleable_token_ids(vocab_size, set(specials))
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        ids = allowed[rng.integers(0, len(allowed), size=n_in)]
        requests.append(BenchRequest(ids.tolist(), int(n_out)))
    return requests


def read_sharegpt(path: str) -> list[tuple[str, str] | None]:
    """(first human turn, first gpt turn) of each entry of a ShareGPT-format JSON file, None for an entry
    without both (kept, so that a seed's shuffle of the entries draws what it always drew). A file that
    cannot be read, is not a JSON list or holds no entry with both turns is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"dataset {path!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset {path!r} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset {path!r} is a JSON {type(data).__name__}, not the list of conversations "
                         "of the ShareGPT format")
    pairs = []
    for item in data:
        turns = (item.get("conversations") or item.get("conversation")) if isinstance(item, dict) else None
        turns = [t for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []
        human = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        gpt = next((t.get("value") for t in turns if t.get("from") in ("gpt", "assistant")), None)
        pairs.append((human, gpt) if isinstance(human, str) and isinstance(gpt, str) else None)
    if not any(pairs):
        raise ValueError(f"dataset {path!r} holds no conversation with a human and a gpt turn among its "
                         f"{len(data)} entries (ShareGPT: " '{"conversations": [{"from": "human", "value": ...}, '
                         '{"from": "gpt", "value": ...}]})')
    return pairs


def sharegpt_requests(path: str, tokenizer, num_prompts: int, seed: int = 0, max_input_len: int | None = None,
                      max_output_len: int | None = None, min_len: int = 4) -> list[BenchRequest]:
    """First human turn as the prompt; the first gpt turn's token length as the output length.

    Conversations are shuffled with `seed` and too short (< `min_len` tokens) or too long ones skipped,
    as vLLM's benchmark does."""
    pairs = read_sharegpt(path)
    requests = []
    for idx in np.random.default_rng(seed).permutation(len(pairs)).tolist():
        if pairs[idx] is None:
            continue
        human, gpt = pairs[idx]
        prompt_ids = tokenizer.encode(human, add_special_tokens=False)
        output_len = len(tokenizer.encode(gpt, add_special_tokens=False))
        if len(prompt_ids) < min_len or output_len < min_len:
            continue
        if max_input_len is not None and len(prompt_ids) > max_input_len:
            continue
        if max_output_len is not None and output_len > max_output_len:
            continue
        requests.append(BenchRequest(prompt_ids, output_len))
        if len(requests) == num_prompts:
            break
    return requests


def save_requests(requests: list[BenchRequest], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in requests], f)


def load_requests(path: str) -> list[BenchRequest]:
    with open(path) as f:
        return [BenchRequest(list(r["prompt_token_ids"]), int(r["output_len"])) for r in json.load(f)]
