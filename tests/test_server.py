"""The real `tokenmill serve` process on loopback with a tiny random model, driven by the `openai` client."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "sk-tokenmill-test"
MAX_MODEL_LEN = 96


def parse_metrics(text: str) -> dict[str, float]:
    """Each tokenmill metric (histogram buckets left out) summed over its label values: a counter's total
    over its finish reasons, say."""
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:") and "{" in line:
            name = line.split("{", 1)[0]
            if "bucket" not in name:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def completion_text(c, body: dict, stream: bool) -> str:
    """The text of one /v1/completions request with `body`, read whole or from its stream (an
    httpx.AsyncClient with the server's base URL)."""
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def alive(pid: int) -> bool:
    """Whether process `pid` still runs: False once it has exited, reaped or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> bytes:
    """Process `pid`'s command line (its arguments NUL-separated); empty once it has exited."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class ServerProcess:
    def __init__(self, model_dir: str, tmp_path, *args: str):
        self.log_path = tmp_path / f"server-{os.getpid()}-{time.monotonic_ns()}.log"
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", model_dir, "--port", "0", "--device", "cpu",
             "--served-model-name", "tiny", "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            m = re.search(r"on (https?://[\d.]+:\d+) \(engine pid (\d+)\)", self.log_path.read_text())
            if m:
                self.url, self.engine_pid = m.group(1), int(m.group(2))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()}")
            time.sleep(0.02)        # the suite starts some 30 servers: each waits half a poll on average
        else:
            self.proc.kill()
            raise RuntimeError(f"server did not start:\n{self.log_path.read_text()}")
        self.headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY in args else {}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_engine_idle(self, timeout: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["tokenmill:kv_cache_usage_perc"] == 0 and m["tokenmill:num_requests_running"] == 0
                    and m["tokenmill:num_requests_waiting"] == 0
                    and m["tokenmill:num_free_blocks"] == m["tokenmill:num_total_blocks"]):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine did not return to idle: {m}")
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    s = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("srv"), "--api-key", API_KEY,
                      "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--block-size", "4",
                      "--max-num-seqs", "64")
    yield s
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def offline(qwen3_dir):
    from tokenmill import LLM
    return LLM(qwen3_dir, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, block_size=4)


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_health_and_auth(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_completion_greedy_equals_offline(server, offline):
    from tokenmill import SamplingParams
    prompt = "The quick brown fox"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    client = server.client()
    got = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(offline.engine.tokenizer.encode(prompt))
    assert got.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # token-id prompts and prompt batches
    ids = offline.engine.tokenizer.encode(prompt)
    batch = client.completions.create(model="tiny", prompt=[ids, ids], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert all(c.text == want.text for c in batch.choices)


def test_chat_greedy_equals_offline(server, offline):
    from tokenmill import SamplingParams
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    client = server.client()
    got = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_n_seed_and_max_completion_tokens(server):
    client = server.client()
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                       temperature=1.0, seed=7, max_completion_tokens=6,
                                       extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01,
                                                   "repetition_penalty": 1.1, "priority": 0})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                           temperature=1.0, seed=7, max_completion_tokens=6,
                                           extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01,
                                                       "repetition_penalty": 1.1})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    stream = client.completions.create(model="tiny", prompt="abc", n=2, max_tokens=5, stream=True,
                                       presence_penalty=0.5, frequency_penalty=0.5, user="u1",
                                       extra_body={"ignore_eos": True})
    texts, reasons = {0: "", 1: ""}, {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "length", 1: "length"}


def test_stop_strings(server):
    """A stop string ends the text before it, streamed or not; generation_tokens_total counts the tokens the
    clients received (their usage), as vLLM's: it was the engine core's count, which took in the token or
    two the core samples for a sequence after the frontend has found its stop string."""
    client = server.client()
    full = client.completions.create(model="tiny", prompt="Continuous batching", **GREEDY).choices[0].text
    visible = full.replace("\ufffd", "")
    assert len(visible) >= 4, full
    stop = visible[2:4]
    before = server.metrics()
    r = client.completions.create(model="tiny", prompt="Continuous batching", stop=[stop], **GREEDY)
    c = r.choices[0]
    assert c.finish_reason == "stop" and stop not in c.text and full.startswith(c.text)
    streamed = list(client.completions.create(model="tiny", prompt="Continuous batching", stop=stop, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert "".join(x.choices[0].text for x in streamed[:-1]) == c.text
    assert streamed[-2].choices[0].finish_reason == "stop"
    after = server.metrics()
    assert r.usage.completion_tokens < GREEDY["max_tokens"]
    assert streamed[-1].usage.completion_tokens == r.usage.completion_tokens
    assert {k: after[k] - before[k] for k in ("tokenmill:generation_tokens_total", "tokenmill:prompt_tokens_total")} \
        == {"tokenmill:generation_tokens_total": 2 * r.usage.completion_tokens,
            "tokenmill:prompt_tokens_total": 2 * r.usage.prompt_tokens}


def test_logprobs(server):
    client = server.client()
    r = client.completions.create(model="tiny", prompt="hello", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert all(len(t) <= 3 and x <= 0 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    # greedy: the chosen token is the most likely one
    assert all(x >= max(t.values()) - 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and isinstance(t.bytes, list) for t in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 logprobs=True, stream=True, **GREEDY))
    streamed = [t for ch in chunks for choice in ch.choices if choice.logprobs for t in choice.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=30, **kw)


def test_errors_are_openai_shaped(server):
    long_prompt = list(range(1, MAX_MODEL_LEN + 5))
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 2})
    assert r.status_code == 400 and str(MAX_MODEL_LEN) in r.json()["error"]["message"]
    assert str(len(long_prompt)) in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 2})
    assert r.status_code == 400, r.text                     # 3 + (MAX_MODEL_LEN - 2) tokens do not fit
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert f"{MAX_MODEL_LEN + 1} tokens (3 in the prompt, {MAX_MODEL_LEN - 2} in the completion)" in err["message"]
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 3})
    assert r.status_code == 200, r.text                     # exactly fills the context
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "frobnicate"
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                               "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "top_p"
    r = _post(server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": [10 ** 9]})
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=server.headers)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny", prompt="x", suffix="y")
    # defaults that change nothing are accepted
    ok = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 1, "tools": [], "logit_bias": {}, "n": 1})
    assert ok.status_code == 200
    # temperature=0 is greedy, never refused
    assert _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                              "temperature": 0}).status_code == 200


def test_tokenize_detokenize(server, offline):
    r = _post(server, "/tokenize", {"prompt": "hello world"})
    assert r.json()["tokens"] == offline.engine.tokenizer.encode("hello world")
    assert _post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"] == "hello world"
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert _post(server, "/detokenize", {"tokens": [10 ** 9]}).status_code == 400
    # vLLM's fields: each token's vocabulary string, an assistant turn continued, template kwargs
    strs = _post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == offline.engine.tokenizer.convert_ids_to_tokens(strs["tokens"])
    assert r.json()["token_strs"] is None
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    cont = _post(server, "/tokenize", {"messages": turn, "continue_final_message": True,
                                       "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}).json()
    assert cont["tokens"] == offline.engine.tokenizer.encode_chat(turn, add_generation_prompt=False,
                                                                  continue_final_message=True)
    bad = _post(server, "/tokenize", {"messages": turn, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_load_with_random_cancellations(server):
    """A few hundred concurrent requests, a third cancelled at random: every one ends, no block leaks, and
    generation_tokens_total counts what the requests received, as request_generation_tokens does (vLLM's
    frontend counts both): the core's count took in the tokens it sampled before a cancel reached it."""
    before = server.metrics()
    rng = random.Random(0)
    outcomes: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, i: int):
        stream = rng.random() < 0.5
        body = {"model": "tiny", "max_tokens": rng.randint(1, 6), "ignore_eos": True, "stream": stream,
                "temperature": rng.choice([0, 0.7, 1.0])}
        if rng.random() < 0.5:
            body["prompt"] = "load test %d " % i * rng.randint(1, 4)
            path = "/v1/completions"
        else:
            body["messages"] = [{"role": "user", "content": "load %d" % i}]
            path = "/v1/chat/completions"
        if rng.random() < 0.05:
            body["temperature"] = -1                            # a bad request among good ones
        cancel_after = rng.uniform(0.0, 3.0) if rng.random() < 0.35 else None

        async def call():
            if stream:
                async with client.stream("POST", path, json=body) as r:
                    text = ""
                    async for line in r.aiter_lines():
                        text += line
                    if r.status_code == 200:
                        assert text.endswith("data: [DONE]"), text[-200:]
                    return r.status_code
            r = await client.post(path, json=body)
            if r.status_code == 200:
                assert r.json()["choices"]
            else:
                assert "error" in r.json()
            return r.status_code

        task = asyncio.ensure_future(call())
        if cancel_after is not None:
            done, _ = await asyncio.wait({task}, timeout=cancel_after)
            if not done:
                task.cancel()
                outcomes[i] = -1
                return
        status = await task
        outcomes[i] = status

    async def main():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120,
                                     limits=limits) as client:
            await asyncio.gather(*(one(client, i) for i in range(300)))

    asyncio.run(main())
    assert len(outcomes) == 300
    assert set(outcomes.values()) <= {-1, 200, 400}, outcomes
    assert list(outcomes.values()).count(200) > 120
    after = server.wait_engine_idle(timeout=30)
    generated = [after[k] - before[k] for k in ("tokenmill:generation_tokens_total",
                                                "tokenmill:request_generation_tokens_sum")]
    assert generated[0] == generated[1] > 0, generated


def test_sigterm_drains_then_exits_zero(server):
    """Runs last on `server`: the in-flight stream completes, a new request gets 503, exit status 0."""
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60, headers=server.headers) as c:
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 80, "n": 16, "ignore_eos": True,
                "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            late = httpx.post(server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 1},
                              headers=server.headers, timeout=10)
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            rest = "\n".join(lines)
        assert rest.rstrip().endswith("data: [DONE]")
        chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        reasons = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
        assert reasons == {i: "length" for i in range(16)}
    assert server.proc.wait(30) == 0, time.monotonic() - t0


@pytest.fixture(scope="module")
def small_server(qwen3_dir, tmp_path_factory):
    """Short context, one sequence at a time and a queue of 2: backpressure and fuzzing."""
    s = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("small"), "--max-model-len", "24",
                      "--max-num-seqs", "1", "--max-queue-len", "2", "--num-kv-blocks", "32", "--block-size", "4")
    yield s
    s.stop(signal.SIGKILL)


def labelled(text: str, name: str, **labels) -> float | None:
    """The value of one labelled series in a Prometheus text page (None when it is absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line.split("}")[0] for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_backpressure_503_with_retry_after(small_server):
    """Beyond --max-queue-len a request gets 503 queue_full with Retry-After, and each one counts in
    request_rejected_total{reason="queue_full"}, a series there at 0 from the start (as vLLM's counters)."""
    page = httpx.get(small_server.url + "/metrics").text
    before = labelled(page, "tokenmill:request_rejected_total", reason="queue_full")
    assert before is not None and labelled(page, "tokenmill:request_success_total", finished_reason="abort") is not None

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as client:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 20, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))
    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert codes.count(503) >= 1 and codes.count(200) >= 2, codes
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.headers["retry-after"] and busy.json()["error"]["code"] == "queue_full"
    after = labelled(httpx.get(small_server.url + "/metrics").text, "tokenmill:request_rejected_total",
                     reason="queue_full")
    assert after - before == codes.count(503)
    small_server.wait_engine_idle()


def test_each_choice_counts_once_in_every_request_metric(small_server):
    """n=2: two sequences, as vLLM counts the n children of one request: two times to first token, two
    latencies, two finishes, a gap between tokens for every token after each one's first, and the prompt
    twice in prompt_tokens_total as in the request_prompt_tokens histogram."""
    def counts():
        page = httpx.get(small_server.url + "/metrics").text
        return [labelled(page, f"tokenmill:{name}") for name in (
            "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
            "inter_token_latency_seconds_count")] + [
            labelled(page, "tokenmill:request_success_total", finished_reason="length")] + [
            labelled(page, f"tokenmill:{name}") for name in ("prompt_tokens_total", "request_prompt_tokens_sum")]
    small_server.wait_engine_idle()
    before = counts()
    r = httpx.post(small_server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 5, "n": 2, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    prompt = r.json()["usage"]["prompt_tokens"]
    assert [a - b for a, b in zip(counts(), before)] == [2, 2, 8, 2, 2 * prompt, 2 * prompt]
    small_server.wait_engine_idle()


def test_iteration_tokens_counts_each_step_by_its_tokens(small_server):
    """iteration_tokens_total, vLLM's histogram of tokens per engine step: one request alone (max_num_seqs
    1) of 5 tokens is 5 steps, the first with its prompt and first token, then one token each."""
    def histogram():
        page = httpx.get(small_server.url + "/metrics").text
        return [labelled(page, "tokenmill:iteration_tokens_total_" + part, **labels) for part, labels in (
            ("count", {}), ("sum", {}), ("bucket", {"le": "1.0"}), ("bucket", {"le": "+Inf"}))]
    small_server.wait_engine_idle()
    before = [v or 0.0 for v in histogram()]
    r = httpx.post(small_server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    prompt = r.json()["usage"]["prompt_tokens"]
    assert [a - b for a, b in zip(histogram(), before)] == [5, prompt + 5, 4, 5]


def test_fuzz_openapi_schema_no_5xx(small_server, tmp_path):
    """schemathesis against the live OpenAPI schema, bounded in time: no 5xx, and every answer as the
    schema documents it (its status code, content type and headers), schema-violating bodies refused.
    Not checked: that every schema-valid body is accepted, since some rules are not in the schema (a
    'tool' message needs its tool_call_id, an empty prompt has no token to continue from)."""
    pytest.importorskip("schemathesis")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", small_server.url + "/openapi.json",
           "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-time", "6",
           "--max-examples", "60", "--seed", "1", "--workers", "1", "--request-timeout", "20",
           "--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all"]
    env = dict(os.environ, SCHEMATHESIS_HOOKS="")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated and int(generated.group(1)) >= 30, out[-3000:]
    assert httpx.get(small_server.url + "/health").status_code == 200
    small_server.wait_engine_idle()


def test_openapi_documents_the_errors_the_server_answers(small_server):
    """Errors are 400s in OpenAI's shape, never FastAPI's 422 validation body, and the schema says so;
    health answers without a body, metrics as text; a 405 names every method of its path."""
    schema = httpx.get(small_server.url + "/openapi.json").json()
    ops = {(m.upper(), p): o["responses"] for p, methods in schema["paths"].items() for m, o in methods.items()}
    assert not any("422" in r for r in ops.values())
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for key in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")]:
        assert ops[key]["400"]["content"]["application/json"]["schema"] == error, key
        assert ops[key]["404"]["content"]["application/json"]["schema"] == error, key
    assert set(ops[("POST", "/v1/chat/completions")]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "content" not in ops[("GET", "/health")]["200"] and "503" in ops[("GET", "/health")]
    assert set(ops[("GET", "/metrics")]["200"]["content"]) == {"text/plain"}
    r = httpx.post(small_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": "1"})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "max_tokens"
    r = httpx.request("PUT", small_server.url + "/v1/responses/resp_1")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"


def test_engine_death_gives_503_and_nonzero_exit(small_server):
    """On the module's small server (a launch of its own took ~7 s of the suite): the last test to use it,
    since it ends that server, as test_sigterm_drains_then_exits_zero ends `server`."""
    s = small_server
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        os.kill(s.engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            try:
                status = httpx.get(s.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                break
            if status == 503:
                break
            time.sleep(0.05)
        assert status == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        # past the 2 s of 503s the server is exiting: a SIGTERM then must not turn status 1 into 143
        time.sleep(max(0.0, 2.5 - (time.monotonic() - killed)))
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 1
    finally:
        s.stop(signal.SIGKILL)
