"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference: returns (norm(x + residual) * weight, x + residual); residual is None when not given.

    Statistics are computed in float32 and the result cast back, as Hugging Face Llama/Qwen do.
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


class RMSNorm(nn.Module):
    """An RMSNorm's weight and eps; the model's backend computes it (`rms_norm`), or folds it into the
    product after it (`gemv.fused_linear`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
