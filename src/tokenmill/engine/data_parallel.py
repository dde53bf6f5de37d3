"""`DataParallelLLM`: N engine cores (`tokenmill serve --data-parallel-size N`) behind one frontend.

Each core is a normal engine-core process with its own model copy, KV cache and prefix cache, driven by
an `AsyncLLM` of this process. A new request goes to one core (`PrefixRouter`: prefix-cache affinity,
bounded by the sequences in flight to each); its aborts and stop strings follow it there (the owning
`AsyncLLM` sends them). Stats are those of all cores together. The interface is `AsyncLLM`'s, so the
server serves either unchanged.

On CUDA, core i takes device i (or k + i after `cuda:k`); on the CPU the cores share the host's cores.
A core that dies makes the whole frontend dead: the server then exits 1, as with one core.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from multiprocessing import connection as mp_connection
from typing import AsyncIterator, Callable

from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
from tokenmill.engine.core_client import EngineCore, EngineStartError
from tokenmill.engine.dp_router import PrefixRouter
from tokenmill.engine.tokenizer import import_tokenizer_modules

# the stats that are levels or counts of each core and add up across cores; the two usage ratios are
# recomputed from the summed blocks
_RATIOS = ("kv_cache_usage", "cpu_cache_usage")


def core_devices(device: str, size: int) -> list[str]:
    """Each core's device: `cuda:i` (from `cuda:k`: `cuda:k+i`) when the device is CUDA, else `device`."""
    import torch
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return [device] * size
    first = int(device.partition(":")[2] or 0)
    available = torch.cuda.device_count()
    if first + size > available:
        raise ValueError(f"data_parallel_size={size} from {device} needs CUDA devices {first}..{first + size - 1}, "
                         f"but {available} are visible")
    return [f"cuda:{first + i}" for i in range(size)]


def core_configs(config, size: int) -> list:
    """One engine config per core: its device, and on the CPU its share of the host's cores (each core
    would otherwise take all but one, and oversubscribed OpenMP threads spin)."""
    devices = core_devices(config.device, size)
    threads = max(1, ((os.cpu_count() or 2) - 1) // size)
    return [dataclasses.replace(config, device=dev,
                                extra={**config.extra, **({"cpu_threads": threads} if dev == "cpu" else {})})
            for dev in devices]


def aggregate_stats(parts: list[dict]) -> dict:
    """All cores' stats as one core's: counts, tokens and histograms' bucket counts summed, usage as used
    over total blocks (so a core with more blocks weighs more); `peak_blocks_used` is the sum of the cores'
    peaks."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if key not in _RATIOS and isinstance(value, (int, float)):
                out[key] = out.get(key, 0) + value
            elif isinstance(value, list):          # a histogram's counts per bucket
                out[key] = [a + b for a, b in zip(out.get(key) or [0] * len(value), value)]
    total = out.get("num_total_blocks", 0)
    out["kv_cache_usage"] = (total - out.get("num_free_blocks", 0)) / total if total else 0.0
    cpu = out.get("num_cpu_blocks", 0)
    out["cpu_cache_usage"] = 1.0 - out.get("num_free_cpu_blocks", 0) / cpu if cpu else 0.0
    return out


class DataParallelLLM:
    """`AsyncLLM`'s interface over several cores, one `AsyncLLM` each (`start` starts them)."""

    def __init__(self, cores: list[AsyncLLM], block_size: int, procs: list[EngineCore] = (),
                 router: PrefixRouter | None = None):
        """`cores`: the cores' clients; `procs`: the core processes this frontend owns (joined at
        shutdown)."""
        self.cores = cores
        self._procs = list(procs)
        self.config = cores[0].config
        self.router = router or PrefixRouter(len(cores), block_size)
        self.loads = [0] * len(cores)             # sequences in flight from here to each core (n a request)
        self._owner: dict[str, int] = {}          # request id -> its core, while in flight
        self.dead: str | None = None
        self._dead_callbacks: list[Callable[[str], None]] = []
        for i, core in enumerate(cores):
            core.on_dead(lambda why, i=i: self._core_dead(i, why))
        first = cores[0]
        self.model_name, self.vocab_size = first.model_name, first.vocab_size
        self.scheduling_policy = first.scheduling_policy       # every core's: they share one config
        # a core on a device with less free memory may hold a shorter context (its KV cache sized to what
        # fits): the server's length check must pass only requests that every core can take
        self.max_model_len = min(core.max_model_len for core in cores)
        self.tokenizer, self.processor = first.tokenizer, first.processor

    @classmethod
    def start(cls, config, size: int, *, engine_factory: str | None = None,
              startup_timeout: float = 600.0, while_starting: Callable[[], None] | None = None) -> "DataParallelLLM":
        """Starts `size` engine cores (`core_configs`) and their clients; `while_starting` as `AsyncLLM`'s."""
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        try:
            configs = core_configs(config, size)
        except ValueError as e:
            raise EngineStartError(str(e)) from None
        # the cores load their models at the same time and are taken as they announce themselves, so that one
        # that fails is reported (by its index and device) at once, not after the others have loaded
        procs: list[EngineCore] = []
        try:
            for i, c in enumerate(configs):
                procs.append(EngineCore(c, engine_factory=engine_factory, startup_timeout=startup_timeout,
                                        wait=False, name=f"engine core {i} of {size} ({c.device})"))
            import_tokenizer_modules(config.tokenizer or config.model)
            if while_starting is not None:
                while_starting()
            waiting, deadline = {proc.pipes[0]: proc for proc in procs}, time.monotonic() + startup_timeout
            while waiting:
                ready = mp_connection.wait(list(waiting), max(0.0, deadline - time.monotonic())) or list(waiting)
                for conn in ready:
                    waiting.pop(conn).await_ready()      # raises if the core failed, or past its deadline
            cores: list[AsyncLLM] = []
            for c, proc in zip(configs, procs):     # the same model's tokenizer, loaded once
                cores.append(AsyncLLM(c, client=proc.clients[0], tokenizer=cores[0].tokenizer if cores else None))
        except BaseException:          # a core that failed to start, or Ctrl-C: none of them is left running
            for proc in procs:
                proc.abandon()
            raise
        engine = cls(cores, config.block_size, procs)
        engine.config = config
        return engine

    # ----- lifecycle -------------------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop | None = None):
        for core in self.cores:
            core.attach(loop)

    def on_dead(self, callback: Callable[[str], None]):
        self._dead_callbacks.append(callback)

    def _core_dead(self, index: int, why: str):
        if self.dead:
            return
        self.dead = f"engine core {index} of {len(self.cores)}: {why}"
        # the server is dead as a whole (it exits 1): the other cores' requests end now, as the dead one's did
        for core in self.cores:
            if not core.dead:
                core.fail_all(EngineDeadError(self.dead))
        for cb in self._dead_callbacks:
            cb(self.dead)

    def shutdown(self, timeout: float = 10.0):
        """Every core is told to stop before any is waited for."""
        for core in self.cores:
            core.shutdown()
        for proc in self._procs:
            proc.join(timeout)

    @property
    def pid(self) -> int | None:
        return self.cores[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [core.pid for core in self.cores]

    @property
    def on_output(self):
        return self.cores[0].on_output

    @on_output.setter
    def on_output(self, hook):
        for core in self.cores:
            core.on_output = hook

    # ----- requests --------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return sum(core.num_unfinished for core in self.cores)

    async def generate(self, request_id: str, prompt: str | list[int], params, priority: int = 0,
                       arrival_time: float | None = None, carries_tools: bool = False,
                       stream_interval: int = 1) -> AsyncIterator:
        if self.dead:
            raise EngineDeadError(self.dead)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt
        if isinstance(prompt, str):         # the server passes token ids; a text is encoded again in the core's client
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        index = self.router.choose(ids, self.loads, getattr(params, "cache_salt", None))
        self._owner[request_id] = index
        # a request of n choices runs n sequences on its core, of its seats, blocks and steps
        weight = getattr(params, "n", 1) or 1
        self.loads[index] += weight
        gen = self.cores[index].generate(request_id, prompt, params, priority, arrival_time, carries_tools,
                                         stream_interval)
        try:
            async for out in gen:
                yield out
        finally:
            self.loads[index] -= weight
            del self._owner[request_id]
            await gen.aclose()       # an abandoned request is aborted in its core

    def abort(self, request_id: str | list[str]):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_core: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._owner:
                by_core.setdefault(self._owner[rid], []).append(rid)
        for index, rids in by_core.items():
            self.cores[index].abort(rids)

    def fail_all(self, error: BaseException) -> int:
        return sum(core.fail_all(error) for core in self.cores)

    async def get_stats(self, max_age: float = 0.0, timeout: float = 2.0) -> dict:
        return aggregate_stats(await self.core_stats(max_age, timeout))

    async def core_stats(self, max_age: float = 0.0, timeout: float = 2.0) -> list[dict]:
        """Each core's own stats, in core order."""
        return list(await asyncio.gather(*(core.get_stats(max_age, timeout) for core in self.cores)))
