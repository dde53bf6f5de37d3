"""A request's engine output streams: waiting on every prompt's (with the client's leaving in view), merging
and closing them, and which HTTP error a failure while they run answers."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import EngineBusyError, EngineDeadError
from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError


class ServerStopping(RuntimeError):
    """The server was told to stop at once (a second SIGTERM): requests in flight are cut."""


class ClosingStream(StreamingResponse):
    """A stream that releases its requests however the response ends: a client gone before the first chunk
    was asked for leaves the body's generator unstarted, and an unstarted generator's `finally` never runs
    (its requests would generate for nobody and stay counted in flight)."""

    def __init__(self, content, close, **kwargs):
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


class _Disconnected(Exception):
    pass


def _in_flight(error: APIError) -> APIError:
    """Marks a 503 of a request the engine had taken: an abort in the metrics, not a rejection."""
    error.in_flight = True
    return error


def as_api_error(e: BaseException, field_of=None) -> BaseException:
    """`e` as the HTTP error it answers; `field_of` (`run`'s) names the request's own field in its param: an
    engine-side error (a grammar's) may come before the first output or after it."""
    error = _api_error(e)
    if field_of is not None and isinstance(error, APIError):
        error.param = field_of(error.param)
    return error


def _api_error(e: BaseException) -> BaseException:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return _in_flight(APIError(503, "The engine is not running.", code="engine_dead"))
    if isinstance(e, ServerStopping):
        return _in_flight(APIError(503, "The server stopped before this request finished.", code="shutting_down"))
    if isinstance(e, EngineBusyError):
        return APIError(503, str(e), code="engine_busy", headers={"Retry-After": "5"})
    if isinstance(e, ValueError):
        return APIError(400, str(e), getattr(e, "param", None))
    if isinstance(e, _Disconnected):
        return APIError(499, "client disconnected")
    return e


async def _wait_disconnect(raw: Request):
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected()


async def _with_disconnect(raw: Request | None, coro):
    """Run `coro`, cancelling it if the client goes away first (`raw` None: no client's, a background task's)."""
    if raw is None:
        return await coro
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            try:
                await work
            except BaseException:
                pass
        watch.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    if watch.done() and not watch.cancelled() and watch.exception() is not None:
        raise watch.exception()
    raise _Disconnected()


async def _gather(coros) -> list:
    """Like asyncio.gather, but a failure or a cancellation cancels and awaits all the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        # awaits the cancelled ones and retrieves every failure (asyncio logs one never retrieved)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for t, result in zip(tasks, results):
        if not t.cancelled() and isinstance(result, BaseException):
            raise result
    if any(t.cancelled() for t in tasks):
        raise asyncio.CancelledError()
    return results


async def _first_outputs(gens) -> list[RequestOutput]:
    return await _gather(g.__anext__() for g in gens)


async def _last_outputs(gens, first: list[RequestOutput]) -> list[RequestOutput]:
    async def last(g, out):
        while not out.finished:
            out = await g.__anext__()
        return out
    return await _gather(last(g, o) for g, o in zip(gens, first))


async def _close_all(gens):
    for g in gens:
        try:
            await g.aclose()
        except BaseException:
            pass


async def _merge_streams(gens, first: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) pairs from all prompts, as they arrive."""
    for i, out in enumerate(first):
        yield i, out
    live = {i: g for i, (g, out) in enumerate(zip(gens, first)) if not out.finished}
    if len(live) == 1:
        (i, g), = live.items()
        async for out in g:
            yield i, out
        return
    tasks = {asyncio.ensure_future(g.__anext__()): i for i, g in live.items()}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                i = tasks.pop(t)
                out = t.result()
                yield i, out
                if not out.finished:
                    tasks[asyncio.ensure_future(live[i].__anext__())] = i
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
