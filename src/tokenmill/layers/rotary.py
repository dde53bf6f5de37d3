"""Rotary position embedding (the rotate-half layout used by Llama and Qwen checkpoints)."""
from __future__ import annotations

import math

import torch
from torch import nn


# the scaled kinds of config.json read here, and the keys each reads
_SCALING_KEYS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "freq_factors":
        # a GGUF file's rope_freqs tensor (ModelConfig.from_gguf): one divisor per rotary frequency, the
        # llama3 scaling already evaluated by the converter
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float64)
        if factors.shape != inv.shape or not bool(torch.isfinite(factors).all() and (factors > 0).all()):
            raise ValueError(f"RoPE freq_factors must be {inv.numel()} positive finite numbers (one per rotary "
                             f"frequency of head_dim {head_dim}); got {tuple(factors.shape)} values")
        return inv / factors
    if kind not in _SCALING_KEYS:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, {', '.join(_SCALING_KEYS)}")
    missing = [k for k in _SCALING_KEYS[kind] if not isinstance(scaling.get(k), (int, float)) or scaling[k] <= 0]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {', '.join(_SCALING_KEYS[kind])} as positive "
                         f"numbers; got {', '.join(f'{k}={scaling.get(k)!r}' for k in missing)}")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2] in float32. Computed in float32, returned in x.dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos_sin.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recomputes the table in float32 (after the module was built on the meta device)."""
        cpu = torch.device("cpu")
        inv = _inv_freq(self.head_dim, self.theta, self.scaling).to(cpu)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64, device=cpu), inv)
        # [max_positions, head_dim]: cos in the first half, sin in the second
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
        self.cos_sin = table.to(self.cos_sin.device)
