"""`tokenmill bench serve` and `bench report`: metric definitions on hand-made timings, the mixed-chat
workload, the offline preset tokenizer, and short sweeps against real `tokenmill serve` and `--backend hf`."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tokenmill.bench.serve import format_level
from tokenmill.bench.serve_args import parse_goodput, parse_percentiles
from tokenmill.bench.serve_http import HTTPClient, send_request
from tokenmill.bench.serve_levels import arrival_times, deal, run_level_processes
from tokenmill.bench.serve_metrics import RequestResult, class_metrics, compute_metrics, tpot_of
from tokenmill.bench.serve_payload import BENCH_TOOLS, build_payload, structured_indices
from tokenmill.bench.serve_datasets import ServeRequest
from tokenmill.bench.serve_datasets import mixed_chat_requests, write_tokenizer_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_metrics_on_hand_made_timings():
    a = RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1],
                      usage_reported=True)
    b = RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2],
                      usage_reported=True)
    c = RequestResult(True, prompt_tokens=4, output_tokens=1, ttft=0.05, latency=0.05, usage_reported=True)
    bad = RequestResult(False, error="HTTP 500")
    assert tpot_of(a) == pytest.approx(0.1) and tpot_of(b) == pytest.approx(0.2) and tpot_of(c) is None
    m = compute_metrics([a, b, c, bad], duration_s=2.0, slos=parse_goodput(["ttft:200", "tpot:150"]))
    assert (m["completed"], m["failed"], m["success_rate"]) == (3, 1, 0.75)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(9 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((34 + 9) / 2.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99))
    assert m["mean_tpot_ms"] == pytest.approx(150.0)          # only requests with > 1 output token
    assert m["mean_itl_ms"] == pytest.approx(np.mean([100] * 4 + [200] * 2))
    assert m["p95_itl_ms"] == pytest.approx(np.percentile([100] * 4 + [200] * 2, 95))
    assert m["mean_e2el_ms"] == pytest.approx(np.mean([500, 700, 50]))
    # the longest wait, of the completed requests only
    assert m["max_ttft_ms"] == pytest.approx(300.0) and m["max_e2el_ms"] == pytest.approx(700.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([100] * 4 + [200] * 2, 99))
    # a meets both SLOs, b misses TTFT and TPOT, c (one token, no TPOT) meets them
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    # the console line names the failures' error, not only the count
    m["label"], m["max_concurrency"], m["distinct_errors"] = "tm", 4, ["HTTP 500"]   # as the level loop fills them
    assert format_level(m).startswith("tm c=4: 3/4 ok, ")
    assert format_level(m).endswith("; 1 distinct error(s), first: HTTP 500")
    # a request without the server's usage: its token counts are chunks, which the line says
    assert m["requests_without_usage"] == 0
    c.usage_reported = False
    assert "WARNING: 1 request(s) without usage" in format_level({**m, **compute_metrics([a, b, c], 2.0)})
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_metric_percentiles_as_vllm_names_them():
    """vLLM's --metric-percentiles adds percentiles to every metric, keyed p25, p99.9 as vLLM's keys."""
    assert parse_percentiles("25, 99.9") == (25.0, 50, 95, 99, 99.9) and parse_percentiles(None) == (50, 95, 99)
    with pytest.raises(ValueError):
        parse_percentiles("101")
    rs = [RequestResult(True, output_tokens=3, ttft=0.01 * (i + 1), latency=0.1 * (i + 1), itl=[0.01, 0.02],
                        usage_reported=True) for i in range(10)]
    m = compute_metrics(rs, 1.0, percentiles=parse_percentiles("25,99.9"))
    assert m["p25_ttft_ms"] == pytest.approx(np.percentile(np.arange(1, 11) * 10.0, 25))
    assert m["p99.9_e2el_ms"] == pytest.approx(np.percentile(np.arange(1, 11) * 100.0, 99.9))
    assert {"p25_tpot_ms", "p99.9_itl_ms", "p50_itl_ms", "p95_ttft_ms"} <= m.keys()


def test_tool_requests_and_their_class_metrics():
    """A fifth of the requests, evenly spread, offer the tools with tool_choice "auto" (chat only); the
    TTFT and E2E statistics of each class come from its own requests."""
    tools = structured_indices(10, 0.2)
    assert tools == {4, 9}
    req = ServeRequest("hello", 8)
    body = build_payload("/v1/chat/completions", "m", req, True, 0.0, tools=BENCH_TOOLS)
    assert body["tools"] == BENCH_TOOLS and body["tool_choice"] == "auto"
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert "tools" not in build_payload("/v1/chat/completions", "m", req, True, 0.0)
    with pytest.raises(ValueError):
        build_payload("/v1/completions", "m", req, True, 0.0, tools=BENCH_TOOLS)
    results = [RequestResult(True, output_tokens=2, ttft=0.01 * (i + 1), latency=1.0 + i) for i in range(10)]
    results[9] = RequestResult(False, error="HTTP 500")
    t = class_metrics(results, tools, "tools")
    assert (t["completed_tools"], t["num_requests_tools"]) == (1, 2)
    assert t["median_ttft_ms_tools"] == pytest.approx(50.0) and t["max_e2el_ms_tools"] == pytest.approx(5000.0)
    rest = class_metrics(results, set(range(10)) - tools, "plain")
    assert rest["completed_plain"] == 8 and rest["max_ttft_ms_plain"] == pytest.approx(90.0)
    assert rest["p95_ttft_ms_plain"] == pytest.approx(np.percentile([10, 20, 30, 40, 60, 70, 80, 90], 95))


def test_poisson_arrivals_seeded():
    """Send times from the level's start: seeded, increasing, the last at n / rate (as vLLM scales them),
    with exponential gaps (their coefficient of variation about 1)."""
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    t = arrival_times(2000, 10.0, 1)
    gaps = np.diff(t)
    assert t == arrival_times(2000, 10.0, 1) and t[-1] == pytest.approx(200.0) and (gaps >= 0).all()
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)
    # vLLM's --burstiness: gamma gaps of shape B, coefficient of variation 1 / sqrt(B); B = 1 is the above
    assert arrival_times(2000, 10.0, 1, burstiness=1.0) == t
    for b in (0.25, 4.0):
        tb = arrival_times(2000, 10.0, 1, burstiness=b)
        assert tb[-1] == pytest.approx(200.0) and np.std(np.diff(tb)) / np.mean(np.diff(tb)) == \
            pytest.approx(b ** -0.5, rel=0.1)
    assert np.diff(arrival_times(5, 10.0, 1, burstiness=float("inf"))) == pytest.approx([0.1] * 4)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _sse(obj) -> bytes:
    return _chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


async def _read_request(reader) -> tuple[str, dict, dict] | None:
    """The next request on a keep-alive connection: (path, headers, JSON body); None once it closes."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if line)
    return lines[0].split()[1], fields, json.loads(await reader.readexactly(int(fields["Content-Length"])))


async def _fake_openai(reader, writer, seen):
    """Answers requests on one keep-alive connection by path: /ok streams a role chunk, two content chunks
    (the second split across writes), usage and [DONE]; /bad is an HTTP 400; /err streams an error object; /stall
    sends the head only."""
    seen["handlers"].append(asyncio.current_task())
    while (request := await _read_request(reader)) is not None:
        path, fields, body = request
        seen["bodies"].append(body)
        seen["auth"].append(fields.get("Authorization"))
        if path == "/bad":
            body = b'{"error": {"message": "max_tokens too large"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            continue
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if path == "/err":
            writer.write(_sse({"error": {"message": "engine died"}}))
            continue
        if path == "/stall":
            await reader.read()             # until the client gives up and closes
            return
        if path == "/empty":
            # tokens whose text is empty (an end-of-sequence token first): chunks with choices, no content
            await asyncio.sleep(0.03)
            writer.write(_sse({"choices": [{"index": 0, "delta": {"content": ""}}]}))
            await writer.drain()
            await asyncio.sleep(0.03)
            writer.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                         + _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
                         + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            continue
        if path in ("/tools", "/nousage"):
            # a tool call's deltas only (as an agent's answer); or text without usage, then a pause before [DONE]
            delta = (lambda a: {"tool_calls": [{"index": 0, "function": {"arguments": a}}]}) if path == "/tools" \
                else (lambda a: {"content": a})
            await asyncio.sleep(0.03)
            writer.write(_sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}))
            await writer.drain()
            await asyncio.sleep(0.03)
            writer.write(_sse({"choices": [{"index": 0, "delta": delta('{"a":')}]}))
            await writer.drain()
            await asyncio.sleep(0.03)
            writer.write(_sse({"choices": [{"index": 0, "delta": delta(' 1}')}]}))
            await writer.drain()
            if path == "/tools":
                writer.write(_sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}))
            await asyncio.sleep(0.2)
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            continue
        writer.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                     + _sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}))
        await writer.drain()
        await asyncio.sleep(0.05)
        second = _sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
        writer.write(second[:9])
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(second[9:] + _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
                     + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


def test_client_reads_sse_errors_and_keeps_connections_alive():
    seen = {"handlers": [], "bodies": [], "auth": []}

    async def main():
        server = await asyncio.start_server(lambda r, w: _fake_openai(r, w, seen), "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = HTTPClient(base, timeout_s=5)
        try:
            ok = await send_request(client, base + "/ok", {"n": 1}, {"Authorization": "Bearer k"})
            bad = await send_request(client, base + "/bad", {"n": 2})
            connections_after_two = len(seen["handlers"])
            err = await send_request(client, base + "/err", {"n": 3})
            again = await send_request(client, base + "/ok", {"n": 4})
            connections_after_four = len(seen["handlers"])
            stalled = await send_request(HTTPClient(base, timeout_s=0.2), base + "/stall", {"n": 5})
            tools = await send_request(client, base + "/tools", {"n": 6})
            no_usage = await send_request(client, base + "/nousage", {"n": 7}, prompt_len=11)
            empty = await send_request(client, base + "/empty", {"n": 8})
        finally:
            await client.aclose()
            server.close()
            await asyncio.wait(seen["handlers"], timeout=2)    # each ends when its client closes
        return ok, bad, connections_after_two, err, again, connections_after_four, stalled, tools, no_usage, empty

    ok, bad, connections_after_two, err, again, connections_after_four, stalled, tools, no_usage, empty = \
        asyncio.run(main())
    # no text at all: timed by the chunks with choices (its TTFT was 0, and TPOT took the whole wait)
    assert empty.success and empty.output_tokens == 2 and 0.025 < empty.ttft < empty.latency, empty
    # reasoning and tool-call deltas are output: the first token at the reasoning chunk (~30 ms), three
    # chunks, and the latency ends at the last of them, not at [DONE] 200 ms later
    for r in (tools, no_usage):
        assert r.success and 0.025 < r.ttft < 0.2 and len(r.itl) == 2 and r.latency < r.ttft + 0.18, r
    assert (tools.prompt_tokens, tools.output_tokens) == (3, 9)
    # no usage: the chunks stand for the output tokens, the dataset's prompt length for the prompt's
    assert (no_usage.usage_reported, no_usage.prompt_tokens, no_usage.output_tokens) == (False, 11, 3)
    assert ok.success and ok.error == "" and ok.usage_reported
    assert (ok.prompt_tokens, ok.output_tokens) == (3, 7)          # the server's usage, not the chunk count
    assert 0 < ok.ttft < 0.05 and len(ok.itl) == 1 and ok.itl[0] >= 0.05 and ok.latency >= ok.ttft + ok.itl[0]
    assert not bad.success and bad.error == 'HTTP 400: {"error": {"message": "max_tokens too large"}}'
    assert connections_after_two == 1                                # both responses ended: one connection
    assert not err.success and err.error == "{'message': 'engine died'}"
    assert again.success and len(again.itl) == 1 and connections_after_four == 2   # /err's connection was dropped
    assert [b["n"] for b in seen["bodies"]][:4] == [1, 2, 3, 4] and seen["auth"][:2] == ["Bearer k", None]
    assert not stalled.success and stalled.error.startswith("TimeoutError")     # the request timeout
    with socket.socket() as s:              # bound, never listening: refused, and no other test can take it
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
        refused = asyncio.run(send_request(HTTPClient(closed, timeout_s=5), closed + "/ok", {}))
    assert not refused.success and refused.error.startswith(("ConnectionRefusedError", "OSError"))
    with pytest.raises(ValueError, match="http://"):
        HTTPClient("https://example.com")


def test_a_last_token_without_text_ends_the_request():
    """An end-of-sequence token comes in a chunk of its own with no text (usage counts it): E2E ends there and
    its gap is an ITL, as vLLM's client has them. Ending at the last content chunk, E2E was one step short and
    TPOT (latency - TTFT) / (5 - 1) spread three gaps over four."""
    gap = 0.03

    async def handle(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                     + _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        for i in range(4):
            await asyncio.sleep(gap)
            writer.write(_sse({"choices": [{"index": 0, "delta": {"content": "ab"}}]}))
            await writer.drain()
        await asyncio.sleep(gap)
        writer.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                     + _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
                     + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = HTTPClient(base, timeout_s=5)
        try:
            return await send_request(client, base + "/v1/chat/completions", {})
        finally:
            await client.aclose()
            server.close()

    r = asyncio.run(main())
    assert r.success and r.output_tokens == 5 and len(r.itl) == 4, r
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.latency - r.ttft > 3.5 * gap and tpot_of(r) > 0.9 * gap, r


@contextlib.contextmanager
def _threaded_server(handle):
    """An asyncio server of `handle` on a loop in a thread of its own (client processes reach it too);
    yields its base URL."""
    import threading
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def test_client_processes_share_a_level():
    """A level read by three client processes: every request answered once, each result back at its own
    request's index (the fake server reports the prompt's length as its usage), the structured requests
    still the ones sent under the schema, and never more requests open at once than the concurrency."""
    import threading
    state = {"open": 0, "most": 0, "schema": []}
    lock = threading.Lock()

    async def handle(reader, writer):
        while (request := await _read_request(reader)) is not None:
            body = request[2]
            with lock:
                state["open"] += 1
                state["most"] = max(state["most"], state["open"])
                if "structured_outputs" in body:
                    state["schema"].append(body["prompt"])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + _sse({"choices": [{"index": 0, "text": "a"}]}))
            await writer.drain()
            await asyncio.sleep(0.05)
            with lock:
                state["open"] -= 1
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2}
            writer.write(_sse({"choices": [{"index": 0, "text": "b"}]}) + _sse({"choices": [], "usage": usage})
                         + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

    with _threaded_server(handle) as base:
        requests = [ServeRequest("x" * (i + 1), 2) for i in range(20)]
        structured = {1, 7, 13}
        results, duration = run_level_processes(3, base, "/v1/completions", "m", requests, 4,
                                                structured=structured)
    assert all(r.success for r in results)
    assert [r.prompt_tokens for r in results] == [i + 1 for i in range(20)]
    assert sorted(len(p) - 1 for p in state["schema"]) == sorted(structured)
    assert 1 < state["most"] <= 4
    assert duration >= 5 * 0.05 and all(0 <= r.start < duration for r in results)


def test_requests_are_dealt_to_client_processes_by_their_slots():
    """Concurrency 4 over 3 processes: 2, 1 and 1 slots. Dealt evenly, the 1-slot processes ran 7
    requests in series while the 2-slot one ran 7 two at a time; dealt by slots, each runs as many rounds."""
    dealt = deal(20, 4, 3)
    assert [slots for _, slots in dealt] == [2, 1, 1]
    assert sorted(j for indices, _ in dealt for j in indices) == list(range(20))
    assert [-(-len(indices) // slots) for indices, slots in dealt] == [5, 5, 5]


def test_each_level_and_the_warm_up_send_prompts_of_their_own(tmp_path):
    """A sweep sent the same requests at every level (and warmed up with the first of them), so every level
    after the first ran on a prefix cache that held its prompts: 13x the requests per second in one run."""
    from tokenmill.bench.cli import main as bench_main
    prompts = []

    async def handle(reader, writer):
        while (request := await _read_request(reader)) is not None:
            body = request[2]
            prompts.append(tuple(body["prompt"]))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + _sse({"choices": [{"index": 0, "text": "a"}]})
                         + _sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}})
                         + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

    with _threaded_server(handle) as base:
        assert bench_main(["serve", "--base-url", base, "--model", "m", "--endpoint", "/v1/completions",
                           "--dataset", "random", "--input-len-range", "8,8", "--output-len-range", "1,1",
                           "--max-concurrency", "1,1,2", "--num-prompts", "4", "--num-warmups", "1",
                           "--hardware", "test", "--no-progress", "--output-dir", str(tmp_path)]) == 0
    assert len(prompts) == 1 + 3 * 4 and len(set(prompts)) == len(prompts)


def test_bad_flags_and_datasets_are_refused_naming_the_value(tmp_path, capsys):
    """Each bad value is refused before any request (or, for `bench throughput`, before a model is
    materialised) with the flag and the value named, where it was a traceback (a malformed dataset file, an
    inverted range, 'abc' as a rate) or no error at all (zero prompts, a negative SLO)."""
    from tokenmill.bench.cli import main as bench_main, parse_args
    serve = ["serve", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    for argv, message in [
        ([*serve, "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        ([*serve, "--dataset", "random", "--input-len-range", "9,3"], "--input-len-range: length range must "
                                                                       "satisfy 1 <= lo <= hi, got (9, 3)"),
        ([*serve, "--mixed-chat-chars", "10,5"], "--mixed-chat-chars: length range"),
        ([*serve, "--request-rate", "abc"], "--request-rate takes requests per second above 0, or inf, got 'abc'"),
        ([*serve, "--request-rate", "0"], "got '0'"),
        ([*serve, "--max-concurrency", "2,0"], "levels of 1 or more, got '2,0'"),
        ([*serve, "--goodput", "ttft:-5"], "got 'ttft:-5'"),
        ([*serve, "--metric-percentiles", "a"], "--metric-percentiles takes comma-separated numbers in [0, 100]"),
        ([*serve, "--percentile-metrics", "ttft,foo"], "--percentile-metrics takes ttft,tpot,itl,e2el, got 'ttft,foo'"),
        ([*serve, "--metadata", "tp"], "--metadata takes KEY=VALUE pairs, got 'tp'"),
        ([*serve, "--metadata", "completed=3"], "--metadata 'completed=3': 'completed' is a key of the result itself"),
        ([*serve, "--dataset", str(tmp_path / "none.json")], "none.json' is neither 'mixed-chat' nor 'random' nor a file"),
        (["throughput", "--model", "preset:qwen3-4b", "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        (["throughput", "--model", "preset:qwen3-4b", "--output-len-range", "5,1"], "--output-len-range: length"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    # vLLM's spellings of what is done anyway are accepted
    args = parse_args([*serve, "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el"])
    assert not args.no_ignore_eos and args.max_concurrency == [1, 4, 8, 16, 32]
    with socket.socket() as s:          # bound, never listening: /v1/models is refused, --model names the model
        s.bind(("127.0.0.1", 0))
        closed = ["serve", "--base-url", f"http://127.0.0.1:{s.getsockname()[1]}", "--model", "m", "--no-progress",
                  "--hardware", "test", "--output-dir", str(tmp_path)]
        for content, message in [("{bad", "is not JSON: Expecting property name"),
                                 ('{"a": 1}', "is a JSON dict, not the list of conversations"),
                                 ("[1, {}]", "holds no conversation with a human and a gpt turn among its 2 entries")]:
            (tmp_path / "d.json").write_text(content)
            with pytest.raises(SystemExit, match=re.escape(message)):
                bench_main([*closed, "--dataset", str(tmp_path / "d.json")])


def _stream_a_token(writer, cut: bool = False) -> None:
    """One output token's chunk, usage and [DONE]; `cut`: the token's chunk only, in a body whose end only
    the server's close marks, which it then closes."""
    if cut:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                     b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        writer.close()
        return
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + _sse({"choices": [{"index": 0, "text": "a"}]})
                 + _sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
                 + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def test_a_stream_cut_before_done_is_a_failed_request():
    """A server that dies after a request's first token, its body ending with the connection: a success of
    one token at the first token's time, where it is a failure."""
    async def handle(reader, writer):
        while (request := await _read_request(reader)) is not None:
            _stream_a_token(writer, cut=request[0] == "/cut")
            await writer.drain()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = HTTPClient(base, timeout_s=5)
        try:
            return [await send_request(client, base + path, {}) for path in ("/cut", "/ok")]
        finally:
            await client.aclose()
            server.close()

    cut, ok = asyncio.run(main())
    assert not cut.success and cut.error == "the stream ended before data: [DONE], after 1 chunk(s) with output"
    assert ok.success and ok.output_tokens == 1


def test_a_failed_warm_up_stops_the_run_and_ctrl_c_keeps_the_levels_done(tmp_path, monkeypatch, capsys):
    """A server that refuses every request (a 404 for a model name, a 400 for a flag) stopped nothing: every
    level ran its requests into the error. The warm-up's failure now ends the run with its error, as vLLM's
    initial test run does. Ctrl-C printed a traceback; it now reports the levels already done (saved)."""
    import tokenmill.bench.serve as bench_serve
    from tokenmill.bench.cli import main as bench_main
    paths = []

    async def handle(reader, writer):
        while (request := await _read_request(reader)) is not None:
            paths.append(request[0])
            if request[2]["model"] == "missing":
                body = b'{"error": {"message": "The model `missing` does not exist."}}'
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            else:
                _stream_a_token(writer)
            await writer.drain()

    with _threaded_server(handle) as base:
        common = ["serve", "--base-url", base, "--endpoint", "/v1/completions", "--dataset", "random",
                  "--input-len-range", "2", "--output-len-range", "1", "--num-prompts", "2", "--hardware", "test",
                  "--no-progress", "--output-dir", str(tmp_path)]
        with pytest.raises(SystemExit, match=re.escape(f"the warm-up request to {base}/v1/completions failed, so "
                                                       "no level was run: HTTP 404: ") + ".*`missing` does not exist"):
            bench_main([*common, "--model", "missing", "--max-concurrency", "1,2"])
        assert len(paths) == 1
        real_run_level = bench_serve.run_level

        def interrupted_second_level(*args, **kwargs):
            if args[4] == 2:           # the second level's concurrency
                raise KeyboardInterrupt
            return real_run_level(*args, **kwargs)
        monkeypatch.setattr(bench_serve, "run_level", interrupted_second_level)
        assert bench_main([*common, "--model", "m", "--max-concurrency", "1,2", "--num-warmups", "0",
                           "--name", "cut"]) == 130
    out = capsys.readouterr()
    assert "interrupted: the 1 completed level(s) only" in out.err
    assert "| server | 1 | 2/2 |" in out.out and "| server | 2 |" not in out.out     # the table of those done
    assert json.loads((tmp_path / "cut.json").read_text())["max_concurrency"] == 1


def test_result_files_read_as_vllm_results(tmp_path):
    """A script written for `vllm bench serve --save-result` files reads ours, where it found one file of
    our own keys for a whole sweep: each level a record of vLLM's keys in vLLM's units (a sweep's levels in
    files of vLLM's default names, or the lines of a --result-filename), --metadata and --save-detailed as
    vLLM's, --append-result adding lines, and our keys beside vLLM's."""
    import glob
    from tokenmill.bench.cli import main as bench_main

    async def handle(reader, writer):
        while (await _read_request(reader)) is not None:
            _stream_a_token(writer)
            await writer.drain()

    with _threaded_server(handle) as base:
        common = ["serve", "--base-url", base, "--model", "org/tiny", "--endpoint", "/v1/completions", "--dataset",
                  "random", "--input-len-range", "2", "--output-len-range", "1", "--num-prompts", "3",
                  "--num-warmups", "0", "--hardware", "test", "--no-progress", "--label", "tm", "--save-result"]
        assert bench_main([*common, "--max-concurrency", "1,2", "--result-dir", str(tmp_path / "sweep"),
                           "--save-detailed", "--metadata", "version=0.3.3", "tp=1"]) == 0
        named = [*common, "--result-dir", str(tmp_path), "--result-filename", "run.json"]
        assert bench_main([*named, "--max-concurrency", "1,2"]) == 0
        assert bench_main([*named, "--max-concurrency", "4", "--append-result"]) == 0
    by_level = {}
    for path in glob.glob(str(tmp_path / "sweep" / "*.json")):
        with open(path) as f:
            r = json.load(f)
        by_level[r["max_concurrency"]] = r
        assert os.path.basename(path) == f"tm-infqps-concurrency{r['max_concurrency']}-tiny-{r['date']}.json"
    assert sorted(by_level) == [1, 2]
    for conc, r in by_level.items():
        assert re.fullmatch(r"\d{8}-\d{6}", r["date"])
        assert (r["backend"], r["endpoint_type"], r["label"], r["model_id"], r["tokenizer_id"]) == \
            ("openai", "openai", "tm", "org/tiny", None)
        assert (r["num_prompts"], r["request_rate"], r["burstiness"]) == (3, "inf", 1.0)
        assert (r["version"], r["tp"]) == ("0.3.3", "1")
        assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (3, 0, 3, 3)
        assert r["request_throughput"] == pytest.approx(3 / r["duration"]) and r["request_goodput"] is None
        assert r["output_throughput"] == pytest.approx(3 / r["duration"])
        assert r["total_token_throughput"] == pytest.approx(6 / r["duration"])
        assert r["max_output_tokens_per_s"] == 3.0 and 1 <= r["max_concurrent_requests"] <= conc
        assert all(isinstance(r[f"{stat}_{metric}_ms"], float) for stat in ("mean", "median", "std", "p99")
                   for metric in ("ttft", "tpot", "itl", "e2el"))
        # --save-detailed: per request, in seconds
        assert (r["input_lens"], r["output_lens"], r["itls"]) == ([1] * 3, [1] * 3, [[]] * 3)
        assert (r["generated_texts"], r["errors"]) == (["a"] * 3, [""] * 3) and len(r["start_times"]) == 3
        assert r["mean_ttft_ms"] == pytest.approx(1e3 * np.mean(r["ttfts"]))
        assert r["mean_e2el_ms"] == pytest.approx(1e3 * np.mean(r["latencies"]))
        assert r["hardware"] == "test" and r["command"].startswith("tokenmill bench serve") and len(r["ttfts_ms"]) == 3
    lines = [json.loads(line) for line in (tmp_path / "run.json").read_text().split("\n")]
    assert [r["max_concurrency"] for r in lines] == [1, 2, 4] and "ttfts" not in lines[0]


def test_mixed_chat_deterministic_and_in_range():
    reqs = mixed_chat_requests(60, seed=3)
    assert reqs == mixed_chat_requests(60, seed=3) and reqs != mixed_chat_requests(60, seed=4)
    lens = [len(r.prompt) for r in reqs]
    assert all(40 <= n <= 1000 for n in lens) and max(lens) > 600 and min(lens) < 300
    assert all(100 <= r.max_tokens <= 300 for r in reqs)
    has_zh = [bool(re.search(r"[\u4e00-\u9fff]", r.prompt)) for r in reqs]
    has_en = [bool(re.search(r"[A-Za-z]{3}", r.prompt)) for r in reqs]
    assert any(has_zh) and any(has_en) and any(z and e for z, e in zip(has_zh, has_en))


def test_preset_tokenizer_covers_the_vocabulary(tmp_path):
    from transformers import AutoTokenizer
    write_tokenizer_dir(str(tmp_path), 700, {"eos_token_id": [690, 689], "bos_token_id": 689})
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 700 and tok.eos_token_id == 690
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>", "<|im_start|>"]) == [690, 689, 699]
    assert all(tok.decode([i]) for i in range(300, 689))
    ids = tok.apply_chat_template([{"role": "user", "content": "你好 hello"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert max(ids) < 700 and 699 in ids


class _Server:
    def __init__(self, model_dir: str, log_path, *args: str):
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", model_dir, "--port", "0",
                                      "--device", "cpu", "--served-model-name", "tiny", "--log-level", "warning",
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = None

    def wait(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while self.url is None:
            m = re.search(r"on (http://[\d.]+:\d+) \(engine pid", self.log_path.read_text())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log_path.read_text()[-3000:]}")
            else:
                time.sleep(0.1)
        return self.url

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def test_sweep_tokenmill_and_hf_then_report(qwen3_dir, tmp_path):
    from tokenmill.bench.cli import main as bench_main

    servers = {"tokenmill": _Server(qwen3_dir, tmp_path / "tm.log", "--max-model-len", "512", "--num-kv-blocks",
                                    "256", "--block-size", "4", "--enable-auto-tool-choice", "--tool-call-parser",
                                    "hermes", "--scheduling-policy", "priority"),
               "hf": _Server(qwen3_dir, tmp_path / "hf.log", "--backend", "hf")}
    try:
        paths = []
        for name, server in servers.items():
            url = server.wait()
            args = ["serve", "--base-url", url, "--max-concurrency", "1,2", "--num-prompts", "4",
                    "--mixed-chat-chars", "30,90", "--mixed-chat-output-len", "4,8", "--goodput", "ttft:5000",
                    "--output-dir", str(tmp_path), "--name", name, "--no-progress", "--hardware", "test-cpu"]
            assert bench_main(args) == 0
            paths.append(str(tmp_path / f"{name}.json"))
        # half the requests offer tools: the server renders and boosts them, the report splits the classes
        assert bench_main(["serve", "--base-url", servers["tokenmill"].url, "--max-concurrency", "2",
                           "--num-prompts", "4", "--mixed-chat-chars", "30,90", "--mixed-chat-output-len", "4,8",
                           "--tools-fraction", "0.5", "--output-dir", str(tmp_path), "--name", "tools",
                           "--no-progress", "--num-warmups", "0"]) == 0
        # completions with token-id prompts, against the hf baseline
        assert bench_main(["serve", "--base-url", servers["hf"].url, "--endpoint", "/v1/completions", "--dataset",
                           "random", "--input-len-range", "4,8", "--output-len-range", "3,5", "--random-vocab-limit",
                           "300", "--max-concurrency", "2", "--num-prompts", "3", "--output-dir", str(tmp_path),
                           "--name", "hf-completions", "--no-progress"]) == 0
    finally:
        for s in servers.values():
            s.stop()
    from tokenmill.bench.serve_results import load_records
    for path, label in zip(paths, servers):
        levels = load_records([path])
        assert [lv["max_concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            assert lv["label"] == label and lv["model_id"] == "tiny" and lv["hardware"] == "test-cpu"
            assert lv["git_commit"] and lv["date"] and lv["command"].startswith("tokenmill bench serve")
            assert lv["failed"] == 0 and lv["completed"] == 4 and lv["requests_without_usage"] == 0
            assert 4 * 4 <= lv["total_output_tokens"] <= 4 * 8 and lv["total_input_tokens"] > 4 * 10
            assert lv["median_ttft_ms"] > 0 and lv["mean_e2el_ms"] >= lv["mean_ttft_ms"]
            assert len(lv["ttfts_ms"]) == 4 and lv["itls_ms"] and lv["good_requests"] <= 4

    with open(tmp_path / "tools.json") as f:
        lv = json.load(f)
    assert lv["tools"]["requests"] == 2 and lv["tools"]["tool_choice"] == "auto"
    assert lv["failed"] == 0 and (lv["completed_tools"], lv["completed_plain"]) == (2, 2)
    assert 0 < lv["median_ttft_ms_tools"] <= lv["max_ttft_ms"] and lv["max_e2el_ms"] >= lv["p99_e2el_ms"]
    assert bench_main(["report", str(tmp_path / "tools.json"), "--output-dir", str(tmp_path / "tools-report"),
                       "--no-plots"]) == 0
    tools_md = (tmp_path / "tools-report" / "REPORT.md").read_text()
    assert "## Requests with tools against the rest" in tools_md and "| tokenmill | 2 | 2/2 |" in tools_md

    assert bench_main(["report", *paths, "--output-dir", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "REPORT.md").read_text()
    assert "| tokenmill | 2 | 4/4 |" in md and "| hf | 1 | 4/4 |" in md and "test-cpu" in md and "## tokenmill against" in md
    assert "## Requests with tools" not in md
    pytest.importorskip("matplotlib")
    for png in ("throughput.png", "latency_p95.png", "ttft_dist.png", "itl_dist.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000 and f"]({png})" in md


def test_ratio_table_compares_only_the_same_workload():
    from tokenmill.bench.report_serve import ratio_table

    def run(label, dataset, rps):
        return {"label": label, "dataset": {"name": dataset}, "max_concurrency": 1, "request_throughput": rps,
                "output_throughput": 100 * rps, "p95_e2el_ms": 1000 / rps, "median_ttft_ms": 10.0}
    table = ratio_table([run("tokenmill", "mixed-chat", 4.0), run("hf-cb", "mixed-chat", 0.5),
                         run("tokenmill-1000in", "random", 2.0)])
    assert "| hf-cb | 1 | 8.00x |" in table
    assert "1000in" not in table


def test_the_benchmark_client_imports_no_torch():
    """`tokenmill bench serve` (its command line, the client and its report) never imports torch: each of
    its client processes would otherwise spend ~1.6 s of CPU on it before its first request (on the CPU
    machine a 2-process run took 5.3-5.6 s with it, 2.0-2.2 s without)."""
    code = ("import sys; import tokenmill.cli, tokenmill.bench.cli, tokenmill.bench.serve, "
            "tokenmill.bench.serve_datasets, tokenmill.bench.report_serve; "
            "tokenmill.bench.cli.build_parser(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]
