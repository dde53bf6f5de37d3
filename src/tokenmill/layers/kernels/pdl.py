"""Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while the
kernel before it in the stream is still running, so its launch, ramp-up and weight reads overlap that
kernel's work.

Each kernel launched with `launch_pdl=enabled(device)` takes `PDL=enabled(device)` and calls
`enter(PDL)` before it reads any input a previous kernel may write, or writes anything; before that it
may only read what no kernel of the forward pass writes: weights, the step's metadata (copied to the
device before the pass) and the KV cache of earlier steps. `enter` first signals that the next kernel
may launch, then waits until the previous kernel has completed and its writes are visible: a chain of
short kernels (attention between two products) lets the next product launch and fetch its weights
while they run. Waiting is transitive (a kernel completes only after its own wait), so a kernel also
sees everything written before its predecessor. A batch-1 decode step is a chain of a few hundred
short kernels, which is where this pays.

Two kernels that share no data run side by side the same way: the first calls `release` as it starts, the
second, launched with it, reads nothing the first writes and calls `wait` as its last statement, so that
its completion still implies the first's for the kernels after it (a mixed step's decode rows and its
prefill chunks, `paged_attention.py`).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (CUDA, sm90 or newer)."""
    return device.type == "cuda" and _supported(device.index or 0)


@triton.jit
def enter(PDL: tl.constexpr):
    release(PDL)
    wait(PDL)


@triton.jit
def release(PDL: tl.constexpr):
    # the next kernel may launch (the first half of `enter`)
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    # until the previous kernel has completed and its writes are visible (the second half of `enter`)
    if PDL:
        gdc_wait()
