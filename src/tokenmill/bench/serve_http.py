"""`bench serve`'s HTTP client: streamed POSTs over keep-alive HTTP/1.1 connections on asyncio streams
(`HTTPClient`), and one request's SSE stream read into its `RequestResult` (`send_request`)."""
from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse

import orjson

from tokenmill.bench.serve_metrics import RequestResult


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
