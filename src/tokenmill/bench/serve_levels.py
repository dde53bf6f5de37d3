"""One concurrency level of `bench serve`: its requests sent at their arrival times under the concurrency
limit, from this process (`run_level`) or dealt among client processes that begin together
(`run_level_processes`)."""
from __future__ import annotations

import asyncio
import math
import sys
import time

import numpy as np

from tokenmill.bench.serve_datasets import ServeRequest
from tokenmill.bench.serve_http import HTTPClient, send_request
from tokenmill.bench.serve_metrics import RequestResult
from tokenmill.bench.serve_payload import BENCH_SCHEMA, BENCH_TOOLS, build_payload


def arrival_times(n: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds from the level's start at which each request is sent: gaps drawn from a gamma distribution of
    shape `burstiness` and mean 1 / `request_rate` (vLLM's; shape 1 is exponential, so Poisson arrivals, and
    an infinite shape spaces them evenly), scaled so that the last arrives at n / rate (as vLLM's benchmark
    scales them: a draw's mean gap is off the rate's by chance); all at 0 at an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / request_rate / times[-1])).tolist() if n else []


async def run_level(base_url: str, endpoint: str, model: str, requests: list[ServeRequest], max_concurrency: int,
                    request_rate: float = math.inf, seed: int = 0, ignore_eos: bool = True, temperature: float = 0.0,
                    headers: dict | None = None, timeout_s: float = 3600.0, progress: bool = True,
                    structured: set[int] = frozenset(),
                    tools: set[int] = frozenset(), start_at: float | None = None, burstiness: float = 1.0
                    ) -> tuple[list[RequestResult], float]:
    """`structured`: the indices of `requests` sent under BENCH_SCHEMA; `tools`: those that offer BENCH_TOOLS.
    `start_at`: a `time.time()` at which to begin (the client processes of one level begin together), from
    which the requests' starts and the level's duration count."""
    from tqdm import tqdm

    url = base_url.rstrip("/") + endpoint
    client = HTTPClient(base_url, timeout_s)
    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(requests), desc=f"concurrency {max_concurrency}", unit="req", disable=not progress,
               file=sys.stderr)
    try:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        level_t0 = time.perf_counter() - (time.time() - start_at if start_at is not None else 0.0)

        async def one(req: ServeRequest, schema: dict | None, offered: list[dict] | None) -> RequestResult:
            async with sem:
                start = time.perf_counter() - level_t0
                res = await send_request(client, url, build_payload(endpoint, model, req, ignore_eos, temperature,
                                                                    schema, offered), headers, req.prompt_len)
                res.start = start
                bar.update(1)
                return res

        tasks = []
        for i, (req, at) in enumerate(zip(requests, arrival_times(len(requests), request_rate, seed,
                                                                                burstiness))):
            wait = level_t0 + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.ensure_future(one(req, BENCH_SCHEMA if i in structured else None,
                                                   BENCH_TOOLS if i in tools else None)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - level_t0
    finally:
        await client.aclose()
    bar.close()
    return list(results), duration


def _client_process(job: tuple, ready, go, start_at, out) -> None:
    """One client process's share of a level: reports ready once imported and connected to nothing yet,
    waits for the common start time, runs, and puts (its request indices, their results, its duration)."""
    indices, args, kwargs = job
    ready.put(True)
    go.wait()
    results, duration = asyncio.run(run_level(*args, **kwargs, start_at=start_at.value))
    out.put((indices, results, duration))


def deal(num_requests: int, max_concurrency: int, processes: int) -> list[tuple[list[int], int]]:
    """Each client process's requests (indices) and concurrency slots: slot k is process k % processes's,
    and request j goes with slot j % max_concurrency, so a process takes requests in proportion to its
    slots (dealt evenly, one with fewer slots ran its share in series while the others idled)."""
    return [([j for j in range(num_requests) if j % max_concurrency % processes == i],
             max_concurrency // processes + (1 if i < max_concurrency % processes else 0))
            for i in range(processes)]


def run_level_processes(processes: int, base_url: str, endpoint: str, model: str, requests: list[ServeRequest],
                        max_concurrency: int, request_rate: float = math.inf, seed: int = 0, ignore_eos: bool = True,
                        temperature: float = 0.0, headers: dict | None = None, timeout_s: float = 3600.0,
                        structured: set[int] = frozenset(), tools: set[int] = frozenset(), burstiness: float = 1.0
                        ) -> tuple[list[RequestResult], float]:
    """`run_level` from `processes` client processes, so that reading the streams is not bounded by one
    process's cost per SSE chunk: the concurrency slots are dealt to them in turn (a process with k slots
    keeps k requests open), and the requests in proportion to the slots (`deal`); with a finite rate each
    sends a Poisson stream at its share of it (their sum is a Poisson stream at the whole rate; with
    `burstiness` other than 1 each process's gaps, not their sum's, follow the gamma law). They begin
    together once all have started, and the level lasts until the last one's last response. Results come
    back in the order of `requests`."""
    import multiprocessing
    import queue
    processes = max(1, min(processes, max_concurrency, len(requests)))
    ctx = multiprocessing.get_context("spawn")
    ready, out, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    workers = []
    for i, (indices, slots) in enumerate(deal(len(requests), max_concurrency, processes)):
        local = {j: k for k, j in enumerate(indices)}
        rate = request_rate * len(indices) / len(requests)
        job = (indices, (base_url, endpoint, model, [requests[j] for j in indices], slots, rate, seed + i,
                         ignore_eos, temperature, headers, timeout_s, False,
                         {local[j] for j in structured if j in local}, {local[j] for j in tools if j in local}),
               {"burstiness": burstiness})
        workers.append(ctx.Process(target=_client_process, args=(job, ready, go, start_at, out), daemon=True))
    results: list[RequestResult | None] = [None] * len(requests)
    duration = 0.0
    try:
        for w in workers:
            w.start()
        for _ in workers:
            ready.get(timeout=120)
        start_at.value = time.time() + 0.2
        go.set()
        for _ in workers:
            while True:
                try:
                    indices, part, took = out.get(timeout=5)
                    break
                except queue.Empty:
                    if not any(w.is_alive() for w in workers):
                        raise RuntimeError("a client process exited without its results") from None
            for j, r in zip(indices, part):
                results[j] = r
            duration = max(duration, took)
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
    return results, duration
