"""A Granite checkpoint quantized to FP8 at load (`--quantization fp8` on its bf16 weights) against the same
checkpoint written per channel by the CPU quantizer (`quant.fp8.write_checkpoint`), each served in bfloat16:
the quantized bytes of layer 0's products and the logprobs of one 40-token text, with Granite's multipliers
(folded at load) and with every multiplier 1 (nothing folded).

    PYTHONPATH=src python lab/granite_fp8_at_load.py [--device cuda]

On the CPU both are equal bit for bit, with and without the folds. On an H200, tests/test_granite.py's GPU
test of FP8 at load against a prefolded per-channel checkpoint found them 0.16 apart at most (docs/BENCHMARKS.md,
"Granite on the GPU"); this script tells whether that is the bytes quantized at load or the folds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    from safetensors.torch import load_file

    import test_granite as tg
    from test_real_model import engine_logprobs
    from tokenmill import LLM
    from tokenmill.quant import fp8

    granite = dict(tg.MULTIPLIERS)
    for multipliers in (granite, {k: 1.0 for k in granite}):
        tg.MULTIPLIERS.update(multipliers)
        plain = os.path.join(tempfile.mkdtemp(), "plain")
        tg.save_granite(plain, tied=True, vocab_size=512, hidden_size=256, intermediate_size=512,
                        num_attention_heads=4, num_key_value_heads=2)
        with open(os.path.join(plain, "config.json")) as f:
            hf = json.load(f)
        fp8.write_checkpoint(plain + "-q", load_file(os.path.join(plain, "model.safetensors")), hf,
                             "compressed-tensors")
        config = dict(device=args.device, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64,
                      gpu_memory_utilization=0.3)
        at_load, written = LLM(plain, quantization="fp8", **config), LLM(plain + "-q", **config)
        layers = [m.engine.runner.model.model.layers[0] for m in (at_load, written)]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj"):
            a, b = (layer.get_submodule(name) for layer in layers)
            print(name, {k: float((getattr(a, k).float() - getattr(b, k).float()).abs().max())
                         for k in ("weight", "scale")})
        ids = [(7 * i + 3) % 512 for i in range(40)]
        diff = (engine_logprobs(at_load, ids).float() - engine_logprobs(written, ids).float()).abs()
        print(f"multipliers {list(multipliers.values())}: logprobs at load against written, max {float(diff.max()):.4f}, "
              f"mean {float(diff.mean()):.5f}")
    tg.MULTIPLIERS.update(granite)


if __name__ == "__main__":
    main()
