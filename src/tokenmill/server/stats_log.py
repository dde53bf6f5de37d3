"""The server's running log, as `vllm serve` prints it: a stats line every `interval` seconds while the
engine is busy (`--disable-log-stats` turns it off) and, with `--enable-log-requests`, a line when a
request arrives and one when it finishes.

Both run in the server process and read only what `AsyncLLM` hands out: `get_stats()` (the engine core's
cumulative counters, the same dict `/metrics` renders) and each request's output stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import reprlib
import time
from typing import AsyncIterator, Awaitable, Callable

stats_logger = logging.getLogger("tokenmill.stats")
request_logger = logging.getLogger("tokenmill.requests")

DEFAULT_INTERVAL_S = 10.0


class StatsLogger:
    """Turns two samples of the engine's cumulative stats into one line of rates and levels.

    A line is printed for an interval in which tokens moved or requests were running or waiting, and
    once more after such an interval (its zeros say the burst is over); a server that stays idle logs
    nothing. The prefix-cache hit rate is that of the prompt tokens looked up during the interval."""

    def __init__(self, get_stats: Callable[[], Awaitable[dict]], interval: float = DEFAULT_INTERVAL_S):
        self.get_stats = get_stats
        self.interval = interval
        self._last: dict | None = None
        self._last_time = 0.0
        self._was_busy = False

    async def log_once(self, now: float | None = None) -> str | None:
        """Takes a sample; returns (and logs) the line for the interval since the previous one, if any."""
        stats = await self.get_stats()
        now = time.monotonic() if now is None else now
        last, last_time = self._last, self._last_time
        if not stats:
            return None
        self._last, self._last_time = stats, now
        if last is None:
            return None
        elapsed = max(now - last_time, 1e-9)

        def delta(key: str) -> float:
            return stats.get(key, 0) - last.get(key, 0)

        prompt, generation = delta("prompt_tokens"), delta("generation_tokens")
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        swapped = stats.get("num_swapped", 0)
        busy = bool(prompt or generation or running or waiting or swapped)
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * stats.get('kv_cache_usage', 0.0):.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        if swapped:             # requests whose KV waits in host memory (--swap-space)
            line += f", Swapped: {swapped} reqs"
        preempted = delta("num_preemptions")
        if preempted:
            line += f", Preemptions: {preempted:.0f}"
        stats_logger.info(line)
        return line

    async def run(self) -> None:
        await self.log_once()
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.log_once()
            except Exception:          # a stats line is never worth the server
                stats_logger.debug("stats sample failed", exc_info=True)


async def serve_with_stats(serve: Awaitable, engine, enabled: bool = True,
                           interval: float = DEFAULT_INTERVAL_S):
    """Awaits `serve` (the HTTP server) with the stats logger running beside it in the same loop (not
    when disabled, nor when the log level hides its lines)."""
    if not enabled or not stats_logger.isEnabledFor(logging.INFO):
        return await serve
    task = asyncio.ensure_future(StatsLogger(lambda: engine.get_stats(max_age=1.0), interval).run())
    try:
        return await serve
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def enable_request_logging(enabled: bool) -> None:
    """`--enable-log-requests`: the per-request lines are INFO records of the `tokenmill.requests`
    logger, which is held at WARNING otherwise."""
    request_logger.setLevel(logging.INFO if enabled else logging.WARNING)


# a logged value's shown items and characters: a request's stop strings, logit_bias or JSON schema may run to
# megabytes, and each request line is written on the event loop
LOGGED_ITEMS, LOGGED_CHARS = 8, 200
# what is shown of a value within them (reprlib formats only what it shows)
_INNER = reprlib.Repr()
_INNER.maxlevel, _INNER.maxdict, _INNER.maxlist, _INNER.maxtuple = 2, 4, 4, 4
_INNER.maxstring = _INNER.maxother = 60


def _items(parts: list[str], total: int) -> str:
    return ", ".join(parts + ([f"... {total - LOGGED_ITEMS} more"] if total > LOGGED_ITEMS else []))


def brief(value) -> str:
    """A value for a log line: at most LOGGED_ITEMS items of a list, tuple or dict (the rest counted), a
    dataclass's set fields, each item or field as reprlib shows it, and LOGGED_CHARS characters in all."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        shown = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        fields = ", ".join(f"{k}={_INNER.repr(v)}" for k, v in shown if v is not None and v is not False)
        text = f"{type(value).__name__}({fields})"
    elif isinstance(value, dict):
        head = itertools.islice(value.items(), LOGGED_ITEMS)
        text = "{" + _items([f"{_INNER.repr(k)}: {_INNER.repr(v)}" for k, v in head], len(value)) + "}"
    elif isinstance(value, (list, tuple)):
        inner = _items([_INNER.repr(v) for v in value[:LOGGED_ITEMS]], len(value))
        text = f"[{inner}]" if isinstance(value, list) else f"({inner})"
    else:
        text = repr(value[:LOGGED_CHARS + 1] if isinstance(value, str) else value)
    return text if len(text) <= LOGGED_CHARS else text[:LOGGED_CHARS] + "..."


def params_summary(params) -> str:
    """The sampling parameters that differ from their defaults, plus max_tokens and temperature, each
    `brief`."""
    out = []
    for f in dataclasses.fields(params):
        if f.name == "extra":
            continue
        value = getattr(params, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in ("max_tokens", "temperature") or value != default and value not in ([], None):
            out.append(f"{f.name}={brief(value) if f.repr else '(hidden)'}")
    return ", ".join(out)


def log_request(gen: AsyncIterator, request_id: str, prompt_token_ids: list[int], params) -> AsyncIterator:
    """Wraps one request's output stream so that its arrival and its end are logged; returns `gen`
    itself when request logging is off. Its arrival is logged when the stream is first read, which is when
    the engine is handed the request: a stream closed unread (a background response cut before its task ran)
    logs neither line, never an arrival without an end."""
    if not request_logger.isEnabledFor(logging.INFO):
        return gen
    return _logged(gen, request_id, len(prompt_token_ids), params)


async def _logged(gen: AsyncIterator, request_id: str, prompt_tokens: int, params) -> AsyncIterator:
    request_logger.info("Received request %s: %d prompt tokens, %s", request_id, prompt_tokens,
                        params_summary(params))
    out = None
    failed = None
    t0 = time.perf_counter()
    try:
        async for out in gen:
            yield out
    except Exception as e:             # rejected by the engine, or the engine died
        failed = e
        raise
    finally:
        await gen.aclose()
        tokens = "+".join(str(len(c.token_ids)) for c in out.outputs) if out is not None else "0"
        if failed is not None:
            request_logger.info("Failed request %s: %s: %s", request_id, type(failed).__name__, failed)
        elif out is not None and out.finished:
            reasons = ",".join(str(c.finish_reason) for c in out.outputs)
            request_logger.info("Finished request %s: %s tokens, finish_reason=%s, %.2f s", request_id,
                                tokens, reasons, time.perf_counter() - t0)
        else:                          # the client went away, or the server cut it
            request_logger.info("Aborted request %s after %s tokens, %.2f s", request_id, tokens,
                                time.perf_counter() - t0)
