"""One request's stream, from the engine core's updates to its `AsyncLLM.generate()` reader.

`AsyncLLM` writes each update's cumulative `RequestOutput` of a request (or the error it ends with) into the
request's `RequestStream`, and wakes the reader only when that output is due (`stream_interval`); the reader takes
the newest state. Invariant: a stream holds only the latest cumulative output, so a reader woken late, or
not woken for an update, loses nothing and never falls behind by a backlog. Writer and reader both run on
the event loop's thread. The stream also keeps what the metrics hook (`AsyncLLM.on_output`) counts.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenmill.outputs import RequestMetrics, RequestOutput


@dataclass
class RequestStream:
    """Latest cumulative output of one request; readers only ever need the newest state. `wake` tells
    its reader that it changed: a flag and the one future the reader waits on, which costs the loop less
    per token than an `asyncio.Event` (that looks up its loop and keeps a queue of waiters)."""
    output: RequestOutput | None = None
    error: BaseException | None = None
    done: bool = False
    changed: bool = False
    waiter: asyncio.Future | None = None
    # each sequence's tokens seen so far and when the last arrived (the metrics' time to first token and
    # inter-token latency)
    prev_tokens: list[int] = field(default_factory=list)
    last_token_seen: list[float | None] = field(default_factory=list)
    first_token_seen: list[float | None] = field(default_factory=list)
    interval: int = 1                 # tokens between wakes (0: only the first output and the last)
    # for the metrics of a request that ends unfinished: its sequences, its times (the output processor's,
    # first scheduling included before any output came), those seen finished; of every request: its
    # prompt's length and max_tokens
    n: int = 1
    metrics: RequestMetrics | None = None
    num_prompt_tokens: int = 0
    max_tokens: int | None = None
    finished_seen: set[int] = field(default_factory=set)
    delivered: list[int] | None = None    # each sequence's tokens at the last wake; None before the first

    def due(self, out: RequestOutput) -> bool:
        """Whether `out` is worth waking the reader for: the first output, the last, or one in which some
        sequence has `interval` more tokens than at the last wake (each sequence counts its own: one that
        stopped early must not hold back the others' tokens). The reader always gets the newest
        cumulative output, so an output it is not woken for is not lost, only delivered with a later one."""
        counts = [len(c.token_ids) for c in out.outputs]
        if (out.finished or self.delivered is None
                or (self.interval and any(n - d >= self.interval for n, d in zip(counts, self.delivered)))):
            self.delivered = counts
            return True
        return False

    def wake(self) -> None:
        self.changed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.changed:
            self.waiter = loop.create_future()
            await self.waiter
        self.changed = False
