"""Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while the
kernel before it in the stream is finishing, so its launch and ramp-up overlap that kernel's tail.

Every kernel launched with `launch_pdl=enabled(device)` must call `gdc_wait()` (the previous kernel has
completed and its writes are visible) before it reads any input a previous kernel may write, or writes
anything; before that it may only read weights. It calls `gdc_launch_dependents()` after its wait, so
the next kernel is launched once this one is past its own wait, never further ahead. A batch-1 decode
step is a chain of a few hundred short kernels, which is where this pays.

`TOKENMILL_PDL=0` turns it off (for A/B benchmarks).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

ENABLED = os.environ.get("TOKENMILL_PDL", "1") != "0"


@lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda" and _supported(device.index or 0)
