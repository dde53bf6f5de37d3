"""What no client may do to the server: crash the engine, stall other clients, hold connections, slip
past the key, or get a 500. Each test here failed before the fix it guards."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

from test_server import ServerProcess, labelled

KEY = "sk-hardening"
TESTS = os.path.dirname(os.path.abspath(__file__))
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def guarded(qwen3_dir, tmp_path_factory):
    """A server with a key, a small body limit and short connection timeouts, behind a proxy's path prefix
    (which its routes answer with and without), naming each exchange in X-Request-Id."""
    s = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("guarded"), "--api-key", KEY, "--max-model-len", "512",
                      "--num-kv-blocks", "512", "--block-size", "4", "--max-request-body-bytes", str(BODY_LIMIT),
                      "--header-timeout", "1", "--body-timeout", "2", "--timeout-keep-alive", "1",
                      "--limit-concurrency", "40", "--max-header-bytes", "16384", "--root-path", "/llm",
                      "--enable-request-id-headers")
    s.headers = AUTH
    yield s
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60, **kw)


def _post_raw(server, path, raw: bytes, headers=AUTH):
    return httpx.post(server.url + path, content=raw, headers={**headers, "Content-Type": "application/json"},
                      timeout=60)


def _assert_openai_error(r, status: int):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


# ----- 1: logprobs beside a request without them ---------------------------------------------------
def test_logprobs_beside_a_request_without_them(guarded):
    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=60) as c:
            long = asyncio.ensure_future(c.post("/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}))
            await asyncio.sleep(0.2)
            with_lp = await asyncio.gather(
                c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "logprobs": 1}),
                c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "logprobs": 0}),
                c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 5, "logprobs": True, "top_logprobs": 2}))
            return await long, with_lp
    long, with_lp = asyncio.run(main())
    assert long.status_code == 200, long.text
    assert long.json()["choices"][0]["logprobs"] is None
    assert len(long.json()["choices"][0]["text"]) > 0
    for r in with_lp:
        assert r.status_code == 200, r.text
    assert len(with_lp[0].json()["choices"][0]["logprobs"]["tokens"]) == 5
    assert all(len(t["top_logprobs"]) == 2 for t in with_lp[2].json()["choices"][0]["logprobs"]["content"])
    assert httpx.get(guarded.url + "/health").status_code == 200


# ----- 2: body size, chat content cap, tokenization off the event loop --------------------------------
def test_bodies_over_the_limit_get_413_before_they_are_read(guarded):
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}).encode()
    err = _assert_openai_error(_post_raw(guarded, "/v1/completions", big), 413)
    assert str(BODY_LIMIT) in err["message"] and "--max-request-body-bytes" in err["message"]

    def chunks():                   # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'
    r = httpx.post(guarded.url + "/v1/completions", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    _assert_openai_error(r, 413)
    small = _post(guarded, "/v1/completions", {"prompt": "x" * 100, "max_tokens": 1})
    assert small.status_code == 200, small.text


def test_chat_content_has_the_prompt_cap():
    from pydantic import ValidationError

    from tokenmill.server.protocol import MAX_PROMPT_CHARS, ChatCompletionRequest
    one = "x" * (MAX_PROMPT_CHARS + 1)
    for content in (one, [{"type": "text", "text": one}]):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": content}]})
    half = "x" * (MAX_PROMPT_CHARS // 2 + 1)
    with pytest.raises(ValidationError, match=str(MAX_PROMPT_CHARS)):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": half},
                                                           {"role": "user", "content": half}]})


def test_tool_call_arguments_count_in_the_chat_cap_and_any_nesting_is_text():
    """A tool call's arguments were outside the chat's character cap: 21 MB of them (7M empty lists) were
    parsed on the event loop (1.3 s, +1.5 GB) and walked on the tokenizer thread, holding other clients'
    prompts 11.6 s; nested past the parser's recursion limit they were a 500. They count now, beside the
    messages' text and reasoning, and arguments too deep to parse reach the template as their text."""
    from pydantic import ValidationError

    from tokenmill.server.protocol import MAX_PROMPT_CHARS, ChatCompletionRequest

    def chat(arguments: str, content: str = "hi", reasoning: str | None = None) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "reasoning_content": reasoning, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "a", "content": "x"}]})
    half = MAX_PROMPT_CHARS // 2 + 1
    with pytest.raises(ValidationError, match="tool call arguments included"):
        chat("[]," * (half // 3 + 1), content="x" * half)
    with pytest.raises(ValidationError, match=str(MAX_PROMPT_CHARS)):
        chat("{}", content="x" * half, reasoning="y" * half)
    with pytest.raises(ValidationError, match=str(MAX_PROMPT_CHARS)):      # vLLM's name of the same text
        ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "x" * half}, {"role": "assistant", "content": "", "reasoning": "y" * half}]})
    deep = "[" * 100_000
    assert chat(deep).chat_messages()[1]["tool_calls"][0]["function"]["arguments"] == deep
    assert chat('{"a": [1]}').chat_messages()[1]["tool_calls"][0]["function"]["arguments"] == {"a": [1]}


def test_tokenization_runs_off_the_event_loop():
    from tokenmill.server.prompts import PromptTokenizer

    class SlowTokenizer:
        def encode(self, text, add_special_tokens=True):
            self.thread = threading.current_thread()
            time.sleep(0.5)
            return [1] * len(text)

    tokenizer = SlowTokenizer()
    prompts = PromptTokenizer(tokenizer, 1000)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.ensure_future(ticker())
        ids = await prompts.encode("abc", True)
        t.cancel()
        return ids, ticks
    ids, ticks = asyncio.run(main())
    assert ids == [1, 1, 1]
    assert tokenizer.thread is not threading.main_thread()
    assert ticks >= 20                  # the loop kept running while the tokenizer worked


def _nested_schema_chat(levels: int) -> dict:
    """A chat body whose JSON schema nests `levels` objects: the body nests 4 + 2 x levels deep."""
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def test_bodies_nested_past_the_limit_are_a_400(guarded):
    """orjson parses 1,024 levels of nesting. A JSON schema 300 objects deep passed it, and its request,
    pickled for the engine core, raised RecursionError in the event-loop tick that sent it: that request
    and every other one sent in the tick waited forever. Bodies now nest at most MAX_JSON_DEPTH levels."""
    from tokenmill.sampling_params import MAX_JSON_DEPTH, json_depth
    deep = _nested_schema_chat(300)
    err = _assert_openai_error(_post(guarded, "/v1/chat/completions", deep), 400)
    assert f"{json_depth(deep)} levels deep; at most {MAX_JSON_DEPTH}" in err["message"], err
    at_limit = _nested_schema_chat((MAX_JSON_DEPTH - 4) // 2)
    assert json_depth(at_limit) == MAX_JSON_DEPTH
    r = _post(guarded, "/v1/chat/completions", at_limit)
    assert r.status_code == 200, r.text
    assert json_depth([[], {"a": [1]}]) == 3 and json_depth("x") == 0


def test_image_parts_are_refused_by_name(guarded):
    """The models served read text only. An image part in a Responses input got a 400 listing the fields of
    every kind of input item ("Unknown or unsupported field(s): role, content, role, content, role,
    image_url"); chat's named its image_url field. Both now say what is not supported."""
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    err = _assert_openai_error(_post(guarded, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, image]}]}), 400)
    assert err["message"].startswith("'input_image' content is not supported") and err["param"] == "input.content"
    err = _assert_openai_error(_post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}), 400)
    assert err["message"].startswith("'image_url' content is not supported") and err["param"] == "messages.content"
    # an item of another kind is checked as that kind alone
    err = _assert_openai_error(_post(guarded, "/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c1", "name": "f"}]}), 400)
    assert "arguments: Field required" in err["message"] and "role" not in err["message"], err


def test_a_request_asking_for_more_logprobs_than_memory_holds_is_a_400():
    """The frontend holds a request's logprob entries until it finishes, ~670 bytes each (32 choices x 1,000
    tokens x 21 entries: +448 MB of the server's memory, 50 MB of JSON, measured on the CPU machine). One
    request of 128 choices x 40,960 tokens x 21 entries would have taken ~74 GB and every other client's
    requests with it. Such a request is now a 400 naming its count and the limit; the requests people send
    with logprobs, including a whole context of one choice with 20 alternatives, pass."""
    from types import SimpleNamespace

    from tokenmill.sampling_params import SamplingParams
    from tokenmill.server.errors import APIError
    from tokenmill.server.request_checks import MAX_LOGPROB_ENTRIES
    from tokenmill.server.serving import Serving

    serving = Serving(SimpleNamespace(tokenizer=None, max_model_len=40960), ["m"], 8)
    prompt = [[1] * 100]
    # max_tokens None, as chat sends it when the client gives none: up to the context's end
    serving.check_room(prompt, SamplingParams(n=1, logprobs=20, max_tokens=None))  # 40,860 x 21 entries
    serving.check_room(prompt, SamplingParams(n=4, logprobs=20, max_tokens=8192))
    serving.check_room(prompt, SamplingParams(n=128, max_tokens=40000))           # no logprobs asked
    with pytest.raises(APIError) as e:
        serving.check_room(prompt, SamplingParams(n=128, logprobs=20, max_tokens=None))
    assert e.value.status == 400 and e.value.param == "logprobs"
    assert f"{128 * 40860 * 21:,} logprob entries" in e.value.message
    assert f"at most {MAX_LOGPROB_ENTRIES:,}" in e.value.message
    with pytest.raises(APIError):
        serving.check_room([[1] * 40000] * 8, SamplingParams(max_tokens=1, prompt_logprobs=20))


def test_a_completions_prompt_logprobs_count_once_a_choice(tokenizer_dir, monkeypatch):
    """A completion repeats its prompt's logprobs (echo with logprobs, or prompt_logprobs) in each of its
    n choices, but they were counted once: n = 32 on a 2,000-token prompt with echo and 20 alternatives
    answered 36 MB of JSON counted as 43,000 entries, so n = 128 could build 128 times the limit. Each
    choice's copy now counts (a chat answer holds them once)."""
    import tokenmill.server.request_checks as request_checks
    from test_openai_api import _in_process_api

    monkeypatch.setattr(request_checks, "MAX_LOGPROB_ENTRIES", 1000)
    post = _in_process_api(tokenizer_dir)
    ids = list(range(10, 30))                    # 20 prompt tokens x 5 entries: 100 a choice
    for extra in ({"prompt_logprobs": 4}, {"echo": True, "logprobs": 4}):
        ok = post("/v1/completions", {"prompt": ids, "max_tokens": 1, "n": 8, **extra})
        assert ok.status_code == 200, ok.text
        refused = post("/v1/completions", {"prompt": ids, "max_tokens": 1, "n": 16, **extra})
        err = _assert_openai_error(refused, 400)
        assert err["param"] == "logprobs" and "16 choices each repeating them" in err["message"], err


def test_a_requests_params_and_whole_answer_are_built_off_the_event_loop(tokenizer_dir, monkeypatch):
    """A grammar's schema is built and checked, and a whole answer's body assembled, in time that grows with
    the request: 3,000 tools with tool_choice "required" held every other client's stream ~0.4 s, n = 128
    with 20 logprobs and 200 tokens ~1 s (lab/loop_stall.py). Both run on a thread now, and the answer's
    logprobs are encoded as each choice is built: held as millions of small objects until the body was
    encoded, they set off full garbage collections (0.3-0.7 s each), which hold the loop from any thread."""
    import orjson

    from test_openai_api import _in_process_api
    from tokenmill.server import serving
    from tokenmill.server.chat import ChoiceText
    from tokenmill.server.protocol import ChatCompletionRequest

    threads, bodies = {}, []
    respond = serving.json_response
    monkeypatch.setattr(serving, "json_response", lambda body, *a: bodies.append(body) or respond(body, *a))

    def recorded(name, fn):
        def wrapper(*args, **kw):
            threads[name] = threading.current_thread()
            return fn(*args, **kw)
        return wrapper
    monkeypatch.setattr(ChatCompletionRequest, "sampling_params",
                        recorded("params", ChatCompletionRequest.sampling_params))
    monkeypatch.setattr(ChoiceText, "message", recorded("answer", ChoiceText.message))
    r = _in_process_api(tokenizer_dir)("/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                        "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    assert set(threads) == {"params", "answer"}
    assert all(t is not threading.main_thread() for t in threads.values()), threads
    body = bodies[-1]
    assert isinstance(body["choices"][0]["logprobs"]["content"], orjson.Fragment)
    assert isinstance(body["prompt_logprobs"], orjson.Fragment)
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] and r.json()["prompt_logprobs"]


def test_a_request_that_cannot_be_pickled_fails_alone(qwen3_dir):
    """Through the Python API a request's parameters may still nest past the pickler's recursion limit. Its
    RecursionError lost every command of the tick (the other request here waited forever); now that request
    fails alone, naming why, and the others of its tick are served."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

    engine = AsyncLLM(EngineConfig(model=qwen3_dir, device="cpu", dtype="float32"), in_process=True)
    deep = {"type": "integer"}
    for _ in range(1000):
        deep = {"type": "object", "properties": {"a": deep}}
    nested = StructuredOutputsParams(json={"type": "integer"})
    nested.json = deep          # set after the constructor, which refuses a schema this deep
    bad = SamplingParams(max_tokens=2, structured_outputs=nested)
    good = SamplingParams(max_tokens=2, ignore_eos=True)

    async def run(rid, params):
        async for out in engine.generate(rid, [5, 6, 7], params):
            last = out
        return len(last.outputs[0].token_ids)

    async def main():
        engine.attach()
        results = await asyncio.wait_for(asyncio.gather(run("bad", bad), run("good", good), return_exceptions=True),
                                         60)
        return results, engine.dead         # before the shutdown, which marks the engine gone
    try:
        (failed, served), dead = asyncio.run(main())
    finally:
        engine.shutdown()
    assert isinstance(failed, ValueError) and "RecursionError" in str(failed), failed
    assert served == 2 and dead is None


def test_a_burst_of_prompts_is_encoded_in_batches_and_a_bad_one_fails_alone():
    """Prompts that arrive while the tokenizer thread works wait for it together: 30 at once, after a first
    one, take batches of at most `batch_max` (10 here) texts, each add_special_tokens flag apart,
    not 30 calls; every request gets its own text's ids, and a text the tokenizer refuses fails its
    request only."""
    from tokenmill.server.prompts import PromptTokenizer

    class BatchTokenizer:
        calls: list[int] = []

        def encode(self, text, add_special_tokens=True):
            if text == "bad":
                raise ValueError("cannot encode 'bad'")
            return [len(text), int(add_special_tokens)]

        def encode_batch(self, texts, add_special_tokens=True):
            self.calls.append(len(texts))
            if len(self.calls) == 1:
                time.sleep(0.2)         # the burst arrives meanwhile; the later batches find it all queued
            return [self.encode(t, add_special_tokens) for t in texts]

    prompts = PromptTokenizer(BatchTokenizer(), 1000)
    prompts.batch_max = 10
    texts = ["x" * (i + 1) for i in range(29)]

    async def main():
        first = asyncio.ensure_future(prompts.encode("first", True))
        await asyncio.sleep(0.05)            # the tokenizer thread is busy with it
        rest = [prompts.encode(t, i % 2 == 0) for i, t in enumerate(texts)]
        got = await asyncio.gather(first, *rest, prompts.encode("bad", True), return_exceptions=True)
        return got
    got = asyncio.run(main())
    assert got[0] == [5, 1]
    assert got[1:-1] == [[i + 1, int(i % 2 == 0)] for i in range(29)]
    assert isinstance(got[-1], ValueError) and "bad" in str(got[-1])
    calls = BatchTokenizer.calls
    # the first alone, then three batches of 10, each split by flag (the bad text's group once more by
    # `encode`, one text at a time)
    assert calls[0] == 1 and sum(calls) == 31 and max(calls[1:]) <= 10 and len(calls) <= 7


def test_a_burst_of_chats_is_rendered_and_encoded_in_few_trips_to_the_thread():
    """A chat is rendered and encoded in one trip to the tokenizer thread, and chats that arrive while it is
    busy share their trips: 20 at once, after a first one, take 1 + 20 / batch_max (8) trips, where a trip
    to render each and another to encode would take at least 24. Each gets its own ids; a template error
    fails its chat alone; a second full batch goes to the thread while one is there."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenmill.server.errors import APIError
    from tokenmill.server.prompts import PromptTokenizer

    release = threading.Event()          # the thread holds the first batch until the burst has arrived

    class ChatTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            if messages[0]["content"] == "bad":
                raise ValueError("no such role")
            return "<" + messages[0]["content"] + ">"

        def encode_batch(self, texts, add_special_tokens=True):
            release.wait(10)
            return [[len(t)] for t in texts]

    class CountingPool(ThreadPoolExecutor):
        trips = 0

        def submit(self, fn, *args, **kwargs):
            CountingPool.trips += 1
            return super().submit(fn, *args, **kwargs)

    prompts = PromptTokenizer(ChatTokenizer(), 1000)
    prompts._pool = CountingPool(1)
    prompts.batch_max = 8

    async def main():
        first = asyncio.ensure_future(prompts.render_chat([{"role": "user", "content": "first"}], True))
        await asyncio.sleep(0)               # at the thread, which holds it
        rest = [asyncio.ensure_future(prompts.render_chat([{"role": "user", "content": "x" * i}], True))
                for i in range(19)]
        bad = asyncio.ensure_future(prompts.render_chat([{"role": "user", "content": "bad"}], True))
        await asyncio.sleep(0)               # every one of the burst waiting
        release.set()
        return await asyncio.gather(first, *rest, bad, return_exceptions=True)
    got = asyncio.run(main())
    assert got[0] == ("<first>", [7])
    assert got[1:-1] == [("<" + "x" * i + ">", [i + 2]) for i in range(19)]
    assert isinstance(got[-1], APIError) and got[-1].status == 400 and "no such role" in got[-1].message
    assert CountingPool.trips == 4


def test_a_shut_down_tokenizer_thread_fails_requests_instead_of_holding_them():
    """While the process exits, its tokenizer pool refuses work: each request that arrives then fails at
    once, the second as the first, rather than waiting for a batch that can never be sent."""
    from tokenmill.server.prompts import PromptTokenizer

    class Plain:
        def encode(self, text, add_special_tokens=True):
            return [len(text)]

    prompts = PromptTokenizer(Plain(), 1000)

    async def main():
        assert await prompts.encode("abc", True) == [3]
        prompts._pool.shutdown()
        for _ in range(2):
            with pytest.raises(RuntimeError):
                await asyncio.wait_for(prompts.encode("abc", True), 5)
    asyncio.run(main())


def test_a_long_text_is_encoded_apart_from_the_others():
    """A prompt near the character limit takes seconds to encode (4M characters: ~5 s); the other clients'
    prompts arriving meanwhile are encoded on the tokenizer's own thread, not queued behind it, and the
    long one's error is its own. Each long text takes 0.5 s here: short prompts queued behind either would
    wait at least that."""
    from tokenmill.server.prompts import LONG_TEXT_CHARS, PromptTokenizer

    class SlowOnLongTexts:
        def encode(self, text, add_special_tokens=True):
            if len(text) > LONG_TEXT_CHARS:
                time.sleep(0.5)
                if text.startswith("bad"):
                    raise ValueError("cannot encode this long text")
            return [len(text)]

        def encode_batch(self, texts, add_special_tokens=True):
            return [self.encode(t, add_special_tokens) for t in texts]

    prompts = PromptTokenizer(SlowOnLongTexts(), 10 * LONG_TEXT_CHARS)
    long_text = "x" * (LONG_TEXT_CHARS + 1)

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        long_one = asyncio.ensure_future(prompts.encode(long_text, True))
        bad_one = asyncio.ensure_future(prompts.encode("bad" + long_text, True))
        await asyncio.sleep(0.05)
        short = await asyncio.gather(*(prompts.encode("y" * (i + 1), True) for i in range(5)))
        short_s = loop.time() - start
        got = await asyncio.gather(long_one, bad_one, return_exceptions=True)
        return short, short_s, got, loop.time() - start
    short, short_s, got, total_s = asyncio.run(main())
    assert short == [[i + 1] for i in range(5)]
    assert short_s < 0.5, f"short prompts waited {short_s:.2f} s behind a long one"
    assert got[0] == [LONG_TEXT_CHARS + 1]
    assert isinstance(got[1], ValueError) and "cannot encode" in str(got[1])
    assert total_s >= 1.0               # the long texts share their thread: one at a time


def test_the_long_texts_tokenizer_is_copied_before_any_request():
    """Copying a Rust tokenizer serializes it holding the GIL (0.2 s for SmolLM2's): made on the first long
    prompt's thread, it held every other stream 1.2 s on the CPU machine. It is made with the server."""
    from tokenmill.server.prompts import LONG_TEXT_CHARS, PromptTokenizer

    class Counted:
        copies = 0

        def encode(self, text, add_special_tokens=True):
            return [len(text)]

        def __deepcopy__(self, memo):
            Counted.copies += 1
            return Counted()

    prompts = PromptTokenizer(Counted(), 10 * LONG_TEXT_CHARS)
    assert Counted.copies == 1
    assert asyncio.run(prompts.encode("x" * (LONG_TEXT_CHARS + 1), True)) == [LONG_TEXT_CHARS + 1]
    assert Counted.copies == 1


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(guarded):
    # 512-token context: a prompt of 400,000 characters cannot fit whatever the tokenizer does
    r = _post(guarded, "/v1/completions", {"prompt": "ab" * 20_000, "max_tokens": 1})
    err = _assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]


# ----- 3: the queue limit counts each waiting request once ----------------------------------------------
def _slow_engine_server(model_dir, tmp_path, *args: str) -> ServerProcess:
    """A server whose engine steps take at least 20 ms (tests/slow_engine.py, imported by the server)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        return ServerProcess(model_dir, tmp_path, *args, "--engine-factory", "slow_engine:make")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def slow_server(qwen3_dir, tmp_path_factory):
    """One sequence at a time, a queue of 4, and steps of at least 20 ms (tests/slow_engine.py); no OpenAPI
    docs; streamed tokens three a chunk."""
    s = _slow_engine_server(qwen3_dir, tmp_path_factory.mktemp("slow"), "--max-model-len", "512", "--num-kv-blocks",
                            "256", "--block-size", "4", "--max-num-seqs", "1", "--max-queue-len", "4",
                            "--disable-fastapi-docs", "--stream-interval", "3")
    yield s
    s.stop(signal.SIGKILL)


def test_max_queue_len_lets_that_many_requests_wait(slow_server):
    s = slow_server

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            async def stream_first_token(body):
                ctx = c.stream("POST", "/v1/completions", json={**body, "stream": True})
                r = await ctx.__aenter__()
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                return ctx, lines           # keep `lines`: collecting it would close the stream
            blocker_ctx, blocker_lines = await stream_first_token(
                {"prompt": "block", "max_tokens": 400, "ignore_eos": True})
            body = {"prompt": "wait", "max_tokens": 2, "ignore_eos": True}
            waiting = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(4)]
            deadline = time.monotonic() + 30
            while s.metrics()["tokenmill:num_requests_waiting"] < 4:     # all 4 reached the engine
                assert time.monotonic() < deadline and not any(w.done() for w in waiting), \
                    [w.result().text for w in waiting if w.done()]
                await asyncio.sleep(0.05)
            over = await c.post("/v1/completions", json=body)
            await blocker_ctx.__aexit__(None, None, None)   # disconnect: the queue moves on
            return over, await asyncio.gather(*waiting)
    over, waited = asyncio.run(main())
    assert [r.status_code for r in waited] == [200] * 4, [r.text for r in waited]
    err = _assert_openai_error(over, 503)
    assert err["code"] == "queue_full" and "4" in err["message"]


def test_a_pipelined_request_whose_client_left_is_aborted(slow_server):
    """A request running with another pipelined behind it on its connection: uvicorn told only the last
    request parsed that the client had gone, so the running one generated all its tokens (8 s here) for no
    one, then wrote to the closed transport (an 'Exception in ASGI application'). It is aborted at once."""
    s = slow_server
    first = json.dumps({"prompt": "left", "max_tokens": 400, "ignore_eos": True}).encode()
    second = json.dumps({"prompt": "behind", "max_tokens": 2}).encode()
    conn = _connect(s)
    conn.sendall(b"".join(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body) for body in (first, second)))
    deadline = time.monotonic() + 30
    while s.metrics()["tokenmill:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.close()
    s.wait_engine_idle(timeout=3)
    assert "Exception in ASGI application" not in s.log_path.read_text()


# ----- 4: lone surrogates ---------------------------------------------------------------------------------

def test_stream_interval_sends_tokens_that_many_a_chunk(slow_server):
    """--stream-interval 3: a stream of 10 tokens (a step every 20 ms or more, so its reader never lags)
    comes as the first token, then chunks of three, the last with what is left: 4 chunks where 10 went
    one a token; its text is the answer's whole."""
    body = {"prompt": "count", "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    whole = httpx.post(slow_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", slow_server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert len(chunks) == 4 and "".join(texts) == whole, texts
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_docs_can_be_turned_off(slow_server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(slow_server.url + path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
    assert httpx.get(slow_server.url + "/v1/models").status_code == 200


def test_disconnect_frees_blocks(slow_server):
    """A streamed request whose client goes mid-stream, and a whole-body one (n=4) whose client gives up while it
    runs, free their blocks at once. On the slow engine (20 ms a step) the 400-token requests still run when
    /metrics shows them holding blocks, however long a busy machine takes to answer it."""
    s = slow_server
    body = {"prompt": list(range(5, 15)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
            # /metrics waits at most 2 s for the core's stats, then reports those of its last answer: ask again
            for _ in range(100):
                usage = s.metrics()["tokenmill:kv_cache_usage_perc"]
                if usage > 0:
                    break
                time.sleep(0.02)
            assert usage > 0
    s.wait_engine_idle(timeout=5)

    async def give_up():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/v1/completions", json=dict(body, stream=False, n=4)))
            for _ in range(500):
                if s.metrics()["tokenmill:kv_cache_usage_perc"] > 0:
                    break
                await asyncio.sleep(0.01)
            assert not task.done()
            task.cancel()
    asyncio.run(give_up())
    s.wait_engine_idle(timeout=5)

def _sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def test_a_background_response_is_cancelled_at_once_and_frees_its_blocks(slow_server):
    """`background`: answered `queued` at once, the response runs in the server, not in its request; cancelled
    while it runs, its engine request is aborted and its KV blocks freed at once (its 400 tokens would take 8 s
    more at 20 ms a step), it is `cancelled` with the output it had generated, and a second cancel returns it
    unchanged. Until it has output it cannot be continued."""
    s = slow_server
    c = s.client()
    r = c.responses.create(model="tiny", input="hello", max_output_tokens=400, temperature=0, background=True)
    assert (r.status, r.background, r.output) == ("queued", True, [])
    for _ in range(500):
        if c.responses.retrieve(r.id).status == "in_progress" and s.metrics()["tokenmill:kv_cache_usage_perc"] > 0:
            break
        time.sleep(0.01)
    assert c.responses.retrieve(r.id).status == "in_progress"
    with pytest.raises(openai.BadRequestError, match="still in progress"):
        c.responses.create(model="tiny", input="x", previous_response_id=r.id)
    cancelled = c.responses.cancel(r.id)
    # what it had generated stays: at least the first token, which its `in_progress` followed
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens >= 1, cancelled
    s.wait_engine_idle(timeout=4)
    assert c.responses.cancel(r.id) == cancelled == c.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="is cancelled"):
        c.responses.create(model="tiny", input="x", previous_response_id=r.id)


def test_a_background_stream_is_resumed_after_a_sequence_number(slow_server):
    """`background` and `stream`: the client reads up to the first text delta and leaves; the response goes on,
    and GET ?stream=true&starting_after=N gives the events after N in order, to its last; from the start, the
    stream is what the client read and then those; its last event carries the stored response."""
    s = slow_server
    body = {"input": "hello", "max_output_tokens": 24, "temperature": 0, "background": True, "stream": True}
    head = []
    with httpx.stream("POST", s.url + "/v1/responses", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                head.append(json.loads(line[6:]))
                if head[-1]["type"] == "response.output_text.delta":
                    break
    assert [e["type"] for e in head[:3]] == ["response.created", "response.queued", "response.in_progress"]
    rid, after = head[0]["response"]["id"], head[-1]["sequence_number"]
    with httpx.stream("GET", f"{s.url}/v1/responses/{rid}?stream=true&starting_after={after}", timeout=30) as r:
        rest = _sse_events(r)
    assert [e["sequence_number"] for e in rest] == list(range(after + 1, after + 1 + len(rest)))
    assert rest[-1]["type"] in ("response.completed", "response.incomplete"), rest[-1]
    with httpx.stream("GET", f"{s.url}/v1/responses/{rid}?stream=true", timeout=30) as r:
        assert _sse_events(r) == head + rest
    stored = httpx.get(f"{s.url}/v1/responses/{rid}").json()
    assert rest[-1]["response"] == stored and stored["usage"]["output_tokens"] > 1
    assert "".join(e["delta"] for e in head + rest if e["type"] == "response.output_text.delta") == \
        stored["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 1}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "x\\udfff"}]}'),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x", "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "\\udc00\\ud800", "max_tokens": 1}'),
])
def test_lone_surrogates_are_a_400(guarded, path, body):
    err = _assert_openai_error(_post_raw(guarded, path, body.encode()), 400)
    assert "surrogate" in err["message"] and "not valid JSON" in err["message"]


def test_a_body_that_is_not_utf8_names_its_first_bad_byte(guarded):
    """orjson reports any invalid UTF-8 as 'surrogates not allowed' at byte 0: the 400 named neither the byte
    nor where it is."""
    r = _post_raw(guarded, "/v1/completions", b'{"max_tokens": 1,\n "prompt": "h\xff\xfei"}')
    err = _assert_openai_error(r, 400)
    assert "not valid UTF-8: byte 0xff" in err["message"] and "line 2, column 14 (byte 31)" in err["message"], err


def test_a_surrogate_pair_is_one_character(guarded):
    r = _post_raw(guarded, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert r.status_code == 200, r.text


# ----- 5: the key before the body, docs behind the key ----------------------------------------------------
def test_routes_answer_under_the_root_path_and_responses_carry_request_ids(guarded):
    """--root-path /llm: a proxy that keeps the prefix and one that strips it reach the same routes, the open
    paths stay open under it, and the schema names it, with no deprecation warning at start (FastAPI's
    root_path argument printed one). --enable-request-id-headers: every answer, a refusal included, carries
    X-Request-Id, the client's own where it sent one."""
    assert "Warning" not in guarded.log_path.read_text()
    for path in ("/llm/health", "/llm/metrics"):
        assert httpx.get(guarded.url + path).status_code == 200, path
    assert httpx.get(guarded.url + "/llm/v1/models").status_code == 401
    models = httpx.get(guarded.url + "/llm/v1/models", headers={**AUTH, "X-Request-Id": "trace-7"})
    assert models.status_code == 200 and models.headers["x-request-id"] == "trace-7"
    assert models.json() == httpx.get(guarded.url + "/v1/models", headers=AUTH).json()
    r = httpx.post(guarded.url + "/llm/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32
    refused = httpx.get(guarded.url + "/v1/models")
    assert refused.status_code == 401 and refused.headers["x-request-id"] != r.headers["x-request-id"]
    assert httpx.get(guarded.url + "/llm/openapi.json", headers=AUTH).json()["servers"] == [{"url": "/llm"}]


def test_the_key_is_checked_before_the_body(guarded):
    err = _assert_openai_error(_post_raw(guarded, "/v1/completions", b"{not json", headers={}), 401)
    assert err["code"] == "invalid_api_key"
    big = b'{"prompt": "' + b"x" * (BODY_LIMIT * 4) + b'"}'
    r = _post_raw(guarded, "/v1/completions", big, headers={"Authorization": "Bearer wrong"})
    _assert_openai_error(r, 401)
    assert r.headers["www-authenticate"].startswith("Bearer")
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
        assert httpx.get(guarded.url + path).status_code == 401, path
        assert httpx.get(guarded.url + path, headers=AUTH).status_code == 200, path
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(guarded.url + path).status_code == 200, path
    assert httpx.get(guarded.url + "/version").json()["version"]


def test_any_of_several_keys_passes_the_guard():
    """vLLM's --api-key K1 K2: either key passes, another (or a prefix of one) is 401, the open paths need none."""
    from tokenmill.server.guard import RequestGuard, api_keys

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = RequestGuard(app, api_keys(["k-one", "k-two"]), BODY_LIMIT)

    async def get(path, key=None):
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(guard), base_url="http://t") as c:
            return (await c.get(path, headers=headers)).status_code

    async def statuses():
        return [await get("/v1/models", key) for key in ("k-one", "k-two", "k-", "k-three", None)] + \
            [await get("/health")]
    assert asyncio.run(statuses()) == [200, 200, 401, 401, 401, 200]
    assert api_keys("k") == ("k",) and api_keys(None) == ()
    with pytest.raises(ValueError, match="the API key is empty"):
        api_keys(["k", " "])


def test_cors_preflight_needs_no_key_and_refusals_carry_cors(guarded):
    r = httpx.options(guarded.url + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.test")
    r = httpx.get(guarded.url + "/v1/models", headers={"Origin": "http://example.test"})
    assert r.status_code == 401 and "access-control-allow-origin" in r.headers
    # an OPTIONS that is no preflight needs the key like any request (it listed each route's methods)
    assert httpx.options(guarded.url + "/v1/chat/completions", timeout=30).status_code == 401


def test_a_compressed_body_and_an_empty_key_are_named(guarded):
    import gzip

    from tokenmill.config import EngineConfig
    from tokenmill.server.launch import run_server
    r = httpx.post(guarded.url + "/v1/completions", timeout=30, content=gzip.compress(b'{"prompt": "x"}'),
                   headers={**guarded.headers, "Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 415 and "Content-Encoding 'gzip' is not supported" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="the API key is empty"):
        run_server(EngineConfig(model="unused"), api_key=" ")
    # a JSON body sent as a form (curl -d) or with no Content-Type: said so, not "a valid dictionary (got bytes)"
    for content_type in (None, "application/x-www-form-urlencoded"):
        r = httpx.post(guarded.url + "/v1/completions", timeout=30, content=b'{"prompt": "x"}',
                       headers={**guarded.headers, **({"Content-Type": content_type} if content_type else {})})
        assert r.status_code == 400 and "send it with 'Content-Type: application/json'" in r.json()["error"]["message"]



def test_a_body_far_over_the_limit_gets_its_413_while_it_is_still_sent(guarded):
    """The 413 is written as soon as the size is known, before the body is read, and the connection closed:
    closing a socket with received bytes unread sends the client a reset, which destroyed the answer before
    an async client (httpx's, which the openai client uses) read it, so it got a ReadError every time (and
    the openai client would send the upload again). The server now shuts its side for writing and drops what
    the client still sends, up to a bound of time and bytes, before it closes."""
    big = json.dumps({"prompt": "x" * (8 << 20), "max_tokens": 1}).encode()

    async def chunks():                 # no Content-Length: refused once the limit has passed
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=30) as c:
            return [await c.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
                    for content in (big, big, big, chunks())]
    for r in asyncio.run(main()):
        err = _assert_openai_error(r, 413)
        assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"], err
        assert r.headers["connection"] == "close"
    # a client that sends for good is cut once the bound passes
    s = _connect(guarded)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
    sent = 0

    def send_for_good():
        nonlocal sent
        try:
            while True:
                s.sendall(b"x" * 65536)
                sent += 65536
        except OSError:
            pass
    sender = threading.Thread(target=send_for_good, daemon=True)
    t0 = time.monotonic()
    sender.start()
    reply = _read_until_closed(s, 10.0)
    sender.join(10.0)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert time.monotonic() - t0 < 5.0 and sent < 96 << 20 and not sender.is_alive(), sent

# ----- 6: slow and idle connections -------------------------------------------------------------------------
def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_slow_header_connections_are_closed(guarded):
    idle = [_connect(guarded) for _ in range(5)]
    # after a response, an idle keep-alive connection goes too (within 3 s of its response, timed meanwhile)
    ka = _connect(guarded)
    ka.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200" in ka.recv(4096)
    answered = time.monotonic()
    slow = _connect(guarded)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for _ in range(6):                  # a header byte every 0.3 s never completes the headers
        try:
            slow.sendall(b"X")
        except OSError:
            break
        time.sleep(0.3)
    assert _closed_within(slow, 3.0)
    assert time.monotonic() - t0 < 4.0
    assert all(_closed_within(s, 3.0) for s in idle)
    assert _closed_within(ka, max(0.01, answered + 3.0 - time.monotonic()))
    for s in idle + [slow, ka]:
        s.close()


def test_a_body_that_never_completes_is_cut(guarded):
    """Headers that announce more body than the client sends held the connection (and a slot under
    --limit-concurrency) forever, whether the client sent nothing more or a byte now and then: the body must
    now be complete within --body-timeout (2 s here) of the headers. The server serves on."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    silent, trickling = _connect(guarded), _connect(guarded)
    for s in (silent, trickling):
        s.sendall(head + b'{"prompt": ')
    t0 = time.monotonic()
    for _ in range(8):                  # a body byte every 0.3 s, never the whole body
        try:
            trickling.sendall(b" ")
        except OSError:
            break
        time.sleep(0.3)
    assert _closed_within(trickling, 3.0) and _closed_within(silent, 1.0)
    assert 1.5 < time.monotonic() - t0 < 5.0
    r = _post(guarded, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    for s in (silent, trickling):
        s.close()


def test_headers_over_the_limit_get_431(guarded):
    """httptools holds a request's line and headers until they are complete: one header line streamed at the
    server grew its memory by ~125 MB in 8 s (85 MB sent), before any key was checked. Over
    --max-header-bytes (16 KiB here) the request gets 431 and its connection is closed; a request with
    headers under the limit, and a body far over it, is served on the same server."""
    s = _connect(guarded)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    try:
        while sent < 512 << 20:
            s.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    reply = _read_until_closed(s, 5.0)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    # what follows the 431 is dropped unparsed, and cut at the lingering close's bound (64 MiB)
    assert b"16384 bytes" in reply and sent < 96 << 20
    big_url = _post(guarded, "/v1/completions?" + "q" * 20000, {"prompt": "x", "max_tokens": 1})
    assert big_url.status_code == 431
    ok = httpx.post(guarded.url + "/v1/completions", json={"prompt": "x" * 40000, "max_tokens": 1},
                    headers={**AUTH, "X-Padding": "p" * 12000}, timeout=60)
    assert ok.status_code == 400 and "context length" in ok.text    # read and judged, not refused for its size


def _exchange(server, data: bytes, seconds: float = 5.0) -> bytes:
    """What the server answers `data` on one connection, until it closes it."""
    s = _connect(server)
    s.sendall(data)
    return _read_until_closed(s, seconds)


def _read_until_closed(s, seconds: float) -> bytes:
    """What the socket receives until the server closes it (or `seconds` pass without a byte); closes it."""
    s.settimeout(seconds)
    reply = b""
    try:
        while chunk := s.recv(65536):
            reply += chunk
    except OSError:
        pass
    s.close()
    return reply


def test_a_malformed_request_is_answered_after_the_requests_before_it(guarded):
    """A complete request followed on its connection by one that cannot be parsed, or whose headers are too
    large: uvicorn wrote its 400 (or the 431) at once and closed, so the first request's response was lost and
    its client read the refusal as that request's answer. Responses now come in order, the refusal last."""
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    for second, status in ((b"GARBAGE\r\n\r\n", b"400"),
                           (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", b"431")):
        reply = _exchange(guarded, models + models + second)
        assert re.findall(rb"HTTP/1.1 (\d+) ", reply) == [b"200", b"200", status], reply[:300]
        assert reply.count(b'"object":"list"') == 2 and reply.endswith(b"}"), reply[-300:]


def test_a_request_that_is_not_http_is_told_what_is_wrong(guarded):
    """uvicorn answered every request the parser refused with a plain-text 'Invalid HTTP request received.':
    the 400 now says what the parser found, in the error shape."""
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    for request, says in ((b"GARBAGE / HTTP/1.1\r\n\r\n", "Invalid method"),
                          (post + b"Content-Length: -5\r\n\r\n", "Invalid character in Content-Length"),
                          (post + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}", "Duplicate Content-Length"),
                          (post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "Invalid character in chunk size")):
        reply = _exchange(guarded, request)
        assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
        err = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert err["type"] == "invalid_request_error" and says in err["message"], err


def test_arrays_that_cannot_fit_are_refused_before_validation(guarded):
    """Validation runs on the event loop at ~60 ns to ~10 us an element: a 32 MB body of 16M prompt ids held
    every other client ~2 s, 300,000 messages 4.3 s, 1.5M logit_bias entries 3.2 s, /detokenize of 8M ids
    4.2 s, 300,000 content parts 1.6 s, 50,000 tools 1.8 s, 300,000 one-character prompts (1.1 MB) 2.0 s.
    Arrays that cannot fit what they are for are now refused right after parsing: here the bodies' other
    fields (an invalid max_tokens) are never read."""
    bad = {"max_tokens": "not a number"}
    cases = [("/v1/completions", {"prompt": [7] * 600, **bad}, "prompt", "600 tokens"),
             ("/v1/completions", {"prompt": [[1, 2], [7] * 600], **bad}, "prompt", "600 tokens"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 600, **bad}, "messages",
              "600 messages"),
             ("/detokenize", {"tokens": [7] * 600}, "tokens", "600 token ids"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 600}],
                                       **bad}, "messages", "600 messages, content parts or tool calls"),
             # a message's tool calls, a document's fields, vllm_xargs' entries: 1M tool calls of null (6 MB)
             # held the loop 6.8 s making an error of each
             ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [None] * 600}], **bad},
              "messages", "600 messages, content parts or tool calls"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "documents": [{f"k{i}": None for i in range(600)}], **bad},
              "documents", "600 documents or document fields"),
             ("/v1/completions", {"prompt": "x", "vllm_xargs": {f"k{i}": None for i in range(257)}, **bad},
              "vllm_xargs", "257 entries; at most 256"),
             ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                           "output": [{"type": "input_text", "text": "x"}] * 600}],
                                "max_output_tokens": "x"}, "input", "600 input items or content parts"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}] * 600, **bad},
              "tools", "600 tools"),
             ("/v1/completions", {"prompt": ["x"] * 300, **bad}, "prompt", "300 prompts"),
             ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(600)}, **bad},
              "logit_bias", "600 entries"),
             # OpenAI's limit on metadata (16 pairs), and more template variables than any template reads:
             # 1M metadata pairs (16 MB) held the loop ~1 s, 1M chat_template_kwargs 1.7 s
             ("/v1/completions", {"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}, **bad}, "metadata",
              "17 entries; at most 16"),
             ("/v1/responses", {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}, "max_output_tokens": "x"},
              "metadata", "17 entries"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "chat_template_kwargs": {f"k{i}": 1 for i in range(257)}, **bad},
              "chat_template_kwargs", "257 entries; at most 256")]
    for path, body, param, says in cases:
        err = _assert_openai_error(_post(guarded, path, body), 400)
        assert err["param"] == param and says in err["message"], (path, err)
    # what fits, and prompts of text, are validated as before
    r = _post(guarded, "/v1/completions", {"prompt": [7] * 10, **bad})
    assert _assert_openai_error(r, 400)["param"] == "max_tokens"
    r = _post(guarded, "/v1/completions", {"prompt": ["a"] * 600, "max_tokens": 1})
    assert "context length" not in _assert_openai_error(r, 400)["message"]
    r = _post(guarded, "/v1/completions", {"prompt": "x", "max_tokens": 1, "metadata": {"k" * 65: "v"}})
    assert _assert_openai_error(r, 400)["param"].startswith("metadata")


def test_a_client_that_stops_reading_is_dropped():
    """A response's writes wait while the client's buffers are full; a client that read nothing more held its
    request's handler, the unread response and its connection for good. The protocol now drops the connection
    once writing has waited --send-timeout, and not while the client keeps reading. (Served, the response must
    first fill the kernel's socket buffers, megabytes on loopback: here the transport's calls are played.)"""
    import uvicorn
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.server import ServerState

    from tokenmill.server.connections import protocol_with_limits

    class Transport:
        aborted = False

        def abort(self):
            self.aborted = True

    async def main():
        protocol = protocol_with_limits(10.0, 10.0, 0.2, 65536, reject=print)(uvicorn.Config(app=None), ServerState(), {})
        transport = Transport()
        protocol.transport, protocol.flow = transport, FlowControl(transport)
        protocol.pause_writing()                 # the client reads again in time: kept
        await asyncio.sleep(0.1)
        protocol.resume_writing()
        await asyncio.sleep(0.3)
        kept = not transport.aborted
        protocol.pause_writing()                 # then reads nothing more
        await asyncio.sleep(0.3)
        return kept, transport.aborted
    kept, dropped = asyncio.run(main())
    assert kept and dropped


def test_connections_beyond_the_limit_get_503(guarded):
    """Each such 503 counts in request_rejected_total{reason="too_many_connections"}, as the 503s of a full
    queue do (it counted in none: an overloaded server's refusals were missing from its metrics)."""
    def rejected():
        return labelled(httpx.get(guarded.url + "/metrics", timeout=10).text, "tokenmill:request_rejected_total",
                        reason="too_many_connections")
    before = rejected()
    held = [_connect(guarded) for _ in range(40)]
    try:
        time.sleep(0.2)
        r = httpx.get(guarded.url + "/health", timeout=10)
        # in the error shape, naming the limit (uvicorn's was plain text, 'Service Unavailable')
        err = _assert_openai_error(r, 503)
        assert err["code"] == "too_many_connections" and "limit of 40" in err["message"], err
        assert r.headers["retry-after"] == "1"
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
    assert rejected() - before == 1


def test_a_burst_past_the_connection_limit_is_served_up_to_the_limit(guarded):
    """60 connections open at once on a server with a limit of 40: every open connection counted, so the
    requests got 503 until refusals had closed enough connections, the earliest connections' first (a burst
    whose requests arrive together got 503 on every one). The 40 opened first are served, the others get 503."""
    burst = [_connect(guarded) for _ in range(60)]
    try:
        time.sleep(0.2)                     # all accepted, well within the 1 s header timeout
        # kept alive (for the fixture's 1 s) once served: a served connection that closed at once, before the
        # later requests of the burst had arrived, would let a 41st in under the limit
        for s in burst:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        statuses = [_read_until_closed(s, 5.0)[9:12] for s in burst]
    finally:
        for s in burst:
            s.close()
    assert statuses == [b"200"] * 40 + [b"503"] * 20, statuses


def test_a_body_of_many_mistakes_makes_few_errors():
    """Pydantic makes an error of each mistake, and the event loop spent ~6 us on each (made, turned into dicts by
    FastAPI, described): 1M unknown fields (a 14 MB body, /invocations or any endpoint) held it 6.4 s and were
    answered with 8.9 MB naming them all; 1M nulls in a Responses `include` 7.9 s. Two or more unknown fields of
    one object are one error, naming the first 8 and how many more; lists that no bound before validation holds
    stop at their first mistake; and the message names at most 8 unknown fields, whatever their errors."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from tokenmill.server.errors import describe_validation_error
    from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
    from tokenmill.server.protocol.responses import ResponsesRequest

    def refused(model, body) -> tuple[int, str, str]:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.value.errors()]
        return e.value.error_count(), *describe_validation_error(RequestValidationError(errors))
    chat = {"messages": [{"role": "user", "content": "x"}]}
    many = {f"k{i}": 0 for i in range(1000)}
    count, message, param = refused(ChatCompletionRequest, {**chat, **many})
    assert (count, param) == (1, "k0") and message == ("Unknown or unsupported field(s): k0, k1, k2, k3, k4, k5, k6, "
                                                       "k7 (and 992 more)"), message
    count, message, param = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", **many}]})
    assert (count, param) == (1, "messages.0.k0") and message.endswith("messages.0.k7 (and 992 more)"), message
    # two in each of 100 messages: the list stops at its first bad message, and names both of its fields
    count, message, _ = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "a": 1, "b": 2}]
                                                        * 100})
    assert count == 1 and message == "Unknown or unsupported field(s): messages.0.a, messages.0.b", message
    for model, body in ((ResponsesRequest, {"input": "x", "include": [None] * 1000}),
                        (CompletionRequest, {"prompt": "x", "guided_choice": [None] * 1000}),
                        (CompletionRequest, {"prompt": "x", "structured_outputs": {"choice": [None] * 1000}}),
                        (CompletionRequest, {"prompt": "x", "vllm_xargs": {"k": [None] * 1000}})):
        count, message, _ = refused(model, body)
        assert count <= 6 and ".0" in message and ".1:" not in message, (count, message)



# ----- 8, 9: strict types and one error shape ------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("max_tokens", "10"), ("n", 1.0), ("stream", "yes"), ("logprobs", True),
                                         ("prompt", [True]), ("temperature", "0.5"), ("ignore_eos", 1)])
def test_types_are_not_coerced(guarded, field, value):
    body = {"prompt": "x", "max_tokens": 1, field: value}
    err = _assert_openai_error(_post(guarded, "/v1/completions", body), 400)
    assert err["param"] == field and field in err["message"], err


def test_chat_types_are_not_coerced(guarded):
    r = _post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1})
    assert _assert_openai_error(r, 400)["param"] == "logprobs"


def test_responses_types_are_not_coerced(guarded):
    """`background` is a strict bool (0 is not false), refused by name when true without the store."""
    for value, says in ((0, "valid boolean"), (True, "needs 'store' true")):
        r = _post(guarded, "/v1/responses", {"input": "x", "max_output_tokens": 1, "background": value, "store": False})
        err = _assert_openai_error(r, 400)
        assert err["param"] == "background" and says in err["message"], err
    assert _post(guarded, "/v1/responses", {"input": "x", "max_output_tokens": 1, "background": False}).status_code == 200


def test_malformed_json_says_where(guarded):
    err = _assert_openai_error(_post_raw(guarded, "/v1/completions", b'{"prompt": "x",\n "max_tokens": }'), 400)
    assert "not valid JSON" in err["message"] and "line 2" in err["message"], err
    assert err["param"] is None


def test_error_codes_are_strings_or_null(guarded):
    cases = [_post(guarded, "/v1/completions", {"model": "nope", "prompt": "x"}),
             _post(guarded, "/v1/completions", {"prompt": "x", "frobnicate": 1}),
             httpx.get(guarded.url + "/v1/nothing-here", headers=AUTH),
             httpx.get(guarded.url + "/v1/completions", headers=AUTH),
             _post(guarded, "/v1/completions", {"prompt": "x", "max_tokens": 10_000})]
    for r in cases:
        assert r.status_code in (400, 404, 405), r.text
        _assert_openai_error(r, r.status_code)


# ----- 10: bytes still pending at the end come out as U+FFFD -------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_finished_text_equals_a_decode_of_all_tokens(tokenizer_dir, data):
    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    tok = _tokenizer(tokenizer_dir)
    ordinary = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    ids = data.draw(st.lists(st.sampled_from(ordinary), min_size=1, max_size=12))
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), [], True)
    for t in ids:
        detok.add(t)
    assert detok.output_text(True) == tok.decode(ids, skip_special_tokens=True)


def test_a_split_character_at_the_end_is_u_fffd(tokenizer_dir):
    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    tok = _tokenizer(tokenizer_dir)
    byte_chars = _bytes_to_unicode()
    mountain = "山".encode()
    ids = [tok.hf.convert_tokens_to_ids(byte_chars[b]) for b in mountain[:2]]
    detok = IncrementalDetokenizer(tok, tok.encode("从前有一座"), [], True)
    for t in ids:
        detok.add(t)
    assert detok.output_text(False) == ""
    assert detok.output_text(True) == "\ufffd" == tok.decode(ids)


_TOKENIZERS: dict = {}


def _tokenizer(path):
    from tokenmill.engine.tokenizer import Tokenizer
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = Tokenizer(path)
    return _TOKENIZERS[path]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, which byte-level BPE vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def test_tokenize_counts_a_text_longer_than_the_context(guarded):
    """/tokenize counts any text (clients count one to cut it to fit: vLLM checks no length there); one
    longer than a bound of the context's characters was refused without being counted."""
    r = _post(guarded, "/tokenize", {"prompt": "ab cd " * 1500})
    assert r.status_code == 200, r.text
    assert r.json()["count"] > r.json()["max_model_len"]


def test_continuous_usage_of_a_completion_chunk_is_its_choices(guarded):
    """stream_options.continuous_usage_stats: each chunk's usage is its own choice's (vLLM's): its prompt's
    tokens and its tokens so far. It was the total over every prompt and choice seen so far."""
    body = {"prompt": [[5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13]], "n": 2, "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        i = choice["index"]
        prompt = 3 if i < 2 else 9
        assert chunk["usage"]["prompt_tokens"] == prompt, chunk
        assert chunk["usage"]["completion_tokens"] >= seen.get(i, 0)
        seen[i] = chunk["usage"]["completion_tokens"]
    assert seen == {0: 3, 1: 3, 2: 3, 3: 3}
    assert chunks[-1]["usage"]["prompt_tokens"] == 12 and chunks[-1]["usage"]["completion_tokens"] == 12


def test_continuous_usage_of_a_chat_chunk_is_its_choices(guarded):
    """The same in chat: each chunk's usage counts its own choice's tokens so far, and the role chunk none
    (vLLM's). It counted every choice's tokens, and the role chunk those of the first output. Asked for
    alone, continuous_usage_stats gives the usage too (vLLM's include_usage defaults to true): it gave none."""
    for options in ({"include_usage": True, "continuous_usage_stats": True}, {"continuous_usage_stats": True}):
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "ignore_eos": True,
                "stream": True, "stream_options": options}
        with httpx.stream("POST", guarded.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        role, *middle, last = chunks
        assert [c["delta"]["role"] for c in role["choices"]] == ["assistant", "assistant"]
        assert role["usage"]["completion_tokens"] == 0, options
        prompt = last["usage"]["prompt_tokens"]
        seen: dict[int, int] = {}
        for chunk in middle:
            (choice,) = chunk["choices"]
            assert chunk["usage"]["prompt_tokens"] == prompt
            assert chunk["usage"]["completion_tokens"] >= seen.get(choice["index"], 0), chunk
            seen[choice["index"]] = chunk["usage"]["completion_tokens"]
        assert seen == {0: 3, 1: 3} and last["usage"]["completion_tokens"] == 6


def test_a_model_without_a_tokenizer_refuses_what_needs_one(tmp_path, save_tiny_model):
    """Served without a tokenizer (as the random-weight presets are), a text prompt, echo, logprobs, stop
    strings, chat, /tokenize and /detokenize were 500s (AttributeError on None), a streamed one cut after
    its first chunk; each is a 400 naming its field. Token-id prompts are served. A batch of more prompts
    than --max-queue-len was a 503 to retry, which no retry could pass: a 400. HEAD answers on a model's
    card as on the list."""
    model = tmp_path / "model"
    save_tiny_model(str(model), "qwen3")
    s = ServerProcess(str(model), tmp_path, "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "4",
                      "--max-queue-len", "2")
    try:
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text
        for path, body, field in [
                ("/v1/completions", {"prompt": "hello"}, "prompt"),
                ("/v1/completions", {"prompt": [5, 6], "echo": True}, "echo"),
                ("/v1/completions", {"prompt": [5, 6], "logprobs": 1}, "logprobs"),
                ("/v1/completions", {"prompt": [5, 6], "logprobs": 1, "stream": True}, "logprobs"),
                ("/v1/completions", {"prompt": [5, 6], "stop": ["x"]}, "stop"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                ("/tokenize", {"prompt": "hello"}, "prompt"),
                ("/detokenize", {"tokens": [5, 6]}, "tokens")]:
            r = httpx.post(s.url + path, json={"max_tokens": 3, **body} if path.startswith("/v1") else body,
                           timeout=30)
            err = _assert_openai_error(r, 400)
            assert err["param"] == field and f"without a tokenizer, which '{field}' needs" in err["message"], err
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [[5], [6], [7]], "max_tokens": 1}, timeout=30)
        err = _assert_openai_error(r, 400)
        assert err["message"] == "'prompt' holds 3 prompts; this server queues at most 2 (--max-queue-len)."
        assert httpx.head(s.url + "/v1/models/tiny", timeout=30).status_code == 200
    finally:
        assert s.stop() == 0, s.log_path.read_text()[-3000:]


# ----- 11: no tokenizer warning for prompts the engine refuses ----------------------------------------------
def test_long_prompts_log_no_tokenizer_length_warning(tokenizer_dir, tmp_path, caplog):
    import shutil

    from tokenmill.engine.tokenizer import Tokenizer
    path = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = 16
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer(str(path))
    with caplog.at_level(logging.WARNING):
        ids = tok.encode("hello world " * 50)
    assert len(ids) > 16
    assert "sequence length is longer" not in caplog.text


# ----- 7: exit statuses ------------------------------------------------------------------------------------
def test_a_second_sigterm_cuts_requests_with_errors_and_exits_nonzero(slow_server):
    """Runs last on `slow_server`: one stream runs, three requests wait; two SIGTERMs cut them all."""
    s = slow_server
    body = {"prompt": "long", "max_tokens": 500, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            async def stream():
                lines = []
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                return lines
            streaming = asyncio.ensure_future(stream())
            while s.metrics()["tokenmill:num_requests_running"] < 1:
                await asyncio.sleep(0.05)
            plain = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(3)]
            while s.metrics()["tokenmill:num_requests_waiting"] < 3:
                await asyncio.sleep(0.05)
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            s.proc.send_signal(signal.SIGTERM)
            return await streaming, await asyncio.gather(*plain)
    lines, plain = asyncio.run(main())
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["error"]["code"] == "shutting_down", last
    assert len(lines) > 3                                  # it was streaming when it was cut
    for r in plain:
        assert _assert_openai_error(r, 503)["code"] == "shutting_down"
    assert s.proc.wait(30) == 1


# ----- 15: a port in use is said plainly, before the engine starts -----------------------------------------
def test_a_port_in_use_is_refused_at_once_with_a_clear_message(qwen3_dir):
    import subprocess
    import sys
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(TESTS), "src"))
    try:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", qwen3_dir, "--device", "cpu",
                            "--port", str(port)], capture_output=True, text=True, timeout=120, env=env)
        took = time.monotonic() - t0
    finally:
        holder.close()
    assert p.returncode == 1, p.stderr[-2000:]
    assert f"port {port}" in p.stderr and "already in use" in p.stderr and "--port" in p.stderr
    assert "Traceback" not in p.stderr and "engine ready" not in p.stderr
    assert took < 60


def test_a_burst_larger_than_the_pipe_buffer_reaches_the_engine_under_uvloop(qwen3_dir):
    """uvloop makes a watched descriptor non-blocking: the one message of a tick's commands, once larger
    than the socket buffer while the core was busy, failed with EAGAIN and marked the engine dead (1,012 of
    1,024 requests failed at concurrency 1,024 on the H200). The pipe must stay blocking under uvloop (the
    check that fails without the fix: whether a burst hits EAGAIN depends on the core's timing), and a
    burst larger than the socket buffer is served whole."""
    import uvloop

    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.sampling_params import SamplingParams

    engine = AsyncLLM(EngineConfig(model=qwen3_dir, device="cpu", dtype="float32", max_num_seqs=128),
                      in_process=True)

    # 500 prompts of 241 tokens (ids >= 256 pickle to 3 bytes): one message of ~380 KB, past what the
    # socket takes at once (~210 KB); a shared 240-token prefix keeps their prefill cheap (prefix cache)
    prefix = [256 + (7 * j) % 250 for j in range(240)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    async def one(i: int):
        async for out in engine.generate(f"b{i}", prefix + [5 + i % 200], params):
            last = out
        return len(last.outputs[0].token_ids)

    async def main():
        engine.attach()
        assert os.get_blocking(engine._conn.fileno())
        return await asyncio.gather(*(one(i) for i in range(500)))    # 500 AddRequests in one message

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            counts = runner.run(main())
        assert engine.dead is None and counts == [1] * 500
    finally:
        engine.shutdown()


def test_prompt_logprobs_score_a_long_prompt_a_slice_at_a_time(qwen3_dir, monkeypatch):
    """Prompt logprobs took the logits of a whole prompt chunk at once, [max_num_batched_tokens x vocabulary]
    in float32: 5 GB on qwen3-4b for one request's 8,192-token chunk, beyond the memory the start-up profile
    left (it sized the KV cache around the logits of max_num_seqs rows), so one client could run the GPU out
    of memory. They are now scored `ROWS_AT_ONCE` positions at a time, with the same values."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.runner import prompt_logprobs

    llm = LLM(qwen3_dir, device="cpu", dtype="float32", enable_prefix_caching=False)
    model = llm.engine.runner.model
    rows = []
    compute_logits = model.compute_logits

    def counted(hidden):
        rows.append(hidden.shape[0])
        return compute_logits(hidden)
    monkeypatch.setattr(model, "compute_logits", counted)
    prompt = [5 + (7 * i) % 300 for i in range(40)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)

    def scored():
        out = llm.generate([prompt], params)[0].prompt_logprobs
        return [None if p is None else {t: (v.logprob, v.rank) for t, v in p.items()} for p in out]
    whole = scored()
    assert max(rows) >= 39
    rows.clear()
    monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 7, raising=False)
    sliced = scored()
    assert len(whole) == 40 and sliced[0] is whole[0] is None
    # the same tokens and ranks; the values to float rounding (a product of 7 rows need not round as one of
    # 40 does where torch has several threads)
    for got, want in zip(sliced[1:], whole[1:]):
        assert {t: rank for t, (_, rank) in got.items()} == {t: rank for t, (_, rank) in want.items()}
        assert all(abs(got[t][0] - want[t][0]) < 1e-5 for t in want), (got, want)
    assert max(rows) <= 7, rows


def test_prompt_logprobs_of_n_choices_are_scored_once(qwen3_dir, monkeypatch):
    """The n sequences of a request share its prompt, whose logprobs are reported once, but each of them
    scored the whole prompt and held its entries in the engine core: n = 32 on a 2,000-token prompt took the
    bundled model 41 s instead of 1.2 s, and n = 128 held 128 copies. Now the first sequence scores it and
    the others read the prompt from the prefix cache."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.runner import prompt_logprobs

    llm = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4)
    scored = []
    compute = prompt_logprobs.compute

    def counted(model, requests, num_new_tokens, qsl, hidden):
        out = compute(model, requests, num_new_tokens, qsl, hidden)
        scored.extend(len(part.logprobs) for part in out)
        return out
    monkeypatch.setattr(prompt_logprobs, "compute", counted)
    prompt = [5 + (7 * i) % 300 for i in range(40)]
    one = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0))[0]
    assert sum(scored) == 39
    scored.clear()
    many = llm.generate([prompt], SamplingParams(n=6, max_tokens=2, prompt_logprobs=2, temperature=0))[0]
    assert sum(scored) == 39, scored
    assert len(many.outputs) == 6 and all(c.token_ids == one.outputs[0].token_ids for c in many.outputs)
    assert [None if p is None else sorted(p) for p in many.prompt_logprobs] == \
        [None if p is None else sorted(p) for p in one.prompt_logprobs]
    assert llm.engine.get_stats()["num_free_blocks"] == llm.engine.get_stats()["num_total_blocks"]

def _self_signed(tmp_path) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1 (also a CA: it signs itself)."""
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate with")
def test_https_with_client_certificates(qwen3_dir, tmp_path, capsys):
    """--ssl-keyfile/--ssl-certfile serve HTTPS (and say so), --ssl-ca-certs with --ssl-cert-reqs 2 refuses
    a client without a certificate, and the connection guards hold inside TLS. Files that cannot serve are
    refused before the model loads, naming the file."""
    import ssl
    from tokenmill.cli import main
    key, cert = _self_signed(tmp_path)
    for args, says in ((["--ssl-keyfile", key], "ssl_keyfile and ssl_certfile go together"),
                       (["--ssl-keyfile", key, "--ssl-certfile", str(tmp_path / "none.pem")],
                        "none.pem' with ssl_keyfile"),
                       (["--ssl-keyfile", cert, "--ssl-certfile", cert], "not a PEM certificate and its private key"),
                       (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "2"], "needs the CAs")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", qwen3_dir, "--device", "cpu", "--port", "0", *args])
        assert exit_.value.code == 2 and says in capsys.readouterr().err, args
    s = ServerProcess(qwen3_dir, tmp_path, "--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", cert,
                      "--ssl-cert-reqs", "2", "--header-timeout", "1")
    try:
        assert s.url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=cert)
        ctx.load_cert_chain(cert, key)
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       verify=ctx, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.HTTPError):        # no client certificate
            httpx.get(s.url + "/health", verify=ssl.create_default_context(cafile=cert), timeout=10).raise_for_status()
        with pytest.raises(httpx.HTTPError):        # plain HTTP to the HTTPS port
            httpx.get(s.url.replace("https://", "http://") + "/health", timeout=10)
        host, port = s.url.removeprefix("https://").rsplit(":", 1)
        slow = ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10), server_hostname=host)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")     # headers never finished
        t0 = time.monotonic()
        slow.settimeout(5)
        assert slow.recv(4096) == b"" and time.monotonic() - t0 < 4
        slow.close()
    finally:
        assert s.stop() == 0, s.log_path.read_text()[-3000:]


def test_sampling_values_at_the_edges_of_float32_are_served(guarded):
    """A top_p below float32's smallest normal number rounded to 0 in the step's sampling record and
    killed the engine core (an index of -1 in the top-p cut-off), and every request after it got 503.
    Such values now keep their meaning in 32 bits: the top token for a vanishing top_p, uniform choice
    for a huge temperature (masked tokens stay out), a huge or tiny repetition penalty, top_k past int32."""
    def text(**params) -> str:
        r = _post(guarded, "/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 6,
                                                "ignore_eos": True, **params})
        assert r.status_code == 200, (params, r.text)
        return r.json()["choices"][0]["text"]
    greedy = text(temperature=0)
    assert text(temperature=1.0, top_p=1e-320, seed=3) == greedy
    assert text(temperature=1.0, top_p=5e-324, top_k=10**14, seed=4) == greedy
    json_text = text(temperature=1e308, response_format={"type": "json_object"}, max_tokens=40)
    assert json_text.lstrip().startswith("{")
    for rp in (1e308, 1e-308):
        text(temperature=1.0, repetition_penalty=rp, seed=5)
    assert text(temperature=0) == greedy


def test_chat_template_kwargs_cannot_reach_the_template_call(guarded):
    """chat_template_kwargs are the template's variables. Names of the template call's own parameters
    collided with the server's (add_generation_prompt, messages: a 500) or replaced its template with
    the client's (chat_template: any Jinja, whose loops run on the tokenizer thread all requests share)."""
    def chat(**kwargs):
        return _post(guarded, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "chat_template_kwargs": kwargs,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    for kwargs in ({"add_generation_prompt": "x"}, {"messages": 5}, {"tokenize": True}, {"tools": []},
                   {"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}):
        r = chat(**kwargs)
        assert r.status_code == 400, (kwargs, r.text)
        error = r.json()["error"]
        assert error["param"] == "chat_template_kwargs" and repr(next(iter(kwargs))) in error["message"]
    assert chat(enable_thinking=False, documents=[]).status_code == 200


def test_logprobs_in_flight_have_a_bound(tmp_path):
    """Each request may ask for up to 4,000,000 logprob entries (~2.7 GB of the API server's memory), and
    the queue holds --max-queue-len requests: in flight together they are bounded too, counted as each
    could come to. Past the bound a request gets 503 with Retry-After; as requests end, room returns."""
    from tokenmill.server.request_checks import MAX_LOGPROB_ENTRIES_IN_FLIGHT
    s = _slow_engine_server(os.path.join(TESTS, "..", "src", "tokenmill", "assets", "tiny"), tmp_path,
                            "--max-num-seqs", "128", "--max-queue-len", "16")
    big = {"model": "tiny", "prompt": "hi", "n": 126, "max_tokens": 1500, "logprobs": 20, "ignore_eos": True}
    each = 126 * 1500 * 21
    fit = MAX_LOGPROB_ENTRIES_IN_FLIGHT // each

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            held = [asyncio.create_task(c.post(s.url + "/v1/completions", json=big)) for _ in range(fit)]
            deadline = time.monotonic() + 30
            while True:             # until every held sequence has reached the engine: all are in flight
                m = s.metrics()
                if m["tokenmill:num_requests_running"] + m["tokenmill:num_requests_waiting"] == fit * 126:
                    break
                assert time.monotonic() < deadline and not any(t.done() for t in held), \
                    [t.result().text for t in held if t.done()]
                await asyncio.sleep(0.05)
            assert not any(t.done() for t in held)
            r = await c.post(s.url + "/v1/completions", json=big)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "logprobs_in_flight" and f"{fit * each:,}" in r.text
            for t in held:
                t.cancel()
            for _ in range(150):          # the server sees each disconnect and aborts its request
                await asyncio.sleep(0.2)
                r = await c.post(s.url + "/v1/completions", json={**big, "max_tokens": 3})
                if r.status_code == 200:
                    break
            assert r.status_code == 200, r.text
    try:
        asyncio.run(main())
    finally:
        s.stop(signal.SIGKILL)


def test_a_stream_whose_client_left_before_its_first_chunk_releases_its_requests():
    """The client is gone when the response starts: the body's generator is never started, so its
    `finally` (which closes the requests and counts them out of flight) never runs; the response does it."""
    from tokenmill.server.engine_streams import ClosingStream

    started, closed = [], []

    async def body():
        started.append(True)
        yield b"data: x\n\n"

    async def close():
        closed.append(True)

    async def gone(message):
        raise OSError("client disconnected")

    async def receive():
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):
        asyncio.run(ClosingStream(body(), close, media_type="text/event-stream")(scope, receive, gone))
    assert closed == [True] and started == []


def test_a_template_error_does_not_echo_the_rendered_prompt():
    """transformers appends the whole rendered chat to some template errors, an operator's system prompt
    included: the 400 carries the reason's first line."""
    from types import SimpleNamespace

    from tokenmill.server.errors import APIError
    from tokenmill.server.prompts import PromptTokenizer

    def fails(messages, add_generation_prompt, **kwargs):
        raise ValueError("continue_final_message is set but the final message changed\nRendered chat:\nSECRET")
    prompts = PromptTokenizer(SimpleNamespace(apply_chat_template=fails), 64)
    with pytest.raises(APIError) as e:
        prompts._render([{"role": "user", "content": "x"}], True, {})
    assert e.value.message == "Cannot apply the chat template: continue_final_message is set but the final " \
                              "message changed" and e.value.param == "messages"


def test_a_request_the_engine_had_taken_is_no_rejection():
    """request_rejected_total counts 503s before the engine; one whose engine died (or whose server stopped)
    while it ran finishes as an "error" in request_success_total instead."""
    from types import SimpleNamespace

    from tokenmill.engine.async_engine import EngineDeadError
    from tokenmill.server.errors import APIError, api_error_handler
    from tokenmill.server.engine_streams import as_api_error

    rejected = []
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(metrics=SimpleNamespace(reject=rejected.append))))
    asyncio.run(api_error_handler(request, as_api_error(EngineDeadError("gone"))))
    assert rejected == []
    asyncio.run(api_error_handler(request, APIError(503, "The engine is not running.", code="engine_dead")))
    assert rejected == ["engine_dead"]


def test_a_closing_connection_whose_client_reads_nothing_is_dropped():
    """Flow control pauses a response only past the transport's high-water mark: a connection closed with
    less than that unsent, to a client that reads nothing, waited to flush for good (its slot and file
    descriptor held, every SIGTERM waiting uvicorn's 30 s). The watchdog drops it once its unsent bytes
    have not moved for send_timeout; while draining, also a connection whose request body still arrives."""
    from tokenmill.server.connections import protocol_with_limits

    class Transport:
        def __init__(self, unsent, closing=True):
            self.unsent, self.closing, self.aborted = unsent, closing, False

        def is_closing(self):
            return self.closing

        def get_write_buffer_size(self):
            return self.unsent

        def abort(self):
            self.aborted = True

    def connection(transport, body_arriving=False):
        protocol = protocol_with_limits(10.0, 60.0, 3.0, 65536, reject=print)
        conn = protocol.__new__(protocol)
        conn.transport, conn.cycle = transport, None
        conn._body_timer = object() if body_arriving else None
        return conn
    stuck, moving, open_ = Transport(40_000), Transport(40_000), Transport(0, closing=False)
    conns = [connection(stuck), connection(moving), connection(open_)]
    for t in (0.0, 1.0, 2.0, 3.5):
        moving.unsent -= 1000                  # its client reads: never dropped
        for conn in conns:
            conn.reap_if_stuck(t)
    assert (stuck.aborted, moving.aborted, open_.aborted) == (True, False, False)
    uploading = Transport(0, closing=False)
    connection(uploading, body_arriving=True).reap_if_stuck(0.0, patience=5.0, draining=True)
    assert uploading.aborted


def test_probes_answer_head_and_the_open_files_limit_is_raised(guarded, monkeypatch, caplog):
    """Health checkers that probe with HEAD marked the server down (405 on every GET route). And the soft
    limit on open files rises to the hard one at start, with a warning where it is under the connections
    --limit-concurrency allows (past it, connections were dropped without an answer or a log line)."""
    import resource

    from tokenmill.server.launch import raise_open_files_limit
    for path in ("/health", "/ping", "/metrics", "/version", "/v1/models"):
        r = httpx.head(guarded.url + path, timeout=30, headers=guarded.headers)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 2048))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    with caplog.at_level("WARNING", logger="tokenmill.server"):
        raise_open_files_limit(4096)
    assert calls == [(2048, 2048)]
    assert "open files are limited to 2048" in caplog.text


def test_every_refusal_of_a_batch_is_retrieved():
    """A batch whose prompts the engine all refused (a completions list with a parameter it refuses) re-raised
    the first refusal and left the others unretrieved: asyncio logged 'Task exception was never retrieved'
    with a traceback for each, on every such request; so did a refusal landing in the tick of a disconnect."""
    import gc

    from tokenmill.server.engine_streams import _gather, _with_disconnect

    async def refused(msg, delay=0.0):
        await asyncio.sleep(delay)
        raise ValueError(msg)
        yield

    class Gone:
        async def receive(self):
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        with pytest.raises(ValueError, match="refused 0"):
            await _gather(g.__anext__() for g in [refused("refused 0"), refused("refused 1")])
        with pytest.raises(BaseException):
            await _with_disconnect(Gone(), _gather(g.__anext__() for g in [refused("alone", 0.01)]))
        await asyncio.sleep(0.05)
        gc.collect()
    asyncio.run(main())
    gc.collect()
    assert unretrieved == []


def test_a_chat_takes_the_tokenizers_special_tokens_only_when_asked():
    """vLLM's chat `add_special_tokens`: the rendered prompt encoded with the tokenizer's own special tokens
    (a BOS) only when the request asks, on the batched and on the long texts' path; with `fits` off
    (truncate_prompt_tokens) a rendered prompt longer than the context is encoded, not refused."""
    import asyncio

    from tokenmill.server.errors import APIError
    from tokenmill.server.prompts import LONG_TEXT_CHARS, PromptTokenizer

    class BosTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            return messages[0]["content"]

        def encode_batch(self, texts, add_special_tokens=True):
            return [[1] * add_special_tokens + [7] * min(len(t), 3) for t in texts]

    prompts = PromptTokenizer(BosTokenizer(), 100)
    prompts._max_token_chars = 4

    async def main():
        chat = [{"role": "user", "content": "abcd"}]
        long = [{"role": "user", "content": "x" * (LONG_TEXT_CHARS + 1)}]
        got = [(await prompts.render_chat(chat, True, special))[1] for special in (False, True)]
        got.append((await prompts.render_chat(long, True, True, fits=False))[1])
        with pytest.raises(APIError, match="maximum context length"):
            await prompts.render_chat(long, True)
        return got
    assert asyncio.run(main()) == [[7, 7, 7], [1, 7, 7, 7], [1, 7, 7, 7]]


def test_a_tokenizer_the_api_server_cannot_load_ends_the_start(qwen3_dir, tmp_path):
    """The core started (it reads only the tokenizer's end-of-sequence ids), then the API server's tokenizer
    failed to load (transformers refuses a padding side of "middle"): a traceback, and the process never
    exited, held at its exit by the core it had started. Now one line naming the tokenizer, and status 1."""
    import sys
    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "middle"}))
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(TESTS), "src"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--device", "cpu", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    assert re.search(r"^tokenmill: cannot load the tokenizer in .*Padding side", p.stderr, re.M), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
