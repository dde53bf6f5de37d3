"""`compile_ahead` on the GPU: launches inside it run nothing and compile each specialization once, in its
pool; after it the same launches run without compiling; a failed compile raises when the block ends; the
launch method is restored either way. (Triton's interpreter, the CPU's path, compiles nothing.)"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_testing import gpu
from triton import knobs
from triton.runtime.jit import JITFunction

from tokenmill.runner.compile_ahead import compile_ahead

pytestmark = [pytest.mark.gpu, gpu]


@triton.jit
def _add_kernel(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    tl.static_assert(VALUE > 0)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + VALUE, mask=mask)


def test_launches_inside_compile_only_and_run_compiled_after():
    x = torch.zeros(100, device="cuda")
    with compile_ahead(threads=4) as done:
        for value in (1, 2, 3, 1):          # the last is the first's specialization again
            _add_kernel[(1,)](x, 100, VALUE=value, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.all(x == 0), "a launch inside compile_ahead ran"
    assert (done.specializations, done.threads) == (3, 4)
    assert "__getitem__" not in JITFunction.__dict__
    compiled = []
    knobs.runtime.jit_cache_hook = lambda *, repr, **_: compiled.append(repr)
    try:
        for value in (1, 2, 3):
            _add_kernel[(1,)](x, 100, VALUE=value, BLOCK=128)
    finally:
        knobs.runtime.jit_cache_hook = None
    torch.cuda.synchronize()
    assert compiled == [] and torch.all(x == 6)


def test_a_failed_compile_raises_and_restores_the_launch():
    x = torch.zeros(100, device="cuda")
    with pytest.raises(triton.CompilationError):
        with compile_ahead(threads=2):
            _add_kernel[(1,)](x, 100, VALUE=0, BLOCK=128)
    assert "__getitem__" not in JITFunction.__dict__
    _add_kernel[(1,)](x, 100, VALUE=5, BLOCK=128)     # compiled and run as ever, not sent to the closed pool
    torch.cuda.synchronize()
    assert torch.all(x == 5)
