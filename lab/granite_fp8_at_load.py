"""A Granite checkpoint quantized to FP8 at load (`--quantization fp8` on its bf16 weights) against the same
checkpoint written per channel by the CPU quantizer (`quant.fp8.write_checkpoint`), each served in bfloat16:
the quantized bytes of layer 0's products and the logprobs of one 40-token text, with Granite's multipliers
(folded at load) and with every multiplier 1 (nothing folded). Then, where the two differ, what else does: every
parameter and buffer (dtype, shape, strides, values), every module's plain attributes, and each module's output
over one eager prefill of the text, the first that differs named.

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
        ids = [(7 * i + 3) % 512 for i in range(40)]
        # each engine's logprobs while it is the process's only one, then again beside the other: where two
        # engines of one process share state (a buffer, a cache of compiled kernels), the second reading moves
        at_load = LLM(plain, quantization="fp8", **config)
        alone = engine_logprobs(at_load, ids).float()
        written = LLM(plain + "-q", **config)
        written_lp = engine_logprobs(written, ids).float()
        beside = engine_logprobs(at_load, ids).float()
        print(f"at load alone against beside the written engine: max {float((alone - beside).abs().max()):.4f}; "
              f"at load alone against written: max {float((alone - written_lp).abs().max()):.4f}")
        layers = [m.engine.runner.model.model.layers[0] for m in (at_load, written)]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj"):
            a, b = (layer.get_submodule(name) for layer in layers)
            print(name, {k: float((getattr(a, k).float() - getattr(b, k).float()).abs().max())
                         for k in ("weight", "scale")})
        diff = (beside - written_lp).abs()
        print(f"multipliers {list(multipliers.values())}: logprobs at load against written, max {float(diff.max()):.4f}, "
              f"mean {float(diff.mean()):.5f}")
        if float(diff.max()) > 1e-3:
            _where_they_differ(plain, config, ids)
    tg.MULTIPLIERS.update(granite)


def _where_they_differ(plain: str, config: dict, ids: list[int]) -> None:
    """The two engines' states side by side, then their modules' outputs over one eager prefill."""
    import torch

    from tokenmill import LLM, SamplingParams
    config = dict(config, enforce_eager=True)
    llms = [LLM(path, **extra, **config) for path, extra in ((plain, {"quantization": "fp8"}), (plain + "-q", {}))]
    models = [llm.engine.runner.model for llm in llms]
    states = [dict(list(m.named_parameters()) + list(m.named_buffers())) for m in models]
    for name in sorted(set(states[0]) | set(states[1])):
        a, b = states[0].get(name), states[1].get(name)
        if a is None or b is None:
            print(f"  state {name}: only {'at load' if b is None else 'written'}")
            continue
        shown = (a.dtype, tuple(a.shape), a.stride()), (b.dtype, tuple(b.shape), b.stride())
        if shown[0] != shown[1] or not torch.equal(a.float(), b.float()):
            print(f"  state {name}: at load {shown[0]}, written {shown[1]}"
                  + (f", max diff {float((a.float() - b.float()).abs().max()):.3g}" if a.shape == b.shape else ""))
    for (name, ma), mb in zip(models[0].named_modules(), models[1].modules()):
        fields = [{k: v for k, v in vars(m).items() if not k.startswith("_") and not torch.is_tensor(v)}
                  for m in (ma, mb)]
        for k in sorted(set(fields[0]) | set(fields[1])):
            va, vb = fields[0].get(k), fields[1].get(k)
            if type(va) != type(vb) or (isinstance(va, (int, float, str, bool, tuple, type(None))) and va != vb):
                print(f"  attribute {name}.{k}: at load {va!r}, written {vb!r}")
    outputs: list[dict[str, torch.Tensor]] = [{}, {}]
    for side, model in enumerate(models):
        for name, module in model.named_modules():
            def keep(_m, _inp, out, name=name, side=side):
                first = out[0] if isinstance(out, tuple) else out
                first = getattr(first, "raw", first)
                if torch.is_tensor(first) and name not in outputs[side]:
                    outputs[side][name] = first.detach().float().clone()
            module.register_forward_hook(keep)
    for llm in llms:
        llm.reset_prefix_cache()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    for name, a in outputs[0].items():
        b = outputs[1].get(name)
        if b is None or a.shape != b.shape:
            print(f"  module {name!r}: outputs {tuple(a.shape)} at load, {None if b is None else tuple(b.shape)} written")
            continue
        d = float((a - b).abs().max())
        if d > 0:
            print(f"  first module output that differs: {name!r}, max {d:.4g} (of {float(b.abs().max()):.4g})")
            break
    else:
        print("  every module's output equal")


if __name__ == "__main__":
    main()
