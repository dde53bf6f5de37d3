"""A round-to-nearest quantizer (no calibration) that writes AWQ GEMM and GPTQ checkpoints in their exact
on-disk layouts (see `w4.py` for the layout facts), so the loader and future kernels are tested on files
shaped as the published ones."""
from __future__ import annotations

import json
import os

import torch

from tokenmill.quant.w4 import AWQ_ORDER, PACK

# the decoder's linear layers that AWQ and GPTQ checkpoints quantize; embeddings, norms and the head stay
QUANTIZED_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int [R, C] of 4-bit values -> int32 [R, C/8]; field i of word j holds column 8j + order[i]."""
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // PACK, PACK)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64)
    return _to_int32((v << shifts).sum(-1))


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R/8, C]; field i of word j holds row 8j + i."""
    r, c = values.shape
    v = values.to(torch.int64).reshape(r // PACK, PACK, c)
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64)[None, :, None]
    return _to_int32((v << shifts).sum(1))


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [out, in] -> [out, groups, group] float32, the last group padded with its own first value so
    padding never widens its range."""
    out, n = w.shape
    g = -(-n // group)
    w = w.float()
    if g * group != n:
        w = torch.cat([w, w[:, -1:].expand(out, g * group - n)], dim=1)
    return w.reshape(out, g, group)


def _round_asym(w: torch.Tensor, group: int, min_zero: int = 0):
    """Per-group min/max grid: q in [0, 15], zero in [min_zero, 15]; returns q [in, out], zeros and
    scales [groups, out] (scales rounded to fp16 first, as stored)."""
    wg = _groups(w, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    zeros = torch.round(-lo / scales).clamp(min_zero, 15)
    q = torch.round(wg / scales[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).reshape(w.shape[0], -1)[:, :w.shape[1]]
    return q.t().to(torch.int32), zeros.t().to(torch.int32), scales.t().half()


def _round_sym(w: torch.Tensor, group: int):
    """Symmetric grid with zero 8: scale = 2 max|w| / 15, as GPTQ's sym=True."""
    wg = _groups(w, group)
    scales = (2 * wg.abs().amax(-1) / 15).clamp(min=1e-6).half().float()
    q = (torch.round(wg / scales[..., None]) + 8).clamp(0, 15).reshape(w.shape[0], -1)[:, :w.shape[1]]
    zeros = torch.full_like(scales, 8)
    return q.t().to(torch.int32), zeros.t().to(torch.int32), scales.t().half()


def quantize_awq(w: torch.Tensor, group_size: int = 128) -> dict[str, torch.Tensor]:
    """A Linear weight [out, in] -> AutoAWQ GEMM's qweight, qzeros and scales."""
    if w.shape[1] % group_size:
        raise ValueError(f"AWQ needs in_features ({w.shape[1]}) to be a multiple of group_size ({group_size})")
    q, z, s = _round_asym(w, group_size)
    return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(z, AWQ_ORDER), "scales": s}


def quantize_gptq(w: torch.Tensor, group_size: int = 128, sym: bool = True,
                  checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """A Linear weight [out, in] -> GPTQ's qweight, qzeros, scales and g_idx (no act-order). In the v1
    format ("gptq") zeros are stored minus one, so the asymmetric grid keeps zeros >= 1 (a stored -1
    would wrap to 15)."""
    offset = 1 if checkpoint_format == "gptq" else 0
    q, z, s = _round_sym(w, group_size) if sym else _round_asym(w, group_size, min_zero=offset)
    g_idx = (torch.arange(w.shape[1]) // group_size).to(torch.int32)
    return {"qweight": pack_rows(q), "qzeros": pack_cols(z - offset), "scales": s, "g_idx": g_idx}


def quantization_config(method: str, group_size: int = 128, sym: bool = True,
                        checkpoint_format: str = "gptq") -> dict:
    """The `quantization_config` entry of config.json as AutoAWQ / AutoGPTQ write it."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": sym,
            "checkpoint_format": checkpoint_format}


def quantize_state_dict(state: dict[str, torch.Tensor], method: str, group_size: int = 128, sym: bool = True,
                        checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Hugging Face names in, the quantized checkpoint's tensors out: `*.{q,k,v,o,gate,up,down}_proj.weight`
    become `.qweight/.qzeros/.scales` (GPTQ: and `.g_idx`), everything else is kept."""
    out = {}
    for key, t in state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in QUANTIZED_LAYERS:
            parts = (quantize_awq(t, group_size) if method == "awq"
                     else quantize_gptq(t, group_size, sym, checkpoint_format))
            out.update({f"{prefix}.{name}": v.contiguous() for name, v in parts.items()})
        else:
            out[key] = t.contiguous()
    return out


def write_checkpoint(out_dir: str, state: dict[str, torch.Tensor], hf_config: dict, method: str,
                     group_size: int = 128, sym: bool = True, checkpoint_format: str = "gptq") -> None:
    """Quantizes `state` and writes `model.safetensors` and `config.json` (with its quantization_config)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file(quantize_state_dict(state, method, group_size, sym, checkpoint_format),
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(hf_config, quantization_config=quantization_config(method, group_size, sym, checkpoint_format))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
