"""Scores tiny models in bits per byte on the validation split of this interpreter's standard library,
so that models with different tokenizers compare (docs/TINY_MODEL.md).

    python scripts/tiny_bits_per_byte.py src/tokenmill/assets/tiny [OTHER_MODEL_DIR ...]

Text: the first 400,000 bytes of the split's code and 100,000 bytes of its dialogues (the trainer's
`load_corpus`, every 40th file by path hash); 128-token windows without overlap, float32 on the CPU
through transformers.
"""
from __future__ import annotations

import math
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.tiny.train import load_corpus


def bits_per_byte(model, tok, text: str, window: int = 128) -> tuple[float, float]:
    ids = tok(text, return_tensors="pt").input_ids[0]
    nll, scored = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - window - 1, window):
            x = ids[i:i + window + 1][None]
            logits = model(x[:, :-1]).logits
            nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            scored += window
    scored_bytes = len(text.encode()) * scored / len(ids)
    return nll / scored_bytes / math.log(2), len(text.encode()) / len(ids)


def main() -> None:
    val = load_corpus(None, 40)["val"]
    texts = {"code": "\n".join(val["code"])[:400_000], "dialogue": "\n".join(val["chat"])[:100_000]}
    print(f"python {sys.version.split()[0]}")
    for path in sys.argv[1:]:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, text in texts.items():
            bpb, bytes_per_token = bits_per_byte(model, tok, text)
            print(f"{path} {name}: {bpb:.3f} bits/byte ({bytes_per_token:.2f} bytes/token)")


if __name__ == "__main__":
    main()
