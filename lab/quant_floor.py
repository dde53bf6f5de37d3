"""The roofline floors of issue 28's offline workloads with quantized weights and cache, against bf16's
(`tokenmill.bench.roofline`, the workloads' lengths as `tokenmill bench throughput --dataset random --seed 0`
draws them): the ratio a quantized run could reach at most if both ran at their floors.

    PYTHONPATH=src python lab/quant_floor.py
"""
from __future__ import annotations

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.roofline import ModelCost, roofline_floor
from tokenmill.config import ModelConfig
from tokenmill.models.presets import preset_config

WORKLOADS = {"default": (256, (100, 1024), (100, 1024)), "long": (64, (6000, 8000), (64, 256))}
VARIANTS = {"FP8 W": ("fp8", "auto"), "FP8 W+KV": ("fp8", "fp8"), "AWQ g128": ("awq", "auto")}


def main() -> None:
    print("| model | workload | bf16 floor s | " + " | ".join(f"{v} floor s (ratio)" for v in VARIANTS) + " |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for model in ("qwen3-4b", "nanbeige4.1-3b"):
        hf = preset_config(model)
        mc = ModelConfig.from_hf(hf)
        for name, (n, ins, outs) in WORKLOADS.items():
            reqs = random_requests(n, ins, outs, hf["vocab_size"], set(), 0)
            lens = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
            base = roofline_floor(*lens, ModelCost.from_model_config(mc)).seconds
            cells = []
            for quant, kv in VARIANTS.values():
                s = roofline_floor(*lens, ModelCost.from_model_config(mc, 2, quant, kv)).seconds
                cells.append(f"{s:.2f} ({base / s:.3f}x)")
            print(f"| {model} | {name} | {base:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
