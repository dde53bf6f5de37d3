"""The decoder's linear layers: `Linear` (`nn.Linear`, with the CPU's few-row product), `W4Linear` for a
4-bit AWQ/GPTQ checkpoint, or `fp8_linear.Fp8Linear` for FP8 weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.backend import TorchBackend
from tokenmill.quant.formats import Fp8Config, W4Config
from tokenmill.quant.quantize import pack_cols
from tokenmill.quant.w4 import PACK, unpack, unpack_cols


class Linear(nn.Linear):
    """`nn.Linear`, but on the CPU a float32 product of 2-8 rows with a weight larger than the caches is
    taken as W x^T: torch's x W^T there (MKL's sgemm for a few rows of a transposed operand) runs up to
    twice as long (docs/BENCHMARKS.md, "A few rows of a large weight on the CPU")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, size = x.shape[0], self.weight.numel()
        wide = 2 <= rows <= 4 and size >= 4 << 20 or 2 <= rows <= 8 and size >= 16 << 20
        if x.is_cuda or x.dim() != 2 or not wide or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        out = (self.weight @ x.t()).t()
        return (out if self.bias is None else out + self.bias).contiguous()


def linear(in_features: int, out_features: int, bias: bool, quant: W4Config | Fp8Config | None) -> nn.Module:
    if quant is None:
        return Linear(in_features, out_features, bias=bias)
    if isinstance(quant, Fp8Config):
        from tokenmill.layers.fp8_linear import Fp8Linear
        return Fp8Linear(in_features, out_features, bias, quant)
    return W4Linear(in_features, out_features, bias, quant)


def repack_w4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, quant: W4Config,
              in_features: int, input_perm: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's checkpoint tensors (AWQ or GPTQ, `quant/w4.py`) -> the one layout the products read,
    output-major like `nn.Linear.weight` so that a row of W is contiguous (with `input_perm`, an act-order
    checkpoint's `w4.act_order_perm`: W's input k is the checkpoint's input_perm[k]):

    - `qweight` int32 [out, in/8]: word j of row n packs W's 4-bit values at inputs 8j .. 8j+7, input
      8j + i in field i (bits 4i..4i+3);
    - `scales` fp16 [out, groups] and `zeros` uint8 [out, groups]: W[n, k] = (q - zeros[n, g]) * scales[n, g]
      with g = k // group_size; the zeros are the true ones (GPTQ v1's offset already added).

    The values are those of `w4.dequantize` on the checkpoint tensors, bit for bit (`dequantize_w4`)."""
    q, z = unpack(qweight, qzeros, quant, in_features)                             # [in, out], [groups, out]
    if input_perm is not None:
        q = q[input_perm]
    return pack_cols(q.t()).contiguous(), scales.t().contiguous(), z.t().to(torch.uint8).contiguous()


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] in float32 from `repack_w4`'s tensors: the reference the W4 kernels are tested against."""
    q = unpack_cols(qweight)                                                         # [out, in]
    groups = torch.arange(q.shape[1], device=q.device) // group_size
    return (q - zeros[:, groups].to(torch.int32)).float() * scales[:, groups].float()


class W4Linear(nn.Module):
    """y = x W^T + b with W kept as 4-bit values, so the weights take 4 bits each (plus one fp16 scale and
    an 8-bit zero per group and output feature).

    It is built with the checkpoint's tensors (`qweight`, `qzeros`, `scales` as `quant/w4.py` lays them
    out), which the loader fills; `process_weights_after_loading` then repacks them into `repack_w4`'s
    output-major layout (`qweight`, `scales`, `zeros`), the only one kept and the one every backend's
    `w4_linear` reads: AWQ and GPTQ run the same kernels and the same reference.

    `output_dims[name] = (dim, per)`: checkpoint tensor `name` lays the layer's output features along
    `dim`, `per` of them to an element; the loader packs q/k/v and gate/up shards along it
    (`fill.fill_parameters`).

    An act-order GPTQ checkpoint's groups are not runs of consecutive input rows: the loader passes
    the order that makes them so (`set_act_order`), the repacked weight keeps its rows in that order, and
    `forward` gathers the input features into it (`input_perm`) before the product."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: W4Config):
        super().__init__()
        if out_features % PACK:
            raise ValueError(f"a 4-bit layer needs out_features ({out_features}) divisible by {PACK}")
        if in_features % PACK:
            raise ValueError(f"a 4-bit layer needs in_features ({in_features}) divisible by {PACK}")
        if quant.method == "awq" and in_features % quant.group_size:
            raise ValueError(f"an AWQ layer needs in_features ({in_features}) to be a multiple of "
                             f"group_size ({quant.group_size})")
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        groups = quant.num_groups(in_features)
        if quant.method == "awq":
            qweight_shape, self.output_dims = (in_features, out_features // PACK), {"qweight": (1, PACK)}
        else:
            qweight_shape, self.output_dims = (in_features // PACK, out_features), {"qweight": (1, 1)}
        self.output_dims.update(qzeros=(1, PACK), scales=(1, 1), bias=(0, 1))

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.qweight = param(*qweight_shape, dtype=torch.int32)
        self.qzeros = param(groups, out_features // PACK, dtype=torch.int32)
        self.scales = param(groups, out_features, dtype=torch.float16)
        self.register_parameter("zeros", None)
        self.register_buffer("input_perm", None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.backend = TorchBackend()

    def keep_checkpoint_dtypes(self) -> None:
        """Scales stay fp16 as stored whatever the model dtype (`build_model` casts the model first)."""
        self.scales.data = self.scales.data.to(torch.float16)

    def set_act_order(self, input_perm: torch.Tensor) -> None:
        """The checkpoint's act-order (`w4.act_order_perm`), given by the loader before the repacking."""
        if self.zeros is not None:
            raise RuntimeError("W4Linear: the act-order comes before the repacking")
        self.input_perm = input_perm.to(torch.int64)

    def process_weights_after_loading(self) -> None:
        """Replaces the checkpoint's tensors by `repack_w4`'s (once, after the loader filled them)."""
        if self.zeros is not None:
            raise RuntimeError("W4Linear: the weights are already repacked")
        qweight, scales, zeros = repack_w4(self.qweight.data, self.qzeros.data, self.scales.data, self.quant,
                                           self.in_features, self.input_perm)
        del self.qzeros
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.zeros = nn.Parameter(zeros, requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """W [out, in] in float32 from the repacked tensors (its inputs in `input_perm`'s order)."""
        return dequantize_w4(self.qweight, self.scales, self.zeros, self.quant.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        return self.backend.w4_linear(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.quant.method}, "
                f"group_size={self.quant.group_size}, act_order={self.input_perm is not None}, "
                f"bias={self.bias is not None}")
