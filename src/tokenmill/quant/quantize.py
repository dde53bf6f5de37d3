"""Writes AWQ GEMM and GPTQ checkpoints in their exact on-disk layouts (see `w4.py` for the layout facts):
weights rounded to nearest here, or grids found by a calibrated quantizer (`gptq.py`) packed as they are,
so the loader and kernels are tested on files shaped as the published ones."""
from __future__ import annotations

import json
import os

import torch

from tokenmill.quant.formats import QUANTIZED_LAYERS, W4_METHODS, parse_w4_config
from tokenmill.quant.w4 import AWQ_ORDER, PACK

# the decoder's linear layers that AWQ and GPTQ checkpoints quantize; embeddings, norms and the head stay


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _check_nibbles(values: torch.Tensor) -> None:
    """Every value fits its 4 bits: a -1 would borrow from the fields above it in the word."""
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError(f"4-bit packing: values must be in [0, 15], got [{int(values.min())}, {int(values.max())}]")


def pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int [R, C] of 4-bit values -> int32 [R, C/8]; field i of word j holds column 8j + order[i]."""
    _check_nibbles(values)
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // PACK, PACK)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64, device=values.device)
    return _to_int32((v << shifts).sum(-1))


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R/8, C]; field i of word j holds row 8j + i."""
    _check_nibbles(values)
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


def group_grid(wg: torch.Tensor, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit grid of each group of `wg` [..., group]: scales (float32 holding fp16 values, as stored)
    and zeros [...]. Asymmetric: min/max with q in [0, 15] and zero in [min_zero, 15]; symmetric: zero 8
    and scale 2 max|w| / 15, as GPTQ's sym=True."""
    if sym:
        scales = (2 * wg.abs().amax(-1) / 15).clamp(min=1e-6).half().float()
        return scales, torch.full_like(scales, 8)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    return scales, torch.round(-lo / scales).clamp(min_zero, 15)


def _round(w: torch.Tensor, group: int, sym: bool, min_zero: int = 0):
    """Round to nearest on each group's grid; returns q [in, out], zeros and scales [groups, out]."""
    wg = _groups(w, group)
    scales, zeros = group_grid(wg, sym, min_zero)
    q = torch.round(wg / scales[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).reshape(w.shape[0], -1)[:, :w.shape[1]]
    return q.t().to(torch.int32), zeros.t().to(torch.int32), scales.t().half()


# A grid: q [in, out] int32 in [0, 15], zeros [groups, out] int32 and scales [groups, out] fp16, with
# w[o, i] = (q[i, o] - zeros[g, o]) * scales[g, o] for g = i // group_size (as `_round` returns it).
Grid = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_awq(w: torch.Tensor, group_size: int = 128, grid: Grid | None = None) -> dict[str, torch.Tensor]:
    """A Linear weight [out, in] -> AutoAWQ GEMM's qweight, qzeros and scales; `grid`: already quantized
    (by a calibrated quantizer), only packed."""
    if w.shape[1] % group_size:
        raise ValueError(f"AWQ needs in_features ({w.shape[1]}) to be a multiple of group_size ({group_size})")
    q, z, s = grid if grid is not None else _round(w, group_size, sym=False)
    return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(z, AWQ_ORDER), "scales": s}


def min_zero(method: str, checkpoint_format: str = "gptq") -> int:
    """The least zero a format stores: GPTQ's v1 format ("gptq") stores zeros minus one, so an asymmetric
    grid keeps zeros >= 1 there (a zero of 0 cannot be stored: `pack_cols` refuses the -1)."""
    return 1 if method == "gptq" and checkpoint_format == "gptq" else 0


def quantize_gptq(w: torch.Tensor, group_size: int = 128, sym: bool = True, checkpoint_format: str = "gptq",
                  grid: Grid | None = None, act_order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A Linear weight [out, in] -> GPTQ's qweight, qzeros, scales and g_idx; `grid`: already quantized
    (by a calibrated quantizer), only packed. `act_order`: a permutation of the input rows (`desc_act`),
    grouped in that order: the grid of w[:, act_order], its rows stored back in input order and g_idx
    naming each row's group."""
    offset = min_zero("gptq", checkpoint_format)
    n = w.shape[1]
    groups_of_rows = (torch.arange(n) // group_size).to(torch.int32)
    if act_order is None:
        q, z, s = grid if grid is not None else _round(w, group_size, sym, min_zero=offset)
        g_idx = groups_of_rows
    else:
        if grid is not None:
            raise ValueError("quantize_gptq: a calibrated grid is in input order; act_order rounds its own")
        q, z, s = _round(w[:, act_order], group_size, sym, min_zero=offset)
        q = torch.empty_like(q).index_copy_(0, act_order, q)        # row act_order[r] is the grid's row r
        g_idx = torch.empty_like(groups_of_rows).index_copy_(0, act_order, groups_of_rows)
    return {"qweight": pack_rows(q), "qzeros": pack_cols(z - offset), "scales": s, "g_idx": g_idx}


def seeded_act_order(in_features: int) -> torch.Tensor:
    """The input-row order `write_checkpoint(desc_act=True)` groups a layer in: a permutation seeded by
    the input width, so that the shards that read one input (q/k/v, gate/up) share it, as GPTQ's order
    (by their common inputs' energy) is shared."""
    return torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))


def quantization_config(method: str, group_size: int = 128, sym: bool = True,
                        checkpoint_format: str = "gptq", desc_act: bool = False) -> dict:
    """The `quantization_config` entry of config.json as AutoAWQ / AutoGPTQ write it."""
    if method not in W4_METHODS:
        raise ValueError(f"4-bit method {method!r} is not supported; supported: {', '.join(W4_METHODS)}")
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": checkpoint_format}


def check_shape(key: str, w: torch.Tensor, method: str, group_size: int) -> None:
    """A weight [out, in] the 4-bit layout holds (as `W4Linear` reads it): eight values to a word along
    both dims; AWQ's groups whole."""
    out, n = w.shape
    awq = method == "awq"
    if out % PACK or n % PACK or awq and n % group_size:
        raise ValueError(f"checkpoint tensor {key!r} of shape {tuple(w.shape)} cannot be written as {method}: "
                         f"out_features and in_features must be multiples of {PACK}"
                         + (f", in_features of group_size ({group_size})" if awq else ""))


def check_grid(key: str, w: torch.Tensor, grid: Grid, group_size: int, sym: bool) -> None:
    """A calibrated grid fits the checkpoint it is written into: its shapes those of `w`'s groups of
    `group_size` (a grid of other groups would be packed under a group_size that misreads it), and with `sym`
    (GPTQ) every zero 8, what a symmetric checkpoint's readers may assume in place of its qzeros."""
    q, zeros, scales = grid
    out, n = w.shape
    groups = -(-n // group_size)
    if tuple(q.shape) != (n, out) or not tuple(zeros.shape) == tuple(scales.shape) == (groups, out):
        raise ValueError(f"the grid of {key!r} (q {tuple(q.shape)}, scales {tuple(scales.shape)}) does not fit "
                         f"its weight {tuple(w.shape)} in groups of {group_size}: q ({n}, {out}), zeros and "
                         f"scales ({groups}, {out})")
    if sym and not bool((zeros == 8).all()):
        raise ValueError(f"the grid of {key!r} has zeros other than 8, which a symmetric (sym=True) GPTQ "
                         "checkpoint stores: write an asymmetric grid with sym=False")


def quantize_state_dict(state: dict[str, torch.Tensor], method: str, group_size: int = 128, sym: bool = True,
                        checkpoint_format: str = "gptq", grids: dict[str, Grid] | None = None,
                        desc_act: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face names in, the quantized checkpoint's tensors out: `*.{q,k,v,o,gate,up,down}_proj.weight`
    become `.qweight/.qzeros/.scales` (GPTQ: and `.g_idx`), everything else is kept. `grids[key]`: that
    weight's grid from a calibrated quantizer (`gptq.py`); a weight without one is rounded to nearest
    (with `desc_act`, GPTQ only, in act-order groups: `seeded_act_order`)."""
    out = {}
    grids = grids or {}
    for key, t in state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in QUANTIZED_LAYERS:
            check_shape(key, t, method, group_size)
            grid = grids.get(key)
            if grid is not None:
                check_grid(key, t, grid, group_size, sym and method == "gptq")
            parts = (quantize_awq(t, group_size, grid) if method == "awq"
                     else quantize_gptq(t, group_size, sym, checkpoint_format, grid,
                                        seeded_act_order(t.shape[1]) if desc_act else None))
            out.update({f"{prefix}.{name}": v.contiguous() for name, v in parts.items()})
        else:
            out[key] = t.contiguous()
    return out


# the dtypes of an unquantized checkpoint's weights
PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_unquantized(state: dict[str, torch.Tensor], hf_config: dict) -> None:
    """The writers' input must be a plain checkpoint: one already quantized would have its FP8 values rounded
    again as if they were weights (their old scales copied beside the new ones) or its packed tensors copied
    under a new quantization_config, a checkpoint that loads with wrong weights or not at all."""
    qc = hf_config.get("quantization_config")
    if qc:
        raise ValueError(f"the checkpoint is already quantized (quantization_config quant_method="
                         f"{qc.get('quant_method')!r}); quantize its unquantized weights instead")
    for key, t in state.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix.rpartition(".")[2] in ("qkv_proj", "gate_up_proj"):
            # the writers quantize the unfused layers by name: a fused one would be copied as it is
            raise ValueError(f"checkpoint tensor {key!r} fuses several projections (as Phi-3's do); the writers "
                             "quantize q/k/v_proj and gate/up_proj apart: split it into them first")
        if prefix.rpartition(".")[2] in QUANTIZED_LAYERS and (leaf not in ("weight", "bias")
                                                              or t.dtype not in PLAIN_DTYPES):
            raise ValueError(f"checkpoint tensor {key!r} ({t.dtype}) is already quantized; quantize the "
                             "unquantized weights instead")


def check_out_dir(out_dir: str) -> None:
    """The writers write a new checkpoint: into a directory that holds one, the new model.safetensors and
    config.json would go beside its other weight files (a sharded source's index and shards, which the
    loaders then read with the new config), or over the source itself."""
    if not os.path.isdir(out_dir):
        return
    held = sorted(n for n in os.listdir(out_dir) if n == "config.json" or n.endswith((".safetensors",
                                                                                      ".safetensors.index.json")))
    if held:
        raise ValueError(f"{out_dir!r} already holds a checkpoint ({', '.join(held[:4])}); write the "
                         "quantized checkpoint to a new directory")


def write_checkpoint(out_dir: str, state: dict[str, torch.Tensor], hf_config: dict, method: str,
                     group_size: int = 128, sym: bool = True, checkpoint_format: str = "gptq",
                     grids: dict[str, Grid] | None = None, desc_act: bool = False) -> None:
    """Quantizes `state` (with `grids` where given, act-order groups with `desc_act`: see
    `quantize_state_dict`) and writes `model.safetensors` and `config.json` (with its quantization_config)."""
    from safetensors.torch import save_file
    check_unquantized(state, hf_config)
    check_out_dir(out_dir)
    qc = quantization_config(method, group_size, sym, checkpoint_format, desc_act)
    parse_w4_config(qc)             # what the loader would refuse (a group size, a format) is not written
    tensors = quantize_state_dict(state, method, group_size, sym, checkpoint_format, grids, desc_act)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(hf_config, quantization_config=qc)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
