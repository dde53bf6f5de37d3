"""Model classes keyed by the `architectures[0]` entry of config.json."""
from __future__ import annotations

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None
