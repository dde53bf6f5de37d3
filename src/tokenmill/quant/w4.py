"""4-bit weight-only checkpoints (W4A16): AutoAWQ's GEMM format and GPTQ's, as they lie on disk.

Layout facts relied on (read, no code taken, in: GPTQModel's AWQ GEMM module, `AWQ_ORDER` =
(0, 2, 4, 6, 1, 3, 5, 7) and its inverse; AutoAWQ's `unpack_awq`, shifts 0, 4, ..., 28 along the packed
output dim; AutoGPTQ's `zeros -= 1` before packing, as a qzeros-overflow checker citing its
qlinear_triton.py describes it; the vLLM GPTQv2 write-up on v1's and v2's zero points; GPTQ-style
QuantLinear buffers, qweight (in // 32 * bits, out); public reference GPTQ decoders: qweight unpacked
along the input dim, qzeros along the output dim, zero offset 1 by the AutoGPTQ/GPTQModel convention):

- Every tensor is int32 words of eight 4-bit fields; field i is bits 4i..4i+3 (least significant first).
  A weight w[out, in] of a Linear is stored transposed, input-major: `[in, out]` before packing.
- AWQ GEMM: `qweight` int32 [in, out/8] and `qzeros` int32 [in/group, out/8] pack 8 neighbouring output
  columns per word in the interleaved order `AWQ_ORDER`: field i holds column 8j + AWQ_ORDER[i].
  `scales` [in/group, out] (fp16). w = (q - z) * s. `in` must be a multiple of the group size.
- GPTQ: `qweight` int32 [in/8, out] packs 8 consecutive input rows per word in plain order (field i holds
  row 8j + i); `qzeros` int32 [groups, out/8] packs 8 output columns in plain order; `scales`
  [groups, out]; `g_idx` int32 [in] names each input row's group. groups = ceil(in / group): the last
  group may be partial. The v1 format (`checkpoint_format` "gptq", what AutoGPTQ and most published
  checkpoints write) stores zero - 1 and readers add the 1 back (so a true zero of 0 cannot be stored: it
  wraps to 15 and reads as 16, which AutoGPTQ's own kernels also do); "gptq_v2" (GPTQModel) stores the
  zero itself. Symmetric checkpoints store zero 8 (v1: 7) everywhere; the dequantization is the same.
- act-order (`desc_act: true`): the rows stay in input order, but a group is no longer a run of
  consecutive rows: g_idx names each row's group (GPTQ groups the rows in its order of quantization, by
  descending input energy). Each group still holds `group_size` rows (the last one the rest), so sorting
  the rows by g_idx makes the groups contiguous again (`act_order_perm`); a layer read that way takes its
  input features in the same order.
"""
from __future__ import annotations

import torch

from tokenmill.quant.formats import W4Config

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # field i of a word holds output column AWQ_ORDER[i]
PACK = 8                                       # 4-bit fields per int32 word


def act_order_perm(g_idx: torch.Tensor, in_features: int, group_size: int, key: str) -> torch.Tensor | None:
    """A GPTQ layer's g_idx [in] -> None where every input row i is in group i // group_size, else the
    permutation of the input rows (int64 [in]) that makes each group a run of consecutive rows: row r of
    the permuted layer is input perm[r], and group g holds rows g * group_size onwards. A g_idx that does
    not give each group `group_size` rows (the last one the rest) is refused, naming `key`."""
    want = torch.arange(in_features, device=g_idx.device) // group_size
    if g_idx.dim() != 1 or g_idx.numel() != in_features:
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(g_idx.shape)}, the model expects "
                         f"({in_features},)")
    g_idx = g_idx.to(want.dtype)
    if torch.equal(g_idx, want):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], want):
        raise ValueError(f"checkpoint tensor {key!r} does not put group_size={group_size} of the "
                         f"{in_features} input rows in each of groups 0-{int(want[-1])} (the last the rest)")
    return perm


# The unpacking builds no tensor from host data (no torch.tensor(list), no list index), so it runs inside a
# CUDA-graph capture, where host-to-device copies are not allowed.
def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=device)


def unpack_cols(packed: torch.Tensor, awq_order: bool = False) -> torch.Tensor:
    """int32 [R, C/8] -> int32 [R, C] of 4-bit values: field i of word j is column 8j + i, or with
    `awq_order` column 8j + AWQ_ORDER[i]."""
    fields = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 0xF         # [R, C/8, 8] by field
    if awq_order:
        # AWQ_ORDER puts fields 0-3 on the even columns and 4-7 on the odd ones: as a [2, 4] grid of
        # fields read column-major, column 2b + a is field 4a + b
        fields = fields.unflatten(-1, (2, 4)).transpose(-1, -2)
    return fields.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> int32 [R, C]: field i of word j is row 8j + i."""
    fields = (packed.unsqueeze(1) >> _shifts(packed.device)[None, :, None]) & 0xF     # [R/8, 8, C]
    return fields.reshape(-1, packed.shape[1])


def unpack(qweight: torch.Tensor, qzeros: torch.Tensor, cfg: W4Config, in_features: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's packed checkpoint tensors -> its 4-bit values [in, out] and true zeros [groups, out]
    (GPTQ v1's stored offset added), int32."""
    if cfg.method == "awq":
        return unpack_cols(qweight, awq_order=True), unpack_cols(qzeros, awq_order=True)
    return unpack_rows(qweight)[:in_features], unpack_cols(qzeros) + cfg.zero_offset


def dequantize_grid(grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor], group_size: int) -> torch.Tensor:
    """A grid (q [..., in, out] 4-bit values, true zeros and scales [..., groups, out]; stacked grids too)
    -> the weight [..., out, in] in float32 it stands for: (q - zero) * scale of each input's group."""
    q, zeros, scales = grid
    rows = torch.arange(q.shape[-2], device=q.device) // group_size               # [in] -> group
    return ((q - zeros[..., rows, :]).float() * scales[..., rows, :].float()).transpose(-1, -2)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, cfg: W4Config,
               in_features: int) -> torch.Tensor:
    """The weight [out, in] in float32 from a layer's packed checkpoint tensors: the reference of the
    checkpoint layouts, which the repacked layout the kernels read is tested against."""
    return dequantize_grid((*unpack(qweight, qzeros, cfg, in_features), scales), cfg.group_size)

