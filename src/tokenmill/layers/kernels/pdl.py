"""Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while the
kernel before it in the stream is still running, so its launch, ramp-up and weight reads overlap that
kernel's work.

Each kernel launched with `launch_pdl=mode(device) > 0` takes `PDL=mode(device)` and calls
`enter(PDL)` before it reads any input a previous kernel may write, or writes anything; before that it
may only read what no kernel of the forward pass writes: weights, the step's metadata (copied to the
device before the pass) and the KV cache of earlier steps. `enter` waits until the previous kernel has
completed and its writes are visible, and signals that the next kernel may launch: after the wait
(mode 1), so launches run at most one kernel ahead, or before it (mode 2), so a chain of short kernels
(attention between two products) lets the next product launch and fetch its weights while they run.
Waiting is transitive (a kernel completes only after its own wait), so a kernel also sees everything
written before its predecessor.
A batch-1 decode step is a chain of a few hundred short kernels, which is where this pays.

`TOKENMILL_PDL=0|1|2` picks the mode (for A/B benchmarks); `TOKENMILL_PDL_ATTENTION=1|2` the decode
attention kernel's alone (with 1 the product after attention launches only once the one before
attention has finished, so what it fetches before its wait overlaps attention alone).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MODE = int(os.environ.get("TOKENMILL_PDL", "2"))
ATTENTION_MODE = int(os.environ.get("TOKENMILL_PDL_ATTENTION", "0")) or None


@lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def mode(device: torch.device, kernel_mode: int | None = None) -> int:
    """The mode for a kernel on `device`: 0 where programmatic dependent launch is off or unsupported,
    else `kernel_mode` if given, else MODE."""
    if MODE == 0 or device.type != "cuda" or not _supported(device.index or 0):
        return 0
    return kernel_mode or MODE


@triton.jit
def enter(PDL: tl.constexpr):
    if PDL == 2:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
