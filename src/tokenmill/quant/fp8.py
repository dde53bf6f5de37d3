"""FP8 weights (E4M3, `torch.float8_e4m3fn`): the formats read, the quantizer that writes them, and the
dequantizing reference every FP8 kernel is tested against.

Three sources, one layer (`layers/fp8_linear.Fp8Linear`): a weight `[out, in]` in FP8 and a float32 scale
per block of `block = (block_n, block_k)` weights, `w = q * scale[n // block_n, k // block_k]`.

- Quantized at load (`--quantization fp8` on a plain checkpoint): per output channel, block `(1, in)`,
  scale `[out, 1]` = the row's absmax / 448, named `weight_scale`.
- compressed-tensors (`quant_method: compressed-tensors`, one config group whose weights are
  `{num_bits: 8, type: float, strategy: channel}`): the same layout as stored, `*.weight_scale` [out, 1].
  Its activations are dynamic per token (or absent); static activation scales are refused.
- Qwen's block-wise format (`quant_method: fp8`, `fmt: e4m3`, `activation_scheme: dynamic`,
  `weight_block_size: [128, 128]`): `*.weight_scale_inv` [ceil(out/128), ceil(in/128)], which multiplies
  the stored weight (the name notwithstanding).

Block scales are kept as stored and used by the kernels directly, not converted to per-channel scales at
load: a conversion re-rounds every weight whose block scale differs from its row's (a second FP8 rounding,
doubling the error variance: +5.1% perplexity on SmolLM2's long held-out text against +2.8% for the
blocks as stored, docs/BENCHMARKS.md), and the few-row kernel applies a block scale per 128-column step at
no measurable cost, and the block GEMM of many rows scales each K step's product
(`layers/kernels/fp8_gemm.py`).

The head and the embedding stay in the model dtype: the embedding is a gather (one row per token, no
bandwidth to save), the head is tied to it in the Qwen3 models this serves, and every published FP8
checkpoint of these models keeps `lm_head` unquantized (an FP8 head would move the logits themselves).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from tokenmill.quant.formats import FP8_METHODS, QUANTIZED_LAYERS

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)         # 448


@dataclass(frozen=True)
class Fp8Rows:
    """An FP8 product's input rows, quantized by the kernel that wrote them as
    `layers/kernels/fp8_quantize.quantize_rows(x, group)` would: q [M, K] FP8, scale [M, ceil(K / group)]
    float32 (group K: one scale a row); `dtype` is the rows' own dtype, which the product's output takes."""
    q: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass(frozen=True)
class UnscaledRows:
    """A per-channel FP8 product's output before its scales, for the kernel after it to apply as it loads
    it (the RMSNorm that adds the residual, `fused_ops.rms_norm`; the gated activation, `fused_ops.act_and_mul`;
    the attention prologue, `attention_prologue.qk_norm_rope_store`), a kernel fewer than scaling first: `raw` [M, N]
    float32 or bfloat16, the sums of the FP8 rows and weights; `row_scale` float32 [M, 1], the input rows'
    scales; `col_scale` float32 [N], the weight's per output channel; `dtype` the product's output dtype.
    Scaled, each value is `(raw.float() * row_scale * col_scale).to(dtype)`, as `fp8_gemm._scale_rows_kernel`
    writes it."""
    raw: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape


def check_device(device: torch.device, what: str = "FP8 weights") -> None:
    """FP8 (E4M3) tensor cores and conversions need sm89 (Ada) or newer: `what` (FP8 weights, an FP8 KV
    cache) on a CUDA `device` below that is refused."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"{what} need a GPU of compute capability 8.9 (sm89) or newer; "
                             f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}")


# ---- quantizer and reference ---------------------------------------------------------------------------
def scales_of(amax: torch.Tensor) -> torch.Tensor:
    """The FP8 scales of blocks whose largest |w| is `amax` (float32): amax / 448, 1 where amax is 0. The
    448 is a tensor on amax's device: CUDA divides by a Python number as a product with its reciprocal, a
    second rounding the CPU does not make, and a checkpoint quantized at load on the GPU is to hold the
    bytes of one written on the CPU."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def quantize(w: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (FP8 weight, float32 scale) by round to nearest: per output channel (scale [out, 1])
    with `block` None, else one scale per (block_n, block_k) tile, a partial last tile included."""
    w = w.float()
    n, k = w.shape
    bn, bk = block or (1, k)
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    tiles = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n)).view(pn // bn, bn, pk // bk, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = scales_of(amax)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(pn, pk)[:n, :k]
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The weight [out, in] in float32: q * scale of its block. Builds no tensor from host data, so it
    runs inside a CUDA-graph capture."""
    n, k = q.shape
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * s


def quantization_config(fmt: str) -> dict:
    """The config.json `quantization_config` of a checkpoint written as `fmt` ("fp8": Qwen's block-wise
    format, "compressed-tensors": per channel)."""
    if fmt not in FP8_METHODS:
        raise ValueError(f"FP8 checkpoint format {fmt!r} is not supported; supported: {', '.join(FP8_METHODS)}")
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}


def write_checkpoint(out_dir: str, state: dict[str, torch.Tensor], hf_config: dict, fmt: str,
                     weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """A plain checkpoint (`state`, `hf_config`) quantized into `fmt`'s on-disk layout: every decoder
    linear weight as FP8 with its scale tensor, everything else (norms, biases, embedding, head) as is.
    `weights[key]`: that weight already quantized by a calibrated quantizer (`gptq.gptq_fp8_model`: FP8
    weight, scale [out, 1]; compressed-tensors only); a weight without one is rounded to nearest."""
    from safetensors.torch import save_file
    from tokenmill.quant.quantize import check_out_dir, check_unquantized
    check_unquantized(state, hf_config)
    check_out_dir(out_dir)
    qc = quantization_config(fmt)
    block = (128, 128) if fmt == "fp8" else None
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    weights = weights or {}
    if weights and block is not None:
        raise ValueError("calibrated FP8 weights have one scale per output channel: write them as "
                         "compressed-tensors")
    out = {}
    for key, t in state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in QUANTIZED_LAYERS:
            out[key], out[f"{prefix}.{scale_name}"] = weights.get(key) or quantize(t, block)
        else:
            out[key] = t.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(hf_config, quantization_config=qc), f, indent=1)


def quantize_at_load(tensors):
    """A plain checkpoint's `(key, read)` stream with every decoder linear weight quantized per output
    channel: `X.weight` becomes its FP8 values and `X.weight_scale` its scales, each read (and quantized)
    once when the loader first asks for either. Rows are independent, so q/k/v and gate/up shards quantize
    apart and pack as stored ones do."""
    for key, read in tensors:
        prefix, _, leaf = key.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in QUANTIZED_LAYERS:
            yield key, read
            continue
        parts: list = []

        def part(i: int, read=read, parts=parts) -> torch.Tensor:
            if not parts:
                parts.extend(quantize(read()))
            return parts[i]
        yield key, lambda part=part: part(0)
        yield f"{prefix}.weight_scale", lambda part=part: part(1)
