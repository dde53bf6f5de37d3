"""GGUF checkpoints (llama.cpp's single-file format): metadata, tensor names and streamed weights.

The file is memory-mapped by the `gguf` package's reader; each tensor is dequantized on its own (one
float32 copy of that tensor on the host), unpermuted where llama.cpp permuted it, and copied into its
parameter through `loader.fill_parameters`, which packs q/k/v and gate/up and checks that every
parameter was filled and no tensor was left over. Config and tokenizer come from the same metadata
(`ModelConfig.from_gguf`, `engine/gguf_tokenizer.py`).
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

# general.architecture -> our registry key
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGML tensor types dequantized at load (names of gguf.GGMLQuantizationType)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

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
_LAYER_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> Python value), `tensors` (name -> reader tensor).

    Opening checks what can be checked before any weight is read: the header parses, every tensor's
    bytes lie inside the file, and every tensor type is one tokenmill dequantizes."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"GGUF file {self.path!r} does not exist")
        size = os.path.getsize(self.path)
        try:
            reader = gguf.GGUFReader(self.path)
        except ValueError as e:
            unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))
            if unknown:
                raise ValueError(f"GGUF file {self.path!r} has a tensor of unknown GGML type id "
                                 f"{unknown.group(1)}; tokenmill reads {', '.join(SUPPORTED_TYPES)}") from None
            raise ValueError(f"cannot read GGUF file {self.path!r} ({size} bytes): truncated or not a GGUF "
                             f"file ({e})") from None
        except (IndexError, OSError) as e:
            raise ValueError(f"cannot read GGUF file {self.path!r} ({size} bytes): truncated or not a GGUF "
                             f"file ({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise ValueError(f"GGUF file {self.path!r} is truncated: tensor {t.name!r} ends at byte {end}, "
                                 f"the file has {size} bytes")
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(f"GGUF tensor {t.name!r} in {self.path!r} has quantization type "
                                 f"{t.tensor_type.name}; tokenmill dequantizes {', '.join(SUPPORTED_TYPES)}")
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _value(field)

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF file {self.path!r} has architecture {arch!r}; tokenmill supports "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
        return arch

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, dequantized to float32, in PyTorch's (out_features, in_features) order."""
        import gguf

        t = self.tensors[name]
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:        # an F32 tensor is the memory map itself
            array = array.copy()
        return torch.from_numpy(array)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The opened file, shared by the config, the tokenizer and the weight load of one engine start
    (parsing the header of a 49k-token vocabulary takes seconds); keyed by size and mtime, so a file
    rewritten in place is opened again."""
    path = os.path.realpath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    return _open_cached(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _value(field):
    """A metadata field as a Python value (strings decoded, arrays as lists)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor name (unknown names are returned unchanged, so
    the load reports them as left over)."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _LAYER_KEY.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return gguf_name


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores a llama q/k projection with each head's rows reordered for interleaved RoPE
    (row 2i and 2i+1 of a head are rows i and i + head_dim/2 of the Hugging Face layout, which rotates
    halves). This undoes that: per head, (head_dim/2, 2) rows back to (2, head_dim/2)."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {num_heads} heads")
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(file: GGUFFile, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, Any]]:
    """`(hf_key, read)` pairs for `loader.fill_parameters`; `read()` dequantizes one tensor."""
    permute = file.architecture == "llama"
    for name in file.tensor_names:
        key = hf_name(name)
        heads = None
        if permute and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = num_heads
        elif permute and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = num_kv_heads

        def read(name=name, heads=heads):
            w = file.read(name)
            return w if heads is None else unpermute_rows(w, heads)
        yield key, read


def load_gguf_weights(model: nn.Module, path: str) -> None:
    from tokenmill.runner.loader import fill_parameters

    file = open_gguf(path)
    cfg = model.config
    fill_parameters(model, gguf_tensors(file, cfg.num_attention_heads, cfg.num_key_value_heads), repr(path))
