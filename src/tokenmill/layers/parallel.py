"""Tensor parallelism inside the model: which slice of a layer rank r holds, and the collectives that
join the slices (Megatron's split, as vLLM has it).

With N ranks, rank r holds
- column-parallel layers (qkv_proj, gate_up_proj): output features r*n .. (r+1)*n of each packed part
  (q, k, v; gate, up), so its attention runs query heads [r*Hq/N, (r+1)*Hq/N) over KV heads
  [r*Hkv/N, (r+1)*Hkv/N) (query head h reads KV head h // (Hq/Hkv), which stays on the same rank
  because Hkv % N == 0) and its MLP intermediate features [r*I/N, (r+1)*I/N);
- row-parallel layers (o_proj, down_proj): the matching input features; each rank's product is a
  partial sum over its features, and one all-reduce gives every rank the whole output;
- the embedding and the head by vocabulary rows [r*V/N, (r+1)*V/N): a token outside a rank's rows
  embeds as zeros there (the all-reduce adds exactly one nonzero row), and the head's logits are
  all-gathered along the vocabulary.

Everything else (norms, rotary tables) is replicated. Every rank must run the same sequence of
forward passes and head products, so that their collectives pair up (`runner/tensor_parallel.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# the parameter dimension that is split across ranks, by the last two parts of its name
SPLIT_DIMS = {
    "qkv_proj.weight": 0, "qkv_proj.bias": 0, "gate_up_proj.weight": 0,
    "o_proj.weight": 1, "down_proj.weight": 1,
    "embed_tokens.weight": 0, "lm_head.weight": 0,
}


def split_dim(name: str) -> int | None:
    """The dimension of parameter `name` that ranks split (None: every rank holds all of it)."""
    return SPLIT_DIMS.get(".".join(name.split(".")[-2:]))


class TensorParallel:
    """Rank `rank` of `size`. `group` (a torch.distributed process-group backend, gloo or NCCL) is set
    once every rank has joined, after the weights are loaded: the model's shapes need only rank and
    size, its forward pass needs the group."""

    def __init__(self, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
        self.rank, self.size = rank, size
        self.group = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x`, in place."""
        self.group.broadcast(x, 0).wait()
        return x

    def vocab_embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows `input_ids` of the whole embedding from this rank's rows `weight` (an all-reduce)."""
        rows = weight.shape[0]
        local = input_ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))
