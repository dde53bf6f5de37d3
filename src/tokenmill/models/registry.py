"""Model classes keyed by the `architectures[0]` entry of config.json."""
from __future__ import annotations

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    # its language model alone (text in, text out): the vision tower's tensors are skipped at load
    "Gemma3ForConditionalGeneration": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
}

# relatives of a served architecture that the Llama decoder cannot run, and why
_NOT_SERVED = {
    "GraniteMoeForCausalLM": "its MLP is a mixture of experts",
    "GraniteMoeSharedForCausalLM": "its MLP is a mixture of experts with a shared expert",
    "GraniteMoeHybridForCausalLM": "Granite 4's decoder: Mamba-2 layers, shared and mixture-of-experts MLPs",
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        why = _NOT_SERVED.get(cfg.architecture)
        why = f" ({why}, which tokenmill does not run)" if why else ""
        raise ValueError(f"unsupported architecture {cfg.architecture!r}{why}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None
