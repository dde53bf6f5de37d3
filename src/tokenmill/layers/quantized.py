"""The decoder's linear layers: `nn.Linear`, or `W4Linear` for a 4-bit AWQ/GPTQ checkpoint."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.backend import TorchBackend
from tokenmill.quant.w4 import PACK, W4Config


def linear(in_features: int, out_features: int, bias: bool, quant: W4Config | None) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias) if quant is None else \
        W4Linear(in_features, out_features, bias, quant)


class W4Linear(nn.Module):
    """y = x W^T + b with W kept as the checkpoint's packed 4-bit tensors (`quant/w4.py` has the layouts),
    so the weights take 4 bits each (plus one fp16 scale and a 4-bit zero per group and column). The
    product is the backend's `w4_linear`: the reference dequantizes W on every call and caches nothing,
    so memory stays 4-bit (the full-precision W of one layer lives only during its product).

    `output_dims[name] = (dim, per)`: parameter `name` lays the layer's output features along `dim`, `per`
    of them to an element; the loader packs q/k/v and gate/up shards along it (`fill.fill_parameters`)."""

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
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.backend = TorchBackend()

    def keep_checkpoint_dtypes(self) -> None:
        """Scales stay fp16 as stored whatever the model dtype (`build_model` casts the model first)."""
        self.scales.data = self.scales.data.to(torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.w4_linear(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.quant.method}, "
                f"group_size={self.quant.group_size}, bias={self.bias is not None}")
