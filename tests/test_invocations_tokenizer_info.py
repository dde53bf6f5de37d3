"""Two routes vLLM deployments use, on the API in process (`_in_process_api`: the test tokenizer and a
stand-in engine): SageMaker's `POST /invocations`, answered as the endpoint its body's fields pick, and
`GET /tokenizer_info` (`--enable-tokenizer-info-endpoint`)."""
from __future__ import annotations

import json

import pytest

from test_openai_api import _in_process_api

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hello world", "max_tokens": 1}


@pytest.fixture(scope="module")
def api(tokenizer_dir):
    """A key, a 4 KiB body limit and /tokenizer_info on."""
    post = _in_process_api(tokenizer_dir, api_key="k", max_request_body_bytes=4096,
                           enable_tokenizer_info_endpoint=True)
    return lambda path, body=None, method="POST", **kw: post(
        path, body, method, **{"headers": {"Authorization": "Bearer k"}, **kw})


def _answer(r) -> tuple:
    """A response without what differs between two answers to one body (ids, times)."""
    def strip(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("id", "created")}
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        body = [e if e == "[DONE]" else strip(json.loads(e)) for e in events]
    else:
        body = strip(r.json())
    return r.status_code, r.headers["content-type"], body


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", COMPLETION), ("/v1/completions", {**COMPLETION, "stream": True, "logprobs": 1}),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}),          # the chat endpoint's validation
    ("/v1/chat/completions", {**CHAT, "prompt": "x"}),                 # messages pick chat: prompt is unknown
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}),              # 404 model_not_found
    ("/v1/completions", {**COMPLETION, "max_tokens": 1.5}),
    ("/v1/completions", {**COMPLETION, "n": 0}),
    ("/v1/completions", {"prompt": list(range(64))}),                  # the context: refused before validation
], ids=["chat", "chat-stream", "completion", "completion-stream", "chat-bad-type", "chat-unknown-field",
        "unknown-model", "completion-bad-type", "completion-bad-value", "context"])
def test_invocations_answers_as_the_endpoint_its_body_picks(api, endpoint, body):
    direct, invoked = api(endpoint, body), api("/invocations", body)
    assert _answer(invoked) == _answer(direct), (invoked.text, direct.text)


@pytest.mark.parametrize("content", [b'{"prompt": "x",', b'{"prompt": "\\udfff"}',
                                     b'{"prompt": %s}' % (b"[" * 70 + b"]" * 70)],
                         ids=["malformed", "surrogate", "too-deep"])
def test_invocations_parses_the_body_as_the_endpoints_do(api, content):
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    invoked = api("/invocations", content=content, headers=headers)
    assert invoked.status_code == 400 and invoked.json() == api("/v1/completions", content=content,
                                                                  headers=headers).json()
    form = api("/invocations", content=b'{"prompt": "x"}', headers={**headers, "Content-Type": "text/plain"})
    assert form.status_code == 400 and "Content-Type: application/json" in form.json()["error"]["message"]


@pytest.mark.parametrize("body,says", [({"input": "x"}, "its fields are 'input'). A Responses body"),
                                       ({}, "it has no fields"), ([CHAT], "(got array)")])
def test_invocations_names_the_fields_it_looked_for(api, body, says):
    r = api("/invocations", body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
    assert "'messages'" in error["message"] and "'prompt'" in error["message"] and says in error["message"], error


def test_invocations_needs_the_key_and_keeps_the_body_limit(api):
    no_key = api("/invocations", CHAT, headers={})
    assert no_key.status_code == 401 and no_key.json() == api("/v1/chat/completions", CHAT, headers={}).json()
    big = {**COMPLETION, "prompt": "x" * 5000}
    r = api("/invocations", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_tokenizer_info_is_the_tokenizer_config_as_loaded(api, tokenizer_dir):
    from transformers import AutoTokenizer

    r = api("/tokenizer_info", method="GET")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    info = r.json()
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert info["tokenizer_class"] == type(hf).__name__
    assert (info["eos_token"], info["pad_token"], info["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    # transformers' "no limit", past orjson's 64-bit integers, as the config file writes it
    assert info["model_max_length"] == 1000000000000000019884624838656 == hf.init_kwargs["model_max_length"]
    assert info["added_tokens_decoder"] == {"0": "<|endoftext|>", "1": "<|im_start|>", "2": "<|im_end|>",
                                            "400": "<think>", "401": "</think>"}
    assert info["chat_template"] == hf.chat_template
    assert not {"name_or_path", "vocab_file", "is_local", "local_files_only"} & set(info), info
    assert api("/tokenizer_info", method="GET", headers={}).status_code == 401
    # HEAD, as /v1/models answers it (it was a 405)
    head = api("/tokenizer_info", method="HEAD")
    assert head.status_code == 200 and head.headers["content-length"] == str(len(r.content)), head.headers
    assert api("/tokenizer_info", method="HEAD", headers={}).status_code == 401


def test_tokenizer_info_is_off_unless_asked_and_says_why_it_cannot_answer(tokenizer_dir):
    off = _in_process_api(tokenizer_dir)("/tokenizer_info", method="GET")
    assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]
    assert _in_process_api(tokenizer_dir)("/tokenizer_info", method="HEAD").status_code == 404
    template = "{{ messages[0]['content'] }}"
    own = _in_process_api(tokenizer_dir, template, enable_tokenizer_info_endpoint=True)("/tokenizer_info",
                                                                                        method="GET")
    assert own.json()["chat_template"] == template          # the one chat requests are rendered with
    none = _in_process_api(None, enable_tokenizer_info_endpoint=True)("/tokenizer_info", method="GET")
    assert none.status_code == 404 and "without a tokenizer" in none.json()["error"]["message"], none.text
