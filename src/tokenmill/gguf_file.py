"""A GGUF file (llama.cpp's single-file format) opened for reading: its header parsed here, metadata
values and tensors, each tensor dequantized on its own from the memory map by the `gguf` package. The
config (`ModelConfig.from_gguf`), the tokenizer (`engine/gguf_tokenizer.py`) and the weights
(`runner/gguf_loader.py`) read it."""
from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

# general.architecture -> our registry key
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's architecture of a multimodal model's projector file (its mmproj: the vision or audio encoder alone)
_PROJECTOR_ARCHITECTURE = "clip"

# GGML tensor types dequantized at load (names of gguf.GGMLQuantizationType), each one that gguf's numpy
# dequantizer (>= 0.11) reads as ggml does. Q5_0 and Q5_1 are what llama.cpp writes in a K-quant file for
# rows that are not whole 256-value K blocks (SmolLM2's 576, Qwen2's 896), IQ4_NL likewise in an i-quant
# file; Q2_K and Q3_K make up the Q2_K and Q3_K_S/M mixes, the IQ types the i-quant ones; TQ1_0 and TQ2_0
# are ternary (BitNet b1.58, TriLM)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                   "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")


class GGUFTensor(NamedTuple):
    """A tensor's entry in the file: `shape` in GGUF's order (innermost dimension first), its bytes at
    `offset` from the file's start."""
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> Python value), `tensors` (name -> `GGUFTensor`).

    Opening checks what can be checked before any weight is read: the header parses, every tensor's
    bytes lie inside the file, and every tensor type is one tokenmill dequantizes. The header is parsed
    here from the memory map (a 49k-token vocabulary's strings in a tenth of a second; the `gguf` package's
    reader takes seconds over them), and `gguf` dequantizes the tensors."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"GGUF file {self.path!r} does not exist")
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        try:
            self.metadata, self.tensors = _parse(self._map)
        except _Truncated as e:
            raise ValueError(f"cannot read GGUF file {self.path!r} ({size} bytes): truncated or not a GGUF "
                             f"file ({e})") from None
        except _UnknownType as e:
            raise ValueError(f"GGUF file {self.path!r} has a tensor of unknown GGML type id {e}; tokenmill "
                             f"reads {', '.join(SUPPORTED_TYPES)}") from None
        for t in self.tensors.values():
            end = t.offset + t.n_bytes
            if end > size:
                raise ValueError(f"GGUF file {self.path!r} is truncated: tensor {t.name!r} ends at byte {end}, "
                                 f"the file has {size} bytes")
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(f"GGUF tensor {t.name!r} in {self.path!r} has quantization type "
                                 f"{t.tensor_type.name}; tokenmill dequantizes {', '.join(SUPPORTED_TYPES)}")
            # a quantized row is whole blocks (`_parse` counts its bytes so)
            block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
            if t.shape[:1] and t.shape[0] % block:
                raise ValueError(f"GGUF tensor {t.name!r} in {self.path!r} has rows of {t.shape[0]} values, not "
                                 f"a multiple of the {block}-value blocks of its type {t.tensor_type.name}")

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch == _PROJECTOR_ARCHITECTURE:
            raise ValueError(f"GGUF file {self.path!r} has architecture {arch!r}: it is a multimodal model's projector "
                             "(llama.cpp's mmproj file, an image or audio encoder), not a language model; tokenmill "
                             "serves text in, text out from the model's own GGUF file (gemma-3-4b-it's text, say)")
        if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF file {self.path!r} has architecture {arch!r}; tokenmill supports "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
        return arch

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, dequantized to float32, in PyTorch's (out_features, in_features) order."""
        import gguf
        import torch       # here, not at the top: an API server reads a GGUF's tokenizer without torch

        t = self.tensors[name]
        shape = tuple(reversed(t.shape))
        if t.tensor_type.name in ("F32", "F16"):
            dtype = np.float32 if t.tensor_type.name == "F32" else np.float16
            data = np.frombuffer(self._map, dtype, math.prod(shape), t.offset).reshape(shape)
        else:   # bytes, as many a row as its blocks take
            data = np.frombuffer(self._map, np.uint8, t.n_bytes, t.offset).reshape(
                gguf.quants.quant_shape_to_byte_shape(shape, t.tensor_type))
        array = np.asarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
        if not array.flags.writeable:        # an F32 tensor is the memory map itself
            array = array.copy()
        return torch.from_numpy(array)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The opened file, shared by the config, the tokenizer and the weight load of one engine start (one
    parse and one memory map); keyed by size and mtime, so a file rewritten in place is opened again."""
    path = os.path.realpath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    return _open_cached(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


# GGUF metadata value types: the scalars' struct formats (standard sizes), then string and array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    pass


class _UnknownType(Exception):
    pass


class _Header:
    """A cursor over the header's little-endian fields."""

    def __init__(self, buf):
        self.buf, self.off = buf, 0

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.buf, self.off)
        except struct.error:
            raise _Truncated(f"the header ends at byte {len(self.buf)}") from None
        self.off += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        end = self.off + n
        if end > len(self.buf):
            raise _Truncated(f"a string of {n} bytes at byte {self.off} runs past the end")
        text = self.buf[self.off:end].decode("utf-8", errors="replace")
        self.off = end
        return text

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[etype])
                if self.off + count * dtype.itemsize > len(self.buf):
                    raise _Truncated(f"an array of {count} values at byte {self.off} runs past the end")
                values = np.frombuffer(self.buf, dtype, count, self.off).tolist()
                self.off += count * dtype.itemsize
                return values
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise _Truncated(f"unknown metadata value type {vtype} at byte {self.off}")
        return self.unpack("<" + _SCALARS[vtype])[0]


def _parse(buf) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata, tensors) of a GGUF file's bytes (v2 or v3, little-endian)."""
    import gguf

    h = _Header(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise _Truncated("no GGUF magic")
    (version,) = h.unpack("<4xI")
    if version not in (2, 3):
        raise _Truncated(f"GGUF version {version} (big-endian or unknown); tokenmill reads 2 and 3")
    tensor_count, kv_count = h.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = h.string()
        (vtype,) = h.unpack("<I")
        metadata[key] = h.value(vtype)
    infos = []
    for _ in range(tensor_count):
        name = h.string()
        (n_dims,) = h.unpack("<I")
        dims = h.unpack(f"<{n_dims}Q")
        raw_type, offset = h.unpack("<IQ")
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise _UnknownType(raw_type) from None
        infos.append((name, qtype, dims, offset))
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Truncated(f"general.alignment {align!r} is not a power of two")
    data_start = -(-h.off // align) * align
    tensors = {}
    for name, qtype, dims, offset in infos:
        if name in tensors:
            raise _Truncated(f"tensor {name!r} appears twice")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        tensors[name] = GGUFTensor(name, qtype, dims, data_start + offset, math.prod(dims) * type_size // block)
    return metadata, tensors
