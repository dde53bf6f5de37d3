"""`tokenmill bench serve`: an online benchmark of any OpenAI-compatible server, with vLLM's metrics.

    tokenmill bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions \\
        --model qwen3-4b --dataset mixed-chat --num-prompts 200 --max-concurrency 1,4,8,16,32

Definitions (as in vLLM's `benchmark_serving`, so figures compare with theirs):
- TTFT: from sending the request to the first streamed chunk that carries output: text, reasoning or a
  tool call's delta.
- ITL: from the first output chunk on, the gaps between consecutive chunks with choices (an end-of-sequence
  token's chunk, which has no text, among them), pooled over all requests.
- TPOT: per request, (latency - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2E latency: from sending to the last chunk with choices (the usage chunk and `[DONE]` after it not
  counted), so that it ends at the chunk of the last token that usage counts.
- Throughputs divide by the wall time of the level; token counts are the server's `usage`
  (`stream_options.include_usage`), never re-tokenised here. A server that sends none leaves the output
  counts unknown (a chunk may carry several tokens): such requests count their output chunks, a prompt
  of token ids its known length, and every figure that rests on them is flagged (`requests_without_usage`).
- Arrivals at `--request-rate`: Poisson, each request sent at its own time from the level's start (a late
  send delays no later one), the gaps scaled so that the last is sent at `num_prompts / rate`, as vLLM's;
  `--burstiness B` draws the gaps from vLLM's gamma distribution of shape B instead (1: Poisson; below 1
  burstier, above 1 more even, inf evenly spaced).
- Goodput: completed requests per second that meet every SLO given with `--goodput ttft:MS tpot:MS e2el:MS`.
- A request completes when its stream carried output and ended with `data: [DONE]`; one cut short, an HTTP
  error or an error event fails, and failed requests are left out of every latency.
Each concurrency level sends `--num-prompts` requests of its own, drawn with the seed plus the level's
position (the warm-up's with the seed plus the number of levels), one level after the other: no level finds
another's prompts in the server's prefix cache. (Prompts drawn from a dataset file repeat where it holds
fewer conversations than the levels take together.)
`--structured-fraction F` puts that fraction of them (evenly spread, the same positions at every level) under
`BENCH_SCHEMA` (chat: `response_format` json_schema; completions: `structured_outputs`), and reports
the TPOT of those and of the plain ones apart. `--tools-fraction F` (chat only) likewise has that fraction
offer the model `BENCH_TOOLS` with tool_choice "auto" (the prompt stays the dataset's, so only the tools
tell the classes apart: a server's priority boost for tool-carrying requests), and reports the TTFT of
those and of the plain ones apart. Every level records the longest wait: the largest TTFT and E2E latency.
One Python process reads every stream, so its cost per SSE chunk bounds the concurrency it can measure: the
requests go through `HTTPClient`, a small HTTP/1.1 client on asyncio streams (http:// only) that takes each
network read's chunks at once and parses their data lines with orjson. `--client-processes N` deals each
level's requests and concurrency among N such processes that begin together.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import platform
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field

import numpy as np
import orjson

from tokenmill.bench.datasets import parse_range
from tokenmill.bench.provenance import git_commit
from tokenmill.bench.serve_datasets import ServeRequest, build_serve_requests, dataset_summary
from tokenmill.bench.serve_results import parse_metadata, result_path, write_record

PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0               # seconds
    latency: float = 0.0            # seconds
    itl: list[float] = field(default_factory=list)
    start: float = 0.0              # seconds since the level began
    usage_reported: bool = False
    error: str = ""
    generated_text: str = ""


# ----- metrics -------------------------------------------------------------------------------------------
def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:300', 'tpot:50'] -> {'ttft': 300.0, 'tpot': 50.0} (milliseconds, each 0 or more)."""
    slos = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            key, _, value = part.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if key not in ("ttft", "tpot", "e2el") or not ms >= 0:
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS with MS a number of milliseconds "
                                 f">= 0, got {part!r}")
            slos[key] = ms
    return slos


def tpot_of(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    """vLLM's --metric-percentiles, e.g. '25,50,99.9', added to the PERCENTILES every result has."""
    try:
        extra = [float(p) for p in (text or "").split(",") if p.strip()]
    except ValueError:
        extra = [math.nan]
    if any(not 0 <= p <= 100 for p in extra):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in [0, 100], got {text!r}")
    return tuple(sorted(set(PERCENTILES) | set(extra)))


PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_levels(text: str) -> list[int]:
    """--max-concurrency '1,4,8' -> [1, 4, 8]."""
    try:
        levels = [int(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--max-concurrency takes comma-separated levels of 1 or more, got {text!r}")
    return levels


def check_sweep_args(args) -> None:
    """Refuses, naming the flag and its value, what `run_sweep` could not run, before the server is asked
    anything; `args.request_rate` becomes a float, `args.max_concurrency` the list of levels, and
    `args.goodput`, `args.metric_percentiles` and `args.metadata` their parsed values, which `run_sweep` reads."""
    args.goodput = parse_goodput(args.goodput)
    args.metric_percentiles = parse_percentiles(args.metric_percentiles)
    args.metadata = parse_metadata(args.metadata, compute_metrics([], 1.0, None, args.metric_percentiles))
    args.max_concurrency = parse_levels(args.max_concurrency)
    try:
        rate = float(args.request_rate)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise ValueError(f"--request-rate takes requests per second above 0, or inf, got {args.request_rate!r}")
    args.request_rate = rate
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be above 0, got {args.burstiness}")
    metrics = [m.strip() for m in (args.percentile_metrics or "").split(",") if m.strip()]
    if any(m not in PERCENTILE_METRICS for m in metrics):
        raise ValueError(f"--percentile-metrics takes {','.join(PERCENTILE_METRICS)}, got "
                         f"{args.percentile_metrics!r}")
    if args.ignore_eos and args.no_ignore_eos:
        raise ValueError("give --ignore-eos or --no-ignore-eos, not both")
    if args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be above 0 seconds, got {args.request_timeout}")
    for name in ("structured_fraction", "tools_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.tools_fraction > 0 and not args.endpoint.endswith("chat/completions"):
        raise ValueError("--tools-fraction needs the chat endpoint (/v1/chat/completions)")
    if args.tools_fraction > 0 and args.structured_fraction > 0:
        raise ValueError("give --tools-fraction or --structured-fraction, not both (each splits the requests "
                         "into two classes)")
    for name in ("mixed_chat_chars", "mixed_chat_output_len"):
        try:
            parse_range(getattr(args, name))
        except ValueError as e:
            raise ValueError(f"--{name.replace('_', '-')}: {e}") from None


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...] = PERCENTILES) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:         # vLLM's key: p99, p99.9
        out[f"p{int(p) if p == int(p) else p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    """vLLM's metrics of one level under vLLM's keys (`duration` in seconds, latencies in ms), and ours beside
    them."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    duration_s = max(duration_s, 1e-9)
    m = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "request_goodput": None,
        "output_throughput": total_out / duration_s, "total_token_throughput": (total_in + total_out) / duration_s,
        **peak_output(ok),
    }
    m.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    m.update(_stats("tpot", tpots, percentiles))
    m.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    m.update(_stats("e2el", [r.latency for r in ok], percentiles))
    m.update({"num_requests": len(results), "success_rate": len(ok) / len(results) if results else 0.0,
              "requests_without_usage": sum(1 for r in ok if not r.usage_reported)})
    m["max_ttft_ms"] = max((r.ttft for r in ok), default=0.0) * 1e3
    m["max_e2el_ms"] = max((r.latency for r in ok), default=0.0) * 1e3
    if slos:
        good = 0
        for r in ok:
            t = tpot_of(r) or 0.0
            if (r.ttft * 1e3 <= slos.get("ttft", math.inf) and t * 1e3 <= slos.get("tpot", math.inf)
                    and r.latency * 1e3 <= slos.get("e2el", math.inf)):
                good += 1
        m["goodput_slos_ms"] = dict(slos)
        m["good_requests"] = good
        m["request_goodput"] = good / duration_s
    return m


def detailed(requests: list[ServeRequest], results: list[RequestResult]) -> dict:
    """vLLM's --save-detailed lists, one entry per request in the order sent (seconds; `start_times` from
    the level's start)."""
    return {"input_lens": [r.prompt_tokens or q.prompt_len or 0 for q, r in zip(requests, results)],
            "output_lens": [r.output_tokens if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results], "start_times": [r.start for r in results],
            "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results]}


def peak_output(ok: list[RequestResult]) -> dict:
    """vLLM's peaks of a level's completed requests: `max_output_tokens_per_s`, the most output chunks timed
    in one whole second counted from the first request's start (a chunk is a token at one token a chunk, as
    vLLM counts them), and `max_concurrent_requests`, the most requests in flight at once, each over
    [start, start + latency)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    times = np.concatenate([r.start + r.ttft + np.cumsum([0.0, *r.itl]) for r in ok]) - t0
    per_second = np.bincount(np.maximum(times, 0.0).astype(np.int64))
    # a request that ends as another starts is not beside it: at equal times the end comes first
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    in_flight = np.cumsum([delta for _, delta in events])
    return {"max_output_tokens_per_s": float(per_second.max()), "max_concurrent_requests": int(in_flight.max())}


# ----- client ---------------------------------------------------------------------------------------------
# an agent-style answer: mostly free text, as JSON outputs mostly are
BENCH_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "confidence": {"type": "number"},
    "sources": {"type": "array", "items": {"type": "string"}}}, "required": ["answer", "confidence", "sources"]}


# two functions an agent might offer; the model may call them or answer in text
BENCH_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the documentation for a query.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer"}}, "required": ["query"]}}},
]


def class_metrics(results: list[RequestResult], rows: set[int], part: str) -> dict:
    """TTFT and E2E statistics of the requests at `rows` of `results`, each key suffixed with `_{part}`."""
    ok = [results[i] for i in sorted(rows) if results[i].success]
    m = {"completed": len(ok), "num_requests": len(rows), **_stats("ttft", [r.ttft for r in ok]),
         **_stats("e2el", [r.latency for r in ok]),
         "max_ttft_ms": max((r.ttft for r in ok), default=0.0) * 1e3,
         "max_e2el_ms": max((r.latency for r in ok), default=0.0) * 1e3}
    return {f"{k}_{part}": v for k, v in m.items()}


def structured_indices(n: int, fraction: float) -> set[int]:
    """round(n * fraction) of range(n), evenly spread."""
    return {i for i in range(n) if math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)}


def build_payload(endpoint: str, model: str, req: ServeRequest, ignore_eos: bool, temperature: float,
                  schema: dict | None = None, tools: list[dict] | None = None) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        if tools is not None:
            body["tools"] = tools
            body["tool_choice"] = "auto"
    else:
        if tools is not None:
            raise ValueError("tools are sent on the chat endpoint only")
        body["prompt"] = req.prompt
        if schema is not None:
            body["structured_outputs"] = {"json": schema}
    return body


def _output_text(obj: dict) -> str | None:
    """The output a chunk carries: its text (content, reasoning as `reasoning_content` or vLLM's newer
    `reasoning`, or a completion's text), "" for a tool call's delta alone, None for no output."""
    out = None
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                or ("" if delta.get("tool_calls") else None)
        else:
            text = choice.get("text") or None
        if text is not None:
            out = text if out is None else out + text
    return out


class _Body:
    """One response body as it arrives, framed by chunked transfer-encoding, a Content-Length or the server
    closing. `read()` returns the body bytes of each network read (b"" at the end); `reusable` once the body
    ended inside its framing with nothing after it, so the connection can carry the next request."""

    def __init__(self, reader: asyncio.StreamReader, headers: dict[bytes, bytes]):
        self.reader = reader
        self.chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = headers.get(b"content-length")
        self.left = None if self.chunked or length is None else int(length)
        self.buf = bytearray()
        self.done = self.left == 0
        self.reusable = self.done

    async def read(self) -> bytes:
        while not self.done:
            data = await self.reader.read(1 << 16)
            if not data:
                if self.chunked or self.left is not None:
                    raise ConnectionError("the server closed the connection inside a response")
                self.done = True
                return b""
            if not self.chunked:
                if self.left is not None:
                    self.left -= len(data)
                    self.done, self.reusable = self.left <= 0, self.left == 0
                return data
            out = self._dechunk(data)
            if out:
                return out
        return b""

    def _dechunk(self, data: bytes) -> bytes:
        # a chunk is taken only once it is whole (size line, data, CRLF); SSE chunks are small
        buf = self.buf
        buf += data
        out, pos, n = [], 0, len(buf)
        while (eol := buf.find(b"\r\n", pos)) >= 0:
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)        # the last chunk, then trailers (if any) and a CRLF
                if end >= 0:
                    pos = end + 4
                    self.done = True
                    self.reusable = pos == n
                break
            if n < eol + 2 + size + 2:
                break
            out.append(bytes(buf[eol + 2:eol + 2 + size]))
            pos = eol + 2 + size + 2
        del buf[:pos]
        return b"".join(out)


class HTTPClient:
    """A small HTTP/1.1 client for streamed POSTs to one http:// server, with keep-alive connections: a
    connection goes back to the pool only after a whole response, so at most as many are open as requests
    in flight. `timeout_s` bounds each request from connecting to the last byte of its response."""

    def __init__(self, base_url: str, timeout_s: float = 3600.0, connect_timeout_s: float = 30.0):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"bench serve speaks plain HTTP to the server: give an http:// base URL, "
                             f"not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.authority = parts.netloc.encode("latin-1")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():    # the server may close an idle connection
                return reader, writer
            writer.close()
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.connect_timeout_s)

    @contextlib.asynccontextmanager
    async def post(self, path: str, payload: dict, headers: dict | None = None):
        """POST `payload` as JSON; yields (status, body) with the response head read."""
        body = orjson.dumps(payload)
        head = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nHost: ", self.authority,
                b"\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: ",
                str(len(body)).encode(), b"\r\n"]
        for k, v in (headers or {}).items():
            head += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        reader, writer = await self._connection()
        resp = None
        try:
            writer.write(b"".join(head) + body)
            status_line, *lines = (await reader.readuntil(b"\r\n\r\n"))[:-4].split(b"\r\n")
            version, status = status_line.split(b" ", 2)[:2]
            fields = {}
            for line in lines:
                k, _, v = line.partition(b":")
                fields[k.strip().lower()] = v.strip()
            keep_alive = version == b"HTTP/1.1" and fields.get(b"connection", b"").lower() != b"close"
            resp = _Body(reader, fields)
            yield int(status), resp
        finally:
            if resp is not None and keep_alive and resp.reusable:
                self.idle.append((reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def send_request(client: HTTPClient, url: str, payload: dict, headers: dict | None = None,
                       prompt_len: int | None = None) -> RequestResult:
    """One streamed request to `url`, on `client`'s server; `prompt_len`, where the dataset knows it, is
    its prompt tokens if the server reports no usage."""
    r = RequestResult()
    try:
        await asyncio.wait_for(_stream(client, urllib.parse.urlsplit(url).path, payload, headers, r, prompt_len),
                               client.timeout_s)
    except Exception as e:     # connection errors, timeouts, bad JSON: a failed request, not a crash
        r.success = False
        r.error = f"{type(e).__name__}: {e}"[:300]
    return r


async def _stream(client: HTTPClient, path: str, payload: dict, headers: dict | None, r: RequestResult,
                  prompt_len: int | None = None) -> None:
    content_chunks, texts = 0, []
    t0 = last = time.perf_counter()
    first_choice = last_choice = None       # the times of the first and last chunks with choices
    async with client.post(path, payload, headers) as (status, body):
        if status != 200:
            text = b""
            while data := await body.read():
                text += data
            r.error = f"HTTP {status}: {text.decode('utf-8', 'replace')[:300]}"
            return
        pending, finished = b"", False
        while data := await body.read():
            if finished:                    # past [DONE]: read to the end of the body, for keep-alive
                continue
            now = time.perf_counter()       # every event of one read arrived together
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                event = line[5:].strip()
                if event == b"[DONE]":
                    finished = True
                    break
                obj = orjson.loads(event)
                if "error" in obj:
                    r.error = str(obj["error"])[:300]
                    return
                if obj.get("choices"):
                    first_choice = now if first_choice is None else first_choice
                    last_choice = now
                    text = _output_text(obj)
                    # TTFT waits for the first chunk with output (a role chunk may come before any token);
                    # from there on every chunk with choices carries tokens (an end-of-sequence token's
                    # own chunk has no text, yet usage counts it) and is timed, as vLLM's client times them
                    if content_chunks:
                        r.itl.append(now - last)
                        last = now
                    elif text is not None:
                        r.ttft = now - t0
                        last = now
                    if text is not None:
                        content_chunks += 1
                        texts.append(text)
                usage = obj.get("usage")
                if usage:
                    r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    r.output_tokens = int(usage.get("completion_tokens") or 0)
                    r.usage_reported = True
    r.generated_text = "".join(texts)
    if not finished:
        # OpenAI's streams end with [DONE]: a body that ends before it (a server closing a connection whose end
        # only the close marks) was cut short, and its tokens so far are not a fast request
        r.error = f"the stream ended before data: [DONE], after {content_chunks} chunk(s) with output"
        return
    r.latency = (last if content_chunks else time.perf_counter()) - t0
    if not r.usage_reported:
        r.output_tokens = content_chunks
        r.prompt_tokens = prompt_len or 0
    if not content_chunks and r.output_tokens > 0 and first_choice is not None:
        # tokens whose text is empty (an end-of-sequence token first, say): timed by the chunks that carried
        # them, as vLLM times the first chunk with choices (TTFT stayed 0 and TPOT took its wait)
        r.ttft, r.latency = first_choice - t0, last_choice - t0
    r.success = content_chunks > 0 or r.output_tokens > 0
    if not r.success:
        r.error = "the stream carried no content"


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


# ----- run metadata ---------------------------------------------------------------------------------------
def detect_hardware(base_url: str, headers: dict | None = None) -> str | None:
    """The server's own report (/v1/models 'hardware', as the hf baselines give it), else this host's GPU
    when the server is on loopback."""
    import httpx
    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()
        for m in data.get("data", []):
            if m.get("hardware"):
                return m["hardware"]
    except Exception:
        pass
    if any(h in base_url for h in ("127.0.0.1", "localhost", "[::1]")):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=10).stdout.strip().splitlines()
            if names:
                return f"{len(names)}x {names[0]}" if len(names) > 1 else names[0]
        except (OSError, subprocess.SubprocessError):
            pass
        return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return None


def served_info(base_url: str, headers: dict | None = None) -> dict:
    import httpx
    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()
        return (data.get("data") or [{}])[0]
    except Exception:
        return {}


def _round_ms(values_s, digits: int = 3) -> list[float]:
    return [round(v * 1000.0, digits) for v in values_s]


def run_sweep(args, argv: list[str], on_level=None) -> list[dict]:
    """Runs every level in turn; returns their records (bench/serve_results.py), each also handed to
    `on_level` as the level ends."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    info = served_info(args.base_url, headers)
    model = args.model or info.get("id")
    if not model:
        raise SystemExit("--model is required when the server's /v1/models cannot be read")
    chat = args.endpoint.endswith("chat/completions")
    try:
        requests = build_serve_requests(args, chat)
    except ValueError as e:            # a dataset file that cannot be read
        raise SystemExit(str(e)) from None
    if not requests:
        raise SystemExit(f"dataset {args.dataset!r} holds no conversation long enough to send: a prompt of 4 or "
                         "more characters and an answer of 4 or more tokens (characters / 4 without --tokenizer)")
    slos, percentiles = args.goodput, args.metric_percentiles
    rate, levels = args.request_rate, args.max_concurrency
    structured = structured_indices(len(requests), args.structured_fraction)
    tools = structured_indices(len(requests), args.tools_fraction)

    def drawn(seed: int) -> list[ServeRequest]:
        return build_serve_requests(argparse.Namespace(**{**vars(args), "seed": seed}), chat)

    # each level draws its own requests (the seed plus its position) and the warm-up another, so that no
    # level finds the prompts of one before it in the server's prefix cache
    if args.num_warmups:
        first = drawn(args.seed + len(levels))[0]
    for _ in range(args.num_warmups):
        warm = ServeRequest(first.prompt, min(first.max_tokens, 16), first.prompt_len)
        (result,), _ = asyncio.run(run_level(args.base_url, args.endpoint, model, [warm], 1, headers=headers,
                                             progress=False, ignore_eos=not args.no_ignore_eos,
                                             temperature=args.temperature))
        if not result.success:
            # as vLLM's initial test run: a server or flag that fails every request stops here, not after a sweep
            raise SystemExit(f"the warm-up request to {args.base_url.rstrip('/')}{args.endpoint} failed, so no "
                             f"level was run: {result.error}")
    # vLLM's run keys (bench/serve_results.py), then ours
    request_format = args.backend or ("openai-chat" if chat else "openai")
    setup = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
             "endpoint_type": request_format, "backend": request_format,
             "label": args.label or info.get("owned_by") or "server", "model_id": model,
             "tokenizer_id": args.tokenizer, "num_prompts": len(requests),
             **args.metadata}
    provenance = {
        "command": "tokenmill bench " + " ".join(argv),
        "git_commit": git_commit(),
        "hardware": args.hardware or detect_hardware(args.base_url, headers),
        "base_url": args.base_url, "endpoint": args.endpoint,
        "dataset": {"name": args.dataset, "seed": args.seed, "ignore_eos": not args.no_ignore_eos,
                    **dataset_summary(requests)},
        "structured": {"fraction": args.structured_fraction, "requests": len(structured),
                       "schema": BENCH_SCHEMA} if structured else None,
        "tools": {"fraction": args.tools_fraction, "requests": len(tools), "tools": BENCH_TOOLS,
                  "tool_choice": "auto"} if tools else None,
        "client_processes": args.client_processes,
    }
    records = []
    for position, conc in enumerate(levels):
        if position:
            requests = drawn(args.seed + position)
            structured = structured_indices(len(requests), args.structured_fraction)
            tools = structured_indices(len(requests), args.tools_fraction)
        if args.client_processes > 1:
            results, duration = run_level_processes(
                args.client_processes, args.base_url, args.endpoint, model, requests, conc, rate, args.seed,
                not args.no_ignore_eos, args.temperature, headers, args.request_timeout, structured, tools,
                args.burstiness)
        else:
            results, duration = asyncio.run(run_level(
                args.base_url, args.endpoint, model, requests, conc, rate, args.seed, not args.no_ignore_eos,
                args.temperature, headers, args.request_timeout, not args.no_progress, structured, tools,
                burstiness=args.burstiness))
        m = {**setup, "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
             "max_concurrency": conc, **compute_metrics(results, duration, slos, percentiles)}
        if args.save_detailed:
            m.update(detailed(requests, results))
        m["seed"] = args.seed + position
        if structured:
            for part, rows in (("structured", structured), ("plain", set(range(len(results))) - structured)):
                tpots = [t for i in rows if results[i].success and (t := tpot_of(results[i])) is not None]
                m[f"median_tpot_ms_{part}"] = float(np.median(tpots)) * 1e3 if tpots else None
                m[f"output_tokens_{part}"] = sum(results[i].output_tokens for i in rows)
        if tools:
            m.update(class_metrics(results, tools, "tools"))
            m.update(class_metrics(results, set(range(len(results))) - tools, "plain"))
        ok = [r for r in results if r.success]
        m["ttfts_ms"] = _round_ms(r.ttft for r in ok)
        m["e2els_ms"] = _round_ms(r.latency for r in ok)
        m["itls_ms"] = _round_ms(g for r in ok for g in r.itl)
        m["distinct_errors"] = sorted({r.error for r in results if not r.success})[:10]
        m.update(provenance)
        records.append(m)
        print(format_level(m), file=sys.stderr, flush=True)
        if on_level is not None:       # results survive a run cut short by a time limit
            on_level(m)
    return records


def format_level(m: dict) -> str:
    return (f"{m['label']} c={m['max_concurrency']}: {m['completed']}/{m['num_requests']} ok, "
            f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} out tok/s, "
            f"TTFT p50 {m['median_ttft_ms']:.1f} ms, TPOT p50 {m['median_tpot_ms']:.2f} ms, "
            f"E2E p95 {m['p95_e2el_ms']:.0f} ms, ITL p99 {m['p99_itl_ms']:.2f} ms, TTFT max {m['max_ttft_ms']:.0f} ms, "
            f"E2E max {m['max_e2el_ms']:.0f} ms" + _structured_tpots(m) + _tool_ttfts(m) + _errors(m) + _no_usage(m))


def _no_usage(m: dict) -> str:
    n = m.get("requests_without_usage") or 0
    return (f"; WARNING: {n} request(s) without usage: their output tokens are counted as chunks, so TPOT and "
            "output throughput are off wherever a chunk carries several tokens") if n else ""


def _errors(m: dict) -> str:
    """The distinct errors of the failed requests (up to 10 kept in the record), the first one shown."""
    errors = m.get("distinct_errors") or []
    return f"; {len(errors)} distinct error(s), first: {errors[0]}" if errors else ""


def _structured_tpots(m: dict) -> str:
    if "median_tpot_ms_structured" not in m:
        return ""
    fmt = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
    return (f", TPOT p50 structured {fmt(m['median_tpot_ms_structured'])} / plain "
            f"{fmt(m['median_tpot_ms_plain'])} ms")


def _tool_ttfts(m: dict) -> str:
    if "p95_ttft_ms_tools" not in m:
        return ""
    return (f", TTFT p50/p95 tools {m['median_ttft_ms_tools']:.1f}/{m['p95_ttft_ms_tools']:.1f} / plain "
            f"{m['median_ttft_ms_plain']:.1f}/{m['p95_ttft_ms_plain']:.1f} ms")


DEFAULT_ENDPOINT = "/v1/chat/completions"
INPUT_LEN_RANGE, OUTPUT_LEN_RANGE = "100,1024", "100,300"


def add_serve_args(p) -> None:
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host and --port)")
    p.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
                   help=f"(default: {DEFAULT_ENDPOINT}, or /v1/completions with --backend vllm or openai)")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="backend name in the results (default: /v1/models owned_by)")
    p.add_argument("--dataset", default="mixed-chat", help="'mixed-chat', 'random' or a ShareGPT-format JSON file")
    p.add_argument("--tokenizer", default=None, help="tokenizer for ShareGPT output lengths")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per concurrency level")
    p.add_argument("--max-concurrency", default="1,4,8,16,32", help="comma-separated levels, run in turn")
    p.add_argument("--request-rate", default="inf", help="Poisson arrival rate (req/s), or inf")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="with a finite --request-rate, the shape of vLLM's gamma-distributed gaps: 1 Poisson, "
                        "below 1 burstier, above 1 more even, inf evenly spaced")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len-range", default=None,
                   help=f"random: inclusive prompt lengths 'LO,HI' or 'N' (default: {INPUT_LEN_RANGE})")
    p.add_argument("--output-len-range", default=None,
                   help=f"random: inclusive max_tokens 'LO,HI' or 'N' (default: {OUTPUT_LEN_RANGE})")
    p.add_argument("--random-vocab-limit", type=int, default=1000, help="random completions: ids below this")
    p.add_argument("--mixed-chat-chars", default="50,1000", help="mixed-chat: inclusive prompt characters")
    p.add_argument("--mixed-chat-output-len", default="100,300", help="mixed-chat: inclusive max_tokens")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers without it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--structured-fraction", type=float, default=0.0,
                   help="this fraction of the requests asks for JSON under a schema (structured output)")
    p.add_argument("--tools-fraction", type=float, default=0.0,
                   help='chat: this fraction of the requests offers two tools (tool_choice "auto"; the server '
                        "needs --enable-auto-tool-choice); TTFT reported per class")
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--metric-percentiles", default=None,
                   help="vLLM's flag: more percentiles of every metric, e.g. '25,99.9' (p50, p95 and p99 always)")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds a request may take, from connecting to the last byte of its response")
    p.add_argument("--hardware", default=None, help="hardware string for the results (default: detected)")
    p.add_argument("--output-dir", "--result-dir", default="bench_results", help="where the results go")
    p.add_argument("--name", default=None, help="results file stem (default: serve-BACKEND-time)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--client-processes", type=int, default=1,
                   help="read the streams from this many processes, the requests and concurrency dealt among "
                        "them (one process's cost per SSE chunk bounds what it can measure at high concurrency)")


def main_serve(args, argv: list[str]) -> int:
    os.makedirs(args.output_dir, exist_ok=True)
    paths, saved = [], []
    filename = args.result_filename or (f"{args.name}.json" if args.name else None)

    def save(record: dict) -> None:
        # a level's line is added to a file this run wrote before (a named file, or a level repeated)
        path = result_path(args.output_dir, filename, record)
        write_record(path, record, append=args.append_result or path in paths)
        if path not in paths:
            paths.append(path)
        saved.append(record)

    interrupted = False
    try:
        records = run_sweep(args, argv, on_level=save)
    except KeyboardInterrupt:
        # Ctrl-C: the level under way is lost, the completed ones were saved as each ended
        if not saved:
            print("interrupted before the first level completed: no results", file=sys.stderr)
            return 130
        records, interrupted = saved, True
        print(f"interrupted: the {len(records)} completed level(s) only", file=sys.stderr)
    from tokenmill.bench.report_serve import class_table, summary_table
    print(summary_table(records))
    classes = class_table(records)
    if classes:
        print()
        print(classes)
    print(f"results: {' '.join(paths)}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if all(r["failed"] == 0 for r in records) else 1
