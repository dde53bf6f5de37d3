"""Checkpoint tensors into a model's parameters, packed ones (q/k/v, gate/up) by shard, with the check
that every parameter was filled and no tensor was left over; the safetensors and GGUF loads share it, and
`checkpoint_layout`, which puts a checkpoint's tensors in the model's layout first (FP8 quantization at load
included)."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.parallel import split_dim
from tokenmill.layers.rotary import rotary_order
from tokenmill.quant import fp8
from tokenmill.quant.formats import Fp8Config

# keys some checkpoints carry that hold no learned state
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def fill_parameters(model: nn.Module, tensors, source: str) -> None:
    """Copies `(hf_key, read)` pairs into the model's (possibly packed) parameters, calling `read()`
    only for keys the model uses, so one checkpoint tensor at a time is materialised. Ends by checking
    that every parameter (every shard of a packed one) was filled and no key was left over; `source`
    names the checkpoint in those errors.

    A tensor-parallel model (`model.tp`) takes only its rank's slice of each split parameter
    (`parallel.split_dim`): `read(index)` then returns the checkpoint tensor indexed by that tuple of
    slices, which a safetensors file reads without materialising the rest."""
    cfg = model.config
    tp = getattr(model, "tp", None)
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {name: set() for name in params}
    leftover: list[str] = []
    for key, read in tensors:
        if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        name, shard = packed_target(model, key)
        if name not in params:
            # GPTQ-for-LLaMa and older AutoGPTQ write a zero bias for every quantized linear (as vLLM,
            # skipped); a nonzero one is a bias the model lacks
            quant = getattr(cfg, "quantization", None)
            if not (key.endswith(".bias") and quant is not None and quant.method == "gptq" and not read().any()):
                leftover.append(key)
            continue
        param = params[name]
        split = split_dim(name) if tp is not None else None
        if (0 if shard is None else shard) in filled[name]:
            # two files of one checkpoint holding the tensor: the later one replaced the earlier unseen
            raise ValueError(f"checkpoint tensor {key!r} appears twice in {source} (fills {name!r} again)")
        if shard is None:
            tensor = read() if split is None else read(_rank_slice(split, tp.rank, param.shape[split]))
            _copy(param.data, tensor, key)
            filled[name].add(0)
        else:
            owner, _, leaf = name.rpartition(".")
            # shards are concatenated along the output features: dim 0 of a plain weight or bias; a
            # packed 4-bit tensor says where (`W4Linear.output_dims`: its dim, features per element)
            dim, per = getattr(model.get_submodule(owner), "output_dims", {}).get(leaf, (0, 1))
            sizes = model.shard_sizes(owner.rpartition(".")[2])
            # a rank's part of a packed shard: the shard's features split along the output (dim 0)
            tensor = read() if split is None else read(_rank_slice(split, tp.rank, sizes[shard]))
            start = sum(sizes[:shard])
            if start % per or sizes[shard] % per:
                raise ValueError(f"checkpoint tensor {key!r}: shard of {sizes[shard]} features at {start} "
                                 f"does not fall on whole elements of {per} packed features")
            _copy(param.data.narrow(dim, start // per, sizes[shard] // per), tensor, key)
            filled[name].add(shard)
        del tensor
    if leftover:
        raise ValueError(f"checkpoint keys not used by {cfg.architecture}: {leftover[:8]}"
                         f"{' ...' if len(leftover) > 8 else ''} ({len(leftover)} in all)")
    missing = []
    for name, shards in filled.items():
        if len(shards) < num_shards(model, name.rpartition(".")[0]):
            missing.append(name)
    if missing:
        raise ValueError(f"parameters missing from the checkpoint {source}: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")


def _rank_slice(dim: int, rank: int, length: int) -> tuple[slice, ...]:
    """Rank `rank`'s `length` entries along `dim`."""
    return (slice(None),) * dim + (slice(rank * length, (rank + 1) * length),)


def num_shards(model: nn.Module, layer: str) -> int:
    """How many checkpoint layers the model's `layer` is packed from (q/k/v, gate/up; else 1)."""
    packed = layer.rpartition(".")[2]
    return len(model.shard_sizes(packed)) if packed in ("qkv_proj", "gate_up_proj") else 1


def packed_target(model: nn.Module, key: str) -> tuple[str, int | None]:
    """A checkpoint key -> the model's name for it and the shard it is of a packed layer (None: not packed)."""
    for shard_name, (packed, index) in model.packed_modules.items():
        part = f".{shard_name}."
        if part in key:
            return key.replace(part, f".{packed}."), index
    return key, None


def _copy(dst: torch.Tensor, src: torch.Tensor, key: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
    # a quantized tensor (packed integers, FP8) is read as stored: a cast would change its meaning (a bf16
    # weight of a "dense" checkpoint copied into FP8 is scaled twice); float weights may cast
    if (not dst.dtype.is_floating_point or dst.dtype.itemsize == 1) and src.dtype != dst.dtype:
        raise ValueError(f"checkpoint tensor {key!r} is {src.dtype}, the model expects {dst.dtype}")
    if dst.dtype.is_floating_point and not src.dtype.is_floating_point:
        # integers (or bools) where the model has float weights: cast, they loaded a model of noise
        raise ValueError(f"checkpoint tensor {key!r} is {src.dtype}, the model expects floating point ({dst.dtype})")
    dst.copy_(src)


def checkpoint_layout(model: nn.Module, tensors):
    """`(key, read)` pairs of a checkpoint (safetensors or GGUF) in the layout `fill_parameters` takes: a
    tensor that holds a packed layer's shards whole (Phi-3's qkv_proj and gate_up_proj) as those shards
    (`_split_fused`), where RoPE rotates part of a head, q's and k's rows in the order the RoPE paths rotate
    (`rotary.rotary_order`), and where the model quantizes plain weights at load (--quantization fp8), each
    decoder linear weight then quantized per output channel (`fp8.quantize_at_load`). Quantizing last gives
    every source the same bytes: it keys on the shards' names (q_proj, gate_proj, ...), which a fused tensor
    has only once split, and per-row scales commute with the split and the row order."""
    stream = _reorder_rotary_rows(model, _split_fused(model, tensors))
    quant = getattr(model.config, "quantization", None)
    if isinstance(quant, Fp8Config) and quant.checkpoint_format is None:
        stream = fp8.quantize_at_load(stream)
    return stream


def _split_fused(model: nn.Module, tensors):
    """A fused `...{packed}.{leaf}` tensor as its shards' keys, in the model's packed order (q, k, v; gate, up:
    the order transformers' Phi3 splits them in). Each shard lies along the output features where the
    packed layer says (`output_dims`, as `fill_parameters` stacks them); a read of the whole shard reads the
    fused tensor once for all of them, a rank's read (`read(index)`, tensor parallelism: plain weights along
    their rows) only its rows."""
    shards: dict[str, list[str]] = {}
    for shard, (packed, index) in sorted(model.packed_modules.items(), key=lambda item: item[1]):
        shards.setdefault(packed, []).append(shard)
    tp = getattr(model, "tp", None)
    for key, read in tensors:
        prefix, _, leaf = key.rpartition(".")
        owner, _, packed = prefix.rpartition(".")
        layer = submodule(model, prefix) if packed in shards else None
        if layer is None:
            yield key, read
            continue
        dim, per = getattr(layer, "output_dims", {}).get(leaf, (0, 1))
        sizes = [n * (1 if tp is None else tp.size) for n in model.shard_sizes(packed)]
        whole: list[torch.Tensor] = []

        def part(start: int, size: int, index=None, read=read, whole=whole, dim=dim, per=per) -> torch.Tensor:
            if index is None:
                if not whole:
                    whole.append(read())
                return whole[0].narrow(dim, start // per, size // per)
            rows = index[-1]
            return read((*index[:-1], slice(start + rows.start, start + rows.stop)))
        for i, name in enumerate(shards[packed]):
            yield f"{owner}.{name}.{leaf}", lambda index=None, start=sum(sizes[:i]), size=sizes[i]: part(
                start, size, index)


def _reorder_rotary_rows(model: nn.Module, tensors):
    """q's and k's rows (weights and biases) reordered head by head by `rotary_order`, where RoPE rotates part
    of a head; a rank's read (whole heads) reordered alike."""
    cfg = model.config
    if cfg.rope_dim == cfg.head_dim:
        yield from tensors
        return
    order = rotary_order(cfg.head_dim, cfg.rope_dim)

    def reordered(w: torch.Tensor) -> torch.Tensor:
        heads = w.shape[0] // cfg.head_dim
        return w.reshape(heads, cfg.head_dim, *w.shape[1:])[:, order].reshape(w.shape)
    for key, read in tensors:
        if key.endswith((".q_proj.weight", ".k_proj.weight", ".q_proj.bias", ".k_proj.bias")):
            yield key, lambda index=None, read=read: reordered(read() if index is None else read(index))
        else:
            yield key, read


def submodule(model: nn.Module, name: str) -> nn.Module | None:
    """The module named `name`, or None where the model has none (a checkpoint key it lacks)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
