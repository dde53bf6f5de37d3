"""Zeroed int32 counters for kernels in which the last program of a group to finish does the group's
final step (decode attention's merge of its splits, the greedy argmax's reduction of its chunks)."""
from __future__ import annotations

import torch

_kept: dict[torch.device, list[torch.Tensor]] = {}


def zeroed(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 counters on `device`, from a buffer kept for the life of the process: a captured
    CUDA graph holds its address, so a buffer outgrown by a larger call stays allocated. The first is
    sized generously (decode attention needs one counter per sequence and kv head, the argmax one per
    row), and every launch on a device shares it, which holds because launches are ordered on one
    stream and each leaves the counters it used zeroed."""
    bufs = _kept.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]
