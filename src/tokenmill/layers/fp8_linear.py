"""`Fp8Linear`: a decoder linear layer with FP8 E4M3 weights and float32 block scales (`quant/fp8.py` has
the formats). Weights take one byte each; the product is the backend's `fp8_linear`."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.backend import TorchBackend
from tokenmill.quant.fp8 import FP8
from tokenmill.quant.formats import Fp8Config


class Fp8Linear(nn.Module):
    """y = x W^T + b, W = weight * scale of its block (`block`: (1, in) per channel, or the checkpoint's
    (128, 128)). The scale parameter takes the checkpoint's name (`weight_scale` or `weight_scale_inv`), so
    the loader fills it like any tensor; `output_dims` tells it how q/k/v and gate/up shards stack: a scale
    row covers `block_n` output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: Fp8Config):
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        self.block = quant.block(in_features)
        self.scale_name = quant.scale_name
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.register_parameter(self.scale_name, nn.Parameter(
            torch.empty(*quant.scale_shape(out_features, in_features), dtype=torch.float32), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.output_dims = {self.scale_name: (0, self.block[0])}
        self.backend = TorchBackend()

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    def keep_checkpoint_dtypes(self) -> None:
        """FP8 weights and float32 scales whatever the model dtype (`build_model` casts the model first)."""
        self.weight.data = self.weight.data.to(FP8)
        self.scale.data = self.scale.data.to(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.fp8_linear(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, "
                f"block={self.block}, bias={self.bias is not None}")
