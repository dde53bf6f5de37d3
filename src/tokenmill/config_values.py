"""What ModelConfig (model_config.py) and its readers (hf_config.py, gguf_config.py) share, apart from the config
itself, so that the readers need not import it: dtype names, the number checks a config's values pass,
Granite's scalars, the MLP's activations and the every-n-th-layer NoPE pattern."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# dtype names -> torch's attribute
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


DTYPE_CHOICES = ("auto", *_DTYPES)      # what --dtype takes

# Granite's four scalars, as config.json names them (transformers' default for each is 1.0, the attention's
# softmax scale included), and the GGUF keys llama.cpp's converter writes them under (where a key is left
# out, or 0, llama.cpp takes the neutral value: 1, and for the attention 1/sqrt(head_dim))
GRANITE_MULTIPLIERS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                       "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


# the MLP's gated activations served (`ModelConfig.hidden_act`, `layers/activation.py`), as config.json names
# them, and the number the kernels take each as (their ACT constexpr; 0: no activation)
ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2}


def rope_all_but_every(interval: int, layers: int) -> tuple[bool, ...]:
    """Per layer, whether it rotates: all but every `interval`-th (layers interval - 1, 2 interval - 1, ...)."""
    return tuple((i + 1) % interval != 0 for i in range(layers))


def finite_number(value: Any) -> bool:
    """A JSON number of a config (not a boolean, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive(value: Any) -> bool:
    """A positive finite JSON number."""
    return finite_number(value) and value > 0


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype:
    """A dtype or its name -> the dtype; None -> float32."""
    import torch
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    key = str(value).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of {sorted(set(_DTYPES))}")
    return getattr(torch, _DTYPES[key])
