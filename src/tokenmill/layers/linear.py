"""Linear layers: cuBLAS through F.linear, except the few-row half-precision products of small-batch
decode on CUDA, which take the GEMV kernel (layers/kernels/gemv.py) because it reads the weights
closer to full bandwidth. The choice depends on shapes only, so it is fixed inside a CUDA graph."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.activation import silu_and_mul

# rows up to which the kernel beats cuBLAS on the H200 (scripts/device/gemv_bench.py); the variable
# TOKENMILL_GEMV_MAX_ROWS overrides it (0 turns the kernel off), for comparisons
GEMV_MAX_ROWS = int(os.environ.get("TOKENMILL_GEMV_MAX_ROWS", 8))


def _use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.dtype != torch.float32
            and weight.is_contiguous())


def _gemv(x, weight, bias=None, silu_mul=False):
    from tokenmill.layers.kernels import gemv
    return gemv.gemv(x, weight, bias, silu_mul)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_gemv(x, self.weight):
            return _gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_silu_mul(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a packed [gate | up] projection, in one kernel when the GEMV path applies."""
    if layer.bias is None and _use_gemv(x, layer.weight):
        return _gemv(x, layer.weight, silu_mul=True)
    return silu_and_mul(layer(x))
