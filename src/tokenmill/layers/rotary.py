"""Rotary position embedding (the rotate-half layout used by Llama and Qwen checkpoints): one cos/sin table per
model, [positions, head_dim], that every RoPE path (the torch reference, the Triton prologue and the one-kernel
decode) reads, rotating pair (i, i + head_dim/2) of each head by column i. Partial rotary (Phi-4-mini's 96 of 128)
is that table with identity columns past the rotated frequencies and q/k rows in `rotary_order`."""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config_values import finite_number


# the scaled kinds of config.json read here, and the keys each must hold as positive numbers
_SCALING_KEYS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("factor", "original_max_position_embeddings"),
                 # factor only sets the attention factor (`ModelConfig.from_hf` derives it where it is left out)
                 "longrope": ("factor", "original_max_position_embeddings")}
# YaRN's optional numbers (beta_fast and beta_slow absent, null or 0 are transformers' defaults, 32 and 1)
_YARN_NUMBERS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
_REFUSED = {"dynamic": "dynamic NTK scaling changes the frequencies with each sequence's length, so no one cos/sin "
                       "table serves a batch of sequences of different lengths"}


def _check_yarn(scaling: dict) -> None:
    bad = [k for k in _YARN_NUMBERS if scaling.get(k) is not None and not (finite_number(scaling[k]) and scaling[k] >= 0)]
    if bad or scaling.get("attention_factor") == 0:
        raise ValueError(f"rope_scaling of type 'yarn' takes beta_fast, beta_slow, mscale and mscale_all_dim as "
                         f"numbers >= 0 and attention_factor as a number > 0; got "
                         f"{', '.join(f'{k}={scaling[k]!r}' for k in bad or ['attention_factor'])}")
    if scaling["factor"] < 1:
        raise ValueError(f"rope_scaling of type 'yarn' needs factor >= 1 (the context's growth); got "
                         f"factor={scaling['factor']!r}")
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    if fast < slow:
        raise ValueError(f"rope_scaling of type 'yarn' needs beta_fast >= beta_slow (rotations that bound the "
                         f"interpolated band from above and below); got beta_fast={fast!r}, beta_slow={slow!r}")
    if scaling.get("truncate") not in (None, True, False):
        raise ValueError(f"rope_scaling of type 'yarn' takes truncate as true or false; got "
                         f"truncate={scaling['truncate']!r}")


def _check_longrope(scaling: dict, dim: int) -> None:
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if not (isinstance(factors, list) and len(factors) == dim // 2
                and all(finite_number(f) and f > 0 for f in factors)):
            shown = (f"{len(factors)} values {factors[:4]}{'...' if len(factors) > 4 else ''}"
                     if isinstance(factors, list) else repr(factors))
            raise ValueError(f"rope_scaling of type 'longrope' needs {name} as {dim // 2} positive numbers, one per "
                             f"rotary frequency of the {dim} rotated dims of a head; got {shown}")
    # vLLM's own keys, which transformers does not read: the two disagree on such a checkpoint
    given = [k for k in ("short_mscale", "long_mscale") if scaling.get(k) is not None]
    if given:
        raise ValueError(f"rope_scaling of type 'longrope' with {', '.join(f'{k}={scaling[k]!r}' for k in given)} is "
                         "not supported: transformers' LongRoPE has one attention factor (attention_factor, or one "
                         "derived from factor), which tokenmill reads")
    value = scaling.get("attention_factor")
    if value is not None and not (finite_number(value) and value > 0):
        raise ValueError(f"rope_scaling of type 'longrope' takes attention_factor as a positive number; got "
                         f"attention_factor={value!r}")


def longrope_uses_long_factors(scaling: dict, max_model_len: int) -> bool:
    """LongRoPE's factors, chosen once for the served context as vLLM chooses them: the long ones where
    max_model_len passes original_max_position_embeddings, the short ones otherwise. transformers chooses per
    forward pass by the sequence's length, which the paged cache cannot follow: its keys are stored rotated, and
    a sequence that grew past the original context would need every cached key rotated again. The two agree on
    every sequence where max_model_len is within the original context, and on every sequence longer than it
    where max_model_len is past it (llama.cpp chooses by its context size likewise)."""
    return max_model_len > scaling["original_max_position_embeddings"]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 where the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """What multiplies cos and sin (of the rotated dims), so that q.k grows by its square: YaRN's and LongRoPE's
    attention_factor, as given or derived from factor (YaRN's from mscale over mscale_all_dim where both are
    given; LongRoPE's sqrt(1 + ln factor / ln original_max_position_embeddings), short and long factors alike, as
    transformers and vLLM apply it); 1 for every other kind."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return _yarn_mscale(factor, scaling["mscale"]) / _yarn_mscale(factor, scaling["mscale_all_dim"])
    return _yarn_mscale(factor)


def _yarn_inv_freq(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Frequencies that turn fewer than beta_slow times over the original context are divided by factor
    (interpolated), those that turn more than beta_fast times stay (extrapolated), and the pairs between
    blend linearly. Pair i turns original_len * inv[i] / (2 pi) times; the pair index of r turns is solved
    for in closed form, then floored/ceiled unless truncate is false (or null, as transformers reads it;
    absent is true)."""
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def pair_of(turns: float) -> float:
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(scaling.get("beta_fast") or 32), pair_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001           # a band of no width: a step instead of a division by zero
    # 0 up to pair `low` (kept), 1 from pair `high` on (divided by factor)
    interpolated = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv / factor * interpolated + inv * (1 - interpolated)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None, max_model_len: int) -> torch.Tensor:
    """The rotary frequencies of `head_dim` rotated dims (a head's, or its rotary_dim); `max_model_len` (the
    served context) chooses LongRoPE's factors."""
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
    if kind in _REFUSED:
        raise ValueError(f"rope_scaling type {kind!r} is not supported: {_REFUSED[kind]}; supported: default, "
                         f"{', '.join(_SCALING_KEYS)}")
    if kind not in _SCALING_KEYS:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, {', '.join(_SCALING_KEYS)}")
    missing = [k for k in _SCALING_KEYS[kind] if not finite_number(scaling.get(k)) or scaling[k] <= 0]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {', '.join(_SCALING_KEYS[kind])} as positive "
                         f"numbers; got {', '.join(f'{k}={scaling.get(k)!r}' for k in missing)}")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "yarn":
        _check_yarn(scaling)
        return _yarn_inv_freq(inv, head_dim, theta, scaling)
    if kind == "longrope":
        _check_longrope(scaling, head_dim)
        factors = scaling["long_factor" if longrope_uses_long_factors(scaling, max_model_len) else "short_factor"]
        return inv / torch.tensor(factors, dtype=torch.float64)
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


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row p of a head of q and k, as the RoPE paths take it, is the checkpoint's row order[p]. A checkpoint
    with partial rotary (transformers' rotate_half over the first rotary_dim dims) pairs dim i with
    i + rotary_dim/2 and passes the dims from rotary_dim on through; the paths pair p with p + head_dim/2, by
    table column p, whose columns from rotary_dim/2 on are the identity (`RotaryEmbedding`). So each pair keeps
    its partner at p and p + head_dim/2, p < rotary_dim/2, and the passed-through dims fill the identity
    columns' places. q.k sums over a head's dims, which q and k share in one order, so attention is the
    checkpoint's; only the cached keys are in this order. The identity where rotary_dim is head_dim."""
    half, r = head_dim // 2, rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)
    return torch.cat((torch.arange(r), passed[:half - r], torch.arange(r, rotary_dim), passed[half - r:]))


class RotaryEmbedding(nn.Module):
    """`max_positions`: the served context, a row per position, which also chooses LongRoPE's factors;
    `rotary_dim`: the leading dims of a head the checkpoint rotates (None: all)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos_sin.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recomputes the table in float32 (after the module was built on the meta device)."""
        self.cos_sin = self._table().to(self.cos_sin.device)

    def _table(self) -> torch.Tensor:
        cpu = torch.device("cpu")
        inv = _inv_freq(self.rotary_dim, self.theta, self.scaling, self.max_positions).to(cpu)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64, device=cpu), inv)
        # [max_positions, head_dim]: cos in the first half, sin in the second, both times the attention
        # factor: every RoPE path (the torch reference and the Triton prologue and decode kernels) rotates
        # with this one table, so it scales q and k alike, and q.k by its square, wherever it runs. Past the
        # rotated frequencies (partial rotary) cos 1 and sin 0, unscaled, leave the dims `rotary_order` puts
        # there exactly as projected, as transformers passes them through
        factor = attention_factor(self.scaling)
        unrotated = self.head_dim // 2 - inv.numel()
        cos = torch.cat((freqs.cos() * factor, torch.ones(self.max_positions, unrotated, dtype=torch.float64)), -1)
        sin = torch.cat((freqs.sin() * factor, torch.zeros(self.max_positions, unrotated, dtype=torch.float64)), -1)
        return torch.cat((cos, sin), dim=-1).float()


class NoRotaryEmbedding(RotaryEmbedding):
    """The table of a NoPE layer (SmolLM3's `no_rope_layers`): cos 1 and sin 0 at every position. Every RoPE
    path rotates with it as with any table and leaves q and k exactly as they are: in float32, x * 1 - y * 0
    is x and y * 1 + x * 0 is y (a zero's sign aside), and no path does other work that depends on the
    position. One instance serves all the NoPE layers of a model."""

    def __init__(self, head_dim: int, max_positions: int):
        super().__init__(head_dim, max_positions, theta=0.0)      # no frequencies: theta is never read

    def _table(self) -> torch.Tensor:
        half = self.head_dim // 2
        return torch.cat((torch.ones(self.max_positions, half), torch.zeros(self.max_positions, half)), dim=-1)
