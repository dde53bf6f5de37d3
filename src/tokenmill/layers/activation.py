"""The gated MLP activation over a packed [gate | up] projection: act(gate) * up, `act` named as config.json names
it (`ModelConfig.hidden_act`): SiLU (Llama, Qwen, ...) or GELU's tanh approximation (Gemma 3)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.config_values import ACTIVATIONS


def check_activation(act: str) -> int:
    """The kernels' number of `act`, or an error naming the ones served."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def act_and_mul_torch(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    check_activation(act)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
