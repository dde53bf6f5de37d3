"""Triton specializations compiled side by side before the CUDA graph capture (`compile_ahead`).

The capture launches each graph key's forward once before recording it, and each launch of a Triton kernel
with a specialization not in the cache (split counts, row tiles, each graph size's divisibility) compiles
it then, one after the other: most of an engine's start in an empty Triton cache. Triton's compiler
releases the GIL in its passes and in ptxas, so compiles in threads overlap. Within `compile_ahead()` a
kernel launch (`kernel[grid](...)`) only submits its specialization's compile to a thread pool (Triton's
async compile mode with `warmup=True`) and runs nothing; one forward pass per graph key inside it hands the
pool every specialization, and the capture after it finds them compiled.

The forward passes inside it compute garbage and are discarded: their Triton kernels do not run, torch's
do on whatever the skipped kernels left. They must write nothing that outlives them: the graphs' static
inputs address no KV slot (slot -1) and index only rows they hold. The launch method is patched on the
class for the whole process, so nothing else may launch Triton kernels meanwhile: the engine's start
owns its process (and its GPU) until the capture is done.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class CompiledAhead:
    """What a `compile_ahead` block compiled: distinct specializations, on how many threads."""
    specializations: int = 0
    threads: int = 0


@contextmanager
def compile_ahead(threads: int | None = None) -> Iterator[CompiledAhead]:
    """Within it, `kernel[grid](...)` submits the launch's specialization to a pool of `threads` compiles
    (default: the CPUs this process may run on) instead of running it; yields a `CompiledAhead`, filled
    once every compile has finished. A compile that fails raises on exit; the launch method is restored
    either way."""
    from triton.runtime._async_compile import AsyncCompileMode, active_mode
    from triton.runtime.jit import JITFunction

    def submit_only(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)

    threads = threads or len(os.sched_getaffinity(0))
    done = CompiledAhead(threads=threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        mode = AsyncCompileMode(pool)
        try:
            with mode:
                JITFunction.__getitem__ = submit_only
                try:
                    yield done
                finally:
                    del JITFunction.__getitem__
        finally:
            # Triton's exit leaves its mode active where a compile raised: every later launch in the process
            # would then submit its compile to this pool, shut down
            active_mode.set(None)
        done.specializations = len(mode.future_kernels)
