"""The newest endpoints under hostile and careless clients, against one `tokenmill serve` on the CPU: background
responses (thousands started without waiting; hundreds of followers of one stream; followers and polls of a
large response that read nothing; cancel and delete racing with streams' ends), POST /invocations (clients that
leave at once, after the headers or mid-stream; bodies that are no request) and GET / HEAD /tokenizer_info; then
bodies of a million mistakes. After each part: the engine idle with every KV block free. At the end: no
traceback, ERROR or exception line in the log. Prints the figures docs/BENCHMARKS.md records; exits 1 when a
check fails. Run from the repository root:

    python lab/background_storm.py MODEL [--only PART,...] [-- SERVER_ARGS...]

MODEL: a model directory with max_position_embeddings >= 8192, e.g. tests/conftest.py's
make_model(path, "qwen3", max_position_embeddings=8192) with make_tokenizer's files beside it. The server runs
with --max-model-len 8192, a queue of 64 and --send-timeout 10 (so that readers of nothing go within the run).
/health is probed from another process throughout a part: "held" is its longest wait.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

from abuse_storm import Served, rss_mb     # lab/ is this script's directory, first on its path

PROBLEMS: list[str] = []


class Conn:
    """One keep-alive HTTP/1.1 connection, raw: httpx's pool is the bottleneck at hundreds of connections."""

    def __init__(self, port: int):
        self.port = port

    async def open(self, rcvbuf: int | None = None) -> "Conn":
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        self.r, self.w = await asyncio.open_connection(sock=sock)
        return self

    async def send(self, method: str, path: str, body=None, content_type: str = "application/json") -> None:
        data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        self.w.write(b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (method.encode(), path.encode(), content_type.encode(), len(data), data))
        await self.w.drain()

    async def head(self) -> tuple[int, dict]:
        status = int((await self.r.readline()).split()[1])
        headers = {}
        while (line := await self.r.readline()) not in (b"\r\n", b""):
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def chunks(self):
        while size := int((await self.r.readline()).strip(), 16):
            yield await self.r.readexactly(size)
            await self.r.readline()
        await self.r.readline()

    async def body(self, headers: dict, method: str = "GET") -> bytes:
        if method == "HEAD":
            return b""
        if "content-length" in headers:
            return await self.r.readexactly(int(headers["content-length"]))
        return b"".join([c async for c in self.chunks()])

    async def request(self, method: str, path: str, body=None, **kw) -> tuple[int, dict, bytes]:
        await self.send(method, path, body, **kw)
        status, headers = await self.head()
        return status, headers, await self.body(headers, method)

    def close(self) -> None:
        self.w.transport.abort()


async def call(port: int, method: str, path: str, body=None, **kw) -> tuple[int, dict, bytes]:
    c = await Conn(port).open()
    try:
        return await c.request(method, path, body, **kw)
    finally:
        c.close()


def events_of(data: bytes) -> list[dict]:
    return [json.loads(e.split(b"data: ", 1)[1]) for e in data.split(b"\n\n") if b"data: " in e]


async def start_background(port: int, body: dict) -> str | None:
    """A background stream's id, its client gone after the first event (None: refused)."""
    c = await Conn(port).open()
    await c.send("POST", "/v1/responses", {**body, "background": True, "stream": True})
    status, headers = await c.head()
    if status != 200:
        c.close()
        return None
    first = b""
    async for chunk in c.chunks():
        first += chunk
        if b"\n\n" in first:
            break
    c.close()
    return events_of(first)[0]["response"]["id"]


async def wait_ended(port: int, rids: list[str]) -> Counter:
    while True:
        statuses = Counter()
        for rid in rids:
            status, _, body = await call(port, "GET", f"/v1/responses/{rid}")
            statuses[json.loads(body).get("status") if status == 200 else status] += 1
        if not statuses["queued"] + statuses["in_progress"]:
            return statuses
        await asyncio.sleep(0.5)


def metrics(port: int) -> dict[str, float]:
    out = {}
    for line in asyncio.run(call(port, "GET", "/metrics"))[2].decode().splitlines():
        if line.startswith("tokenmill:") and "{" in line and "bucket" not in line:
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def check_idle(port: int, part: str, timeout: float = 30) -> float:
    t0 = time.monotonic()
    while True:
        m = metrics(port)
        if (m["tokenmill:num_requests_running"] == m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:num_free_blocks"] == m["tokenmill:num_total_blocks"]):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            PROBLEMS.append(f"{part}: the engine is not idle: {m}")
            return timeout
        time.sleep(0.1)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Probe:
    """/health from another process every 0.1 s; `held`: its longest wait."""

    def __init__(self, port: int):
        self.proc = subprocess.Popen([sys.executable, __file__, "--probe", str(port)], stdout=subprocess.PIPE,
                                     text=True)
        time.sleep(0.3)

    def stop(self) -> float:
        time.sleep(0.3)
        self.proc.send_signal(signal.SIGTERM)
        return float(self.proc.communicate()[0] or 0)


def probe(port: int) -> None:
    longest = 0.0
    signal.signal(signal.SIGTERM, lambda *_: (print(f"{longest:.3f}", flush=True), os._exit(0)))
    while True:
        t = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(4096):
                pass
        longest = max(longest, time.monotonic() - t)
        time.sleep(0.1)


# ----- the parts ------------------------------------------------------------------------------------
async def burst(port: int, n: int = 3000, conns: int = 100) -> str:
    """Background responses (every other one streamed, its client gone after the first event) from `conns`
    connections as fast as they are answered; then each polled to its end."""
    answers, rids = Counter(), []

    async def worker(k: int):
        c = await Conn(port).open()
        for i in range(k, n, conns):
            body = {"input": f"burst {i}", "max_output_tokens": 64, "background": True}
            if i % 2:
                await c.send("POST", "/v1/responses", {**body, "stream": True})
                status, headers = await c.head()
                if status == 200:
                    c.close()
                    rids.append(None)
                    c = await Conn(port).open()
                    answers[(200, None, None)] += 1
                    continue
                data = await c.body(headers)
            else:
                status, headers, data = await c.request("POST", "/v1/responses", body)
            error = json.loads(data).get("error") or {}
            answers[(status, error.get("code"), headers.get("retry-after"))] += 1
            if status == 200:
                rids.append(json.loads(data)["id"])
        c.close()
    t0 = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(conns)))
    posted = time.monotonic() - t0
    ended = await wait_ended(port, [r for r in rids if r])
    if set(answers) - {(200, None, None), (503, "queue_full", "1")} or set(ended) - {"completed", "incomplete"}:
        PROBLEMS.append(f"burst: {answers} {ended}")
    return f"{n} posted in {posted:.1f} s: {dict(answers)}; polled to the end: {dict(ended)}"


async def followers(port: int, pid: int, n: int = 500) -> str:
    rid = await start_background(port, {"input": "follow", "max_output_tokens": 400, "top_logprobs": 5,
                                        "temperature": 0})

    async def follow() -> tuple[bool, str]:
        c = await Conn(port).open()
        await c.send("GET", f"/v1/responses/{rid}?stream=true")
        status, headers = await c.head()
        events = events_of(await c.body(headers)) if status == 200 else []
        c.close()
        ok = [e["sequence_number"] for e in events] == list(range(len(events)))
        return ok, events[-1]["type"] if events else f"status {status}"
    cpu0, rss0, t0 = cpu_s(pid), rss_mb(pid), time.monotonic()
    probe_ = Probe(port)
    seen = Counter(await asyncio.gather(*(follow() for _ in range(n))))
    held = probe_.stop()
    if set(seen) != {(True, "response.completed")} and set(seen) != {(True, "response.incomplete")}:
        PROBLEMS.append(f"followers: {seen}")
    return (f"{n} followers of one stream: {dict(seen)} in {time.monotonic() - t0:.1f} s; API server "
            f"{cpu_s(pid) - cpu0:.1f} CPU s, RSS {rss0:.0f} -> {rss_mb(pid):.0f} MB; /health held {held:.3f} s")


async def read_nothing(port: int, pid: int, n: int = 100) -> str:
    rid = await start_background(port, {"input": "large", "max_output_tokens": 8000, "top_logprobs": 20,
                                        "temperature": 0})
    await wait_ended(port, [rid])
    stored = len((await call(port, "GET", f"/v1/responses/{rid}"))[2])
    status, _, data = await call(port, "GET", f"/v1/responses/{rid}?stream=true&starting_after=0")
    first = int(re.search(rb"at least (\d+)", data).group(1)) if status == 400 else 0
    tail = events_of((await call(port, "GET", f"/v1/responses/{rid}?stream=true&starting_after={first}"))[2])
    last = tail[-1]["sequence_number"] if tail else first
    out = []
    for what, path in (("followers", f"/v1/responses/{rid}?stream=true&starting_after={last - 1}"),
                       ("polls", f"/v1/responses/{rid}")):
        rss0 = rss_mb(pid)
        conns = [await Conn(port).open(rcvbuf=4096) for _ in range(n)]
        for c in conns:
            await c.send("GET", path)
        await asyncio.sleep(4)
        out.append(f"{n} {what} that read nothing {rss0:.0f} -> {rss_mb(pid):.0f} MB")
        for c in conns:
            c.close()
        await asyncio.sleep(1)
    return f"a {stored:,}-byte response: " + "; ".join(out)


async def races(port: int, n: int = 200, seed: int = 0) -> str:
    rng = random.Random(seed)

    async def follow(rid: str):
        c = await Conn(port).open()
        await c.send("GET", f"/v1/responses/{rid}?stream=true")
        status, headers = await c.head()
        events = events_of(await c.body(headers))
        c.close()
        if status == 200 and [e["sequence_number"] for e in events] != list(range(len(events))):
            PROBLEMS.append(f"races: a follower's events out of order: {[e['sequence_number'] for e in events]}")
        return status, events[-1]["type"] if events else None

    async def one(i: int):
        rid = await start_background(port, {"input": f"race {i}", "max_output_tokens": rng.choice([1, 5, 50, 500]),
                                            "temperature": 0})
        if rid is None:         # the queue was full
            return "refused", ()
        follows = [asyncio.ensure_future(follow(rid)) for _ in range(3)]
        await asyncio.sleep(rng.random() * 0.3)
        act = rng.choice(["cancel", "delete", "cancel+delete+cancel", "none"])
        calls = {"cancel": [("POST", "/cancel")], "delete": [("DELETE", "")], "none": [],
                 "cancel+delete+cancel": [("POST", "/cancel"), ("DELETE", ""), ("POST", "/cancel")]}[act]
        answers = await asyncio.gather(*(call(port, m, f"/v1/responses/{rid}{p}") for m, p in calls))
        ends = await asyncio.gather(*follows)
        statuses = tuple(s for s, _, _ in answers) + tuple(s for s, _ in ends)
        if any(s >= 500 for s in statuses):
            PROBLEMS.append(f"races: {act}: {statuses}")
        return act, tuple(sorted({s for s in statuses}))
    out = Counter(await asyncio.gather(*(one(i) for i in range(n))))
    return ", ".join(f"{act} {codes}: {k}" for (act, codes), k in sorted(out.items(), key=str))


async def invocations(port: int, n: int = 300, seed: int = 0) -> str:
    rng = random.Random(seed)
    kinds = Counter()

    async def leave(i: int):
        kind = rng.choice(["at once", "after the headers", "after a chunk", "whole, cut"])
        body = {"messages": [{"role": "user", "content": f"hi {i}"}]} if i % 2 else {"prompt": f"hi {i}"}
        c = await Conn(port).open()
        await c.send("POST", "/invocations", {**body, "max_tokens": 300, "stream": kind != "whole, cut"})
        if kind == "whole, cut":
            await asyncio.sleep(rng.random() * 0.5)
        elif kind != "at once":
            status, _ = await c.head()
            if status == 200 and kind == "after a chunk":
                async for _ in c.chunks():
                    break
        c.close()
        kinds[kind] += 1
    await asyncio.gather(*(leave(i) for i in range(n)))
    idle = await asyncio.to_thread(check_idle, port, "invocations")
    bad = [(b'{"messages": [{"role": "user", "content": "x"}], "prompt": "x"}', "application/json"),
           (b"[1]", "application/json"), (b"null", "application/json"), (b"{}", "application/json"),
           (b'{"input": "x"}', "application/json"), (b'{"prompt": "x"}', "text/plain"), (b"", "application/json"),
           (b'{"prompt": "x", "max_tokens": 1, ' + b", ".join(b'"k%d": 0' % i for i in range(1000)) + b"}",
            "application/json")]
    refused = Counter()
    for body, content_type in bad:
        status, _, data = await call(port, "POST", "/invocations", body, content_type=content_type)
        refused[status] += 1
        if status != 400 or "error" not in json.loads(data):
            PROBLEMS.append(f"invocations: {body[:60]!r} {status} {data[:200]!r}")
    return f"{n} streams left {dict(kinds)}: idle {idle:.2f} s later; {len(bad)} bodies that are no request: " \
           f"{dict(refused)}"


async def tokenizer_info(port: int, conns: int = 200, each: int = 5) -> str:
    answers = Counter()

    async def worker():
        c = await Conn(port).open()
        for i in range(each):
            method = "HEAD" if i % 2 else "GET"
            status, headers, data = await c.request(method, "/tokenizer_info")
            answers[(method, status, int(headers.get("content-length", -1)))] += 1
        c.close()
    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(conns)))
    if {status for _, status, _ in answers} != {200} or len({length for *_, length in answers}) != 1:
        PROBLEMS.append(f"tokenizer_info: {answers}")
    return f"{conns} connections x {each}: {dict(answers)} in {time.monotonic() - t0:.2f} s"


MISTAKES = 1_000_000
BODIES = {
    "1M unknown fields (/invocations)": ("/invocations", lambda: {
        "prompt": "x", **{f"k{i}": 0 for i in range(MISTAKES)}}),
    "1M unknown fields in a message": ("/v1/chat/completions", lambda: {"messages": [
        {"role": "user", "content": "x", **{f"k{i}": 0 for i in range(MISTAKES)}}]}),
    "1M unknown fields in an input item": ("/v1/responses", lambda: {"input": [
        {"role": "user", "content": "x", **{f"k{i}": 0 for i in range(MISTAKES)}}]}),
    "1M tool calls of null": ("/v1/chat/completions", lambda: {"messages": [
        {"role": "assistant", "tool_calls": [None] * MISTAKES}]}),
    "1M include of null": ("/v1/responses", lambda: {"input": "x", "include": [None] * MISTAKES}),
    "1M guided_choice of null": ("/v1/completions", lambda: {"prompt": "x", "guided_choice": [None] * MISTAKES}),
    "a document of 1M null fields": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": "x"}], "documents": [{f"k{i}": None for i in range(MISTAKES)}]}),
    "18 unknown fields in each of 8,192 messages": ("/v1/chat/completions", lambda: {"messages": [
        {"role": "user", "content": "x", **{f"k{j}": 0 for j in range(18)}}] * 8192}),
}


def mistakes(port: int) -> list[str]:
    out = []
    for name, (path, make) in BODIES.items():
        body = json.dumps(make()).encode()
        probe_ = Probe(port)
        t0 = time.monotonic()
        status, _, data = asyncio.run(call(port, "POST", path, body))
        took, held = time.monotonic() - t0, probe_.stop()
        if status != 400:
            PROBLEMS.append(f"{name}: {status} {data[:200]!r}")
        out.append(f"{name} ({len(body) / 1e6:.1f} MB): {status} of {len(data):,} bytes in {took:.2f} s, "
                   f"/health held {held:.2f} s")
    return out


def main():
    if sys.argv[1:2] == ["--probe"]:
        return probe(int(sys.argv[2]))
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    model = argv[0]
    only = set(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else None
    with Served([model, "--port", "0", "--device", "cpu", "--served-model-name", "tiny", "--log-level", "warning",
                 "--max-model-len", "8192", "--num-kv-blocks", "4096", "--block-size", "4", "--max-queue-len", "64",
                 "--send-timeout", "10", "--enable-tokenizer-info-endpoint", *server_args],
                "background-storm", OMP_NUM_THREADS="1") as server:
        proc, port = server.proc, int(server.url.rsplit(":", 1)[1])
        print(f"server on port {port}, log {server.log_path}", flush=True)
        rss0 = rss_mb(proc.pid)
        for name, run in (("burst", lambda: asyncio.run(burst(port))),
                          ("followers", lambda: asyncio.run(followers(port, proc.pid))),
                          ("read nothing", lambda: asyncio.run(read_nothing(port, proc.pid))),
                          ("races", lambda: asyncio.run(races(port))),
                          ("invocations", lambda: asyncio.run(invocations(port))),
                          ("tokenizer_info", lambda: asyncio.run(tokenizer_info(port)))):
            if only is not None and name not in only:
                continue
            t0 = time.monotonic()
            said = run()
            idle = check_idle(port, name)
            print(f"{name} ({time.monotonic() - t0:.1f} s; idle {idle:.2f} s after): {said}", flush=True)
        for line in mistakes(port) if only is None or "mistakes" in only else ():
            print("mistakes:", line, flush=True)
        print(f"API server RSS {rss0:.0f} -> {rss_mb(proc.pid):.0f} MB", flush=True)
        PROBLEMS.extend(server.log_problems())
    for p in PROBLEMS[:30]:
        print("  PROBLEM:", p, flush=True)
    print(f"server exit {server.rc}; log {server.log_path}; {len(PROBLEMS)} problems")
    sys.exit(1 if PROBLEMS else 0)


if __name__ == "__main__":
    main()
