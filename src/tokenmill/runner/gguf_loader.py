"""GGUF checkpoints (llama.cpp's single-file format): metadata, tensor names and streamed weights.

The file is memory-mapped by the `gguf` package's reader; each tensor is dequantized on its own (one
float32 copy of that tensor on the host), unpermuted where llama.cpp permuted it, put in the model's
layout by `fill.checkpoint_layout` (phi3's fused attn_qkv and ffn_up split, partial rotary's q/k order;
with --quantization fp8, each decoder linear weight then quantized per output channel, as a plain
safetensors checkpoint's is) and copied into its parameter through `fill.fill_parameters`, which packs
q/k/v and gate/up and checks that every parameter was filled and no tensor was left over. Config and
tokenizer come from the same metadata (`ModelConfig.from_gguf`, `engine/gguf_tokenizer.py`).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import torch
from torch import nn

from tokenmill.gguf_config import GGUF_LONGROPE
from tokenmill.gguf_file import GGUFFile, open_gguf
from tokenmill.runner.fill import checkpoint_layout, fill_parameters

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# llama.cpp's phi3 stores Phi-3's fused tensors as they are: q/k/v rows in attn_qkv, gate then up rows in ffn_up
_PHI3_LAYER = {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma's four norms a layer: ffn_norm is the MLP's input norm there (pre_feedforward_layernorm), and
# post_attention_norm and post_ffw_norm normalise the attention's and the MLP's outputs
_GEMMA_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_LAYERS = {"phi3": _PHI3_LAYER, "gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER}
# tensors that ModelConfig.from_gguf reads into the config (not parameters): Llama 3's RoPE divisors, LongRoPE's
# factors
CONFIG_TENSORS = ("rope_freqs.weight", *GGUF_LONGROPE)
_LAYER_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor name in a file of `architecture` (unknown names are
    returned unchanged, so the load reports them as left over)."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    layer = _LAYERS.get(architecture, _LAYER)
    m = _LAYER_KEY.fullmatch(gguf_name)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"
    return gguf_name


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores a llama (smollm3, granite) q/k projection with each head's rows reordered for
    interleaved RoPE (row 2i and 2i+1 of a head are rows i and i + head_dim/2 of the Hugging Face layout,
    which rotates halves). This undoes that: per head, (head_dim/2, 2) rows back to (2, head_dim/2)."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {num_heads} heads")
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(file: GGUFFile, num_heads: int, num_kv_heads: int,
                 device: torch.device | str = "cpu") -> Iterator[tuple[str, Any]]:
    """`(hf_key, read)` pairs for `fill.fill_parameters`; `read()` dequantizes one tensor (on the host) and
    gives it on `device`, the model's: what follows (the unpermute, FP8 quantization at load) runs where a
    safetensors checkpoint's tensors, opened on that device, run it, so both give the same bytes."""
    # llama.cpp's converter permutes q/k for the architectures it rotates in interleaved pairs (its
    # LLAMA_ROPE_TYPE_NORM): llama, and smollm3 and granite, converted as llama is (qwen2, qwen3, phi3 and the
    # gemmas rotate halves, as transformers does: their rows are as they were)
    permute = file.architecture in ("llama", "smollm3", "granite")
    for name in file.tensor_names:
        if name in CONFIG_TENSORS:
            continue
        key = hf_name(name, file.architecture)
        heads = None
        if permute and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = num_heads
        elif permute and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = num_kv_heads

        def read(name=name, heads=heads):
            w = file.read(name).to(device)
            return w if heads is None else unpermute_rows(w, heads)
        yield key, read


def load_gguf_weights(model: nn.Module, path: str) -> None:
    file = open_gguf(path)
    cfg = model.config
    device = next(model.parameters()).device
    tensors = gguf_tensors(file, cfg.num_attention_heads, cfg.num_key_value_heads, device)
    fill_parameters(model, checkpoint_layout(model, tensors), repr(path))
