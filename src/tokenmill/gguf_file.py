"""A GGUF file (llama.cpp's single-file format) opened for reading: metadata values and tensors, each
dequantized on its own from the memory map by the `gguf` package. The config (`ModelConfig.from_gguf`),
the tokenizer (`engine/gguf_tokenizer.py`) and the weights (`runner/gguf_loader.py`) read it."""
from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np
import torch

# general.architecture -> our registry key
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGML tensor types dequantized at load (names of gguf.GGMLQuantizationType)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


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
