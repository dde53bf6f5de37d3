"""An experiment, measured before it moves into src: Triton specializations compiled side by side before
the CUDA graph capture, against the capture as it is, which compiles each specialization the first time
a forward pass launches it, one after the other.

On a fresh machine (an empty Triton cache) an engine's start takes ~110 s on the H200 (nanbeige4.1-3b,
FP8 weights and KV cache, 1ad64dc), 28 s with the cache warm: the rest is compiling (decode split
counts, row tiles, each graph size's divisibility). Triton's compiler releases the GIL in its passes and
in ptxas: six sm90 specializations of the fused decode attention compile in 9.0-9.4 s one after the other
and 5.1-5.2 s on two threads of the 2-core CPU machine (`sm90` below). Within `compile_ahead()`, a kernel launch only submits
its specialization's compile to a thread pool (Triton's async compile mode with `warmup=True`) and runs
nothing; a pass over every graph key's forward before the capture hands the pool every specialization,
and the capture after it finds them compiled. The forward passes of that pass compute garbage (their
Triton kernels do not run; the capture's static inputs write no KV slot) and are discarded.

On the CPU machine (no GPU: sm90 compiled through lab/sm90_compare/dump.py's specializations):
  python lab/compile_ahead.py sm90 serial; python lab/compile_ahead.py sm90 threads
On the GPU machine, each start in a fresh Triton cache (scripts/device/compile_ahead.sh):
  python lab/compile_ahead.py check                  # the mechanism on a toy kernel
  TRITON_CACHE_DIR=$(mktemp -d) python lab/compile_ahead.py ready ahead  MODEL [--quantization fp8 ...]
  TRITON_CACHE_DIR=$(mktemp -d) python lab/compile_ahead.py ready serial MODEL [...]
Each `ready` prints the seconds to a ready engine, the capture's summary and the greedy tokens of a fixed
prompt (equal in both modes if the graphs are).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from triton.runtime._async_compile import AsyncCompileMode
from triton.runtime.jit import JITFunction


@dataclass
class CompiledAhead:
    """What a `compile_ahead` block compiled: distinct specializations, on how many threads."""
    specializations: int = 0
    threads: int = 0


def _submit_only(self, grid):
    return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)


@contextmanager
def compile_ahead(threads: int | None = None):
    """Within it, `kernel[grid](...)` compiles the launch's specialization in a pool of `threads`
    (default: the CPUs this process may run on) instead of running it; yields a `CompiledAhead`, filled
    once every compile has finished. A compile that fails raises on exit."""
    threads = threads or len(os.sched_getaffinity(0))
    done = CompiledAhead(threads=threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        mode = AsyncCompileMode(pool)
        with mode:
            # warmup=True: Triton compiles (in the pool, under the async mode) and launches nothing
            JITFunction.__getitem__ = _submit_only
            try:
                yield done
            finally:
                del JITFunction.__getitem__
        done.specializations = len(mode.future_kernels)


def capture_compiled_ahead():
    """Patches `CudaGraphRunner.capture` so that a pass over every graph key, inside `compile_ahead`,
    comes before the capture; its summary gains what that pass compiled and how long it took."""
    from tokenmill.runner.cuda_graphs import CudaGraphRunner
    capture = CudaGraphRunner.capture

    def ahead_then_capture(self, emulate: bool = False) -> None:
        note = ""
        if not emulate:
            t0 = time.perf_counter()
            keys = self._keys()
            self._init_buffers(keys)     # capture allocates them again (small; in src the pass would share them)
            with compile_ahead() as compiled:
                for key in keys:            # any order: nothing is captured, each pass's memory is freed
                    self.static_forward(key)()
            note = (f"; before it, {compiled.specializations} specializations compiled ahead on "
                    f"{compiled.threads} threads in {time.perf_counter() - t0:.1f} s")
        capture(self, emulate)
        self.summary += note
    CudaGraphRunner.capture = ahead_then_capture


def check() -> None:
    """Launches inside `compile_ahead` run nothing and compile each specialization once; after it they run
    without compiling; a failed compile raises when the block ends; the launch method is restored."""
    import torch
    import triton
    import triton.language as tl
    from triton import knobs

    @triton.jit
    def add_kernel(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
        tl.static_assert(VALUE > 0)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + VALUE, mask=mask)

    x = torch.zeros(100, device="cuda")
    with compile_ahead(threads=4) as done:
        for value in (1, 2, 3, 1):          # the last is the first's specialization again
            add_kernel[(1,)](x, 100, VALUE=value, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.all(x == 0), "a launch inside compile_ahead ran"
    assert (done.specializations, done.threads) == (3, 4), done
    assert "__getitem__" not in JITFunction.__dict__
    compiled = []
    knobs.runtime.jit_cache_hook = lambda *, repr, **_: compiled.append(repr)
    try:
        for value in (1, 2, 3):
            add_kernel[(1,)](x, 100, VALUE=value, BLOCK=128)
    finally:
        knobs.runtime.jit_cache_hook = None
    torch.cuda.synchronize()
    assert compiled == [] and torch.all(x == 6), (compiled, x[:4])
    try:
        with compile_ahead(threads=2):
            add_kernel[(1,)](x, 100, VALUE=0, BLOCK=128)
        raise AssertionError("a failed compile did not raise")
    except triton.CompilationError:
        pass
    assert "__getitem__" not in JITFunction.__dict__
    print("check: ok")


def ready(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="compile_ahead.py ready")
    p.add_argument("mode", choices=["ahead", "serial"])
    p.add_argument("model")
    p.add_argument("--quantization")
    p.add_argument("--kv-cache-dtype", default="auto")
    a = p.parse_args(argv)
    if a.mode == "ahead":
        capture_compiled_ahead()
    t0 = time.perf_counter()
    from tokenmill import LLM, SamplingParams
    llm = LLM(a.model, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
    seconds = time.perf_counter() - t0
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    print(f"{a.mode}: ready in {seconds:.1f} s; graphs {llm.engine.runner.graph_summary}; "
          f"tokens {list(out[0].outputs[0].token_ids)}", flush=True)


def sm90(how: str) -> None:
    """Six specializations of the fused decode attention (qwen3-4b's split counts) compiled for sm90 in a
    fresh Triton cache, one after the other or on a pool of the machine's CPUs; no GPU needed."""
    import tempfile
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    dump = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_compare", "dump.py")
    names = {"__name__": "dump"}
    argv, sys.argv = sys.argv, ["dump.py", os.path.dirname(os.path.dirname(dump)), os.devnull, "none"]
    exec(compile(open(dump).read(), dump, "exec"), names)     # defines its compile helpers; compiles none
    sys.argv = argv
    specs = [(32, 8, True, splits, stages) for splits, stages in ((32, 1), (17, 2), (9, 2), (16, 2), (8, 2), (4, 2))]
    t0 = time.perf_counter()
    if how == "serial":
        for spec in specs:
            names["fused"](*spec)
    else:
        with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
            list(pool.map(lambda spec: names["fused"](*spec), specs))
    print(f"{how}: {len(specs)} specializations in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["check"]:
        check()
    elif sys.argv[1:2] == ["sm90"]:
        sm90(sys.argv[2])
    else:
        ready(sys.argv[2:] if sys.argv[1:2] == ["ready"] else sys.argv[1:])
