"""The OpenAI API surface that agents and evaluation harnesses send, against a real `tokenmill serve`
on loopback, driven by the official `openai` client: echo and prompt logprobs, scoring, defaults,
fields clients send back, model retrieval."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from test_server import ServerProcess

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def api_server(qwen3_dir, tmp_path_factory):
    s = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("api"), "--max-model-len", str(MAX_MODEL_LEN),
                      "--num-kv-blocks", "256", "--block-size", "4", "--max-num-batched-tokens", "16")
    yield s
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    from tokenmill.engine.tokenizer import Tokenizer
    return Tokenizer(qwen3_dir)


def _hf_prompt_logprobs(hf_model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(api_server, hf_model, tokenizer):
    client = api_server.client()
    prompt = "The quick brown fox jumps over the lazy dog. 你好，世界！"    # longer than one prefill chunk
    ids = tokenizer.encode(prompt)
    ref = _hf_prompt_logprobs(hf_model, ids)
    for max_tokens in (1, 0):
        r = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0)
        c = r.choices[0]
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1:len(ids)]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3, (got, ref)
        assert "".join(lp.tokens[:len(ids)]).startswith("The quick brown fox")   # split CJK bytes are U+FFFD
        assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        if max_tokens == 0:
            assert c.text == prompt and len(lp.tokens) == len(ids) and r.usage.completion_tokens == 0
        else:
            assert len(lp.tokens) == len(ids) + 1 and r.usage.completion_tokens == 1
    # the second time the prompt's blocks are cached, and the scores are still all there
    again = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(ref, abs=1e-3)


def test_prompt_logprobs_field_and_streamed_echo(api_server, hf_model, tokenizer):
    ids = tokenizer.encode("hello world, hello tokenmill")
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3, "temperature": 0})
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    ref = _hf_prompt_logprobs(hf_model, ids)
    assert [pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))] == pytest.approx(ref, abs=1e-3)
    assert all(len(entry) >= 3 for entry in pl[1:])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    chunks = list(api_server.client().completions.create(model="tiny", prompt=ids, echo=True, max_tokens=3,
                                                         temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices).startswith(text)
    chunks = list(api_server.client().completions.create(model="tiny", prompt=ids, echo=True, max_tokens=0,
                                                         stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_a_streamed_echo_of_several_choices_with_no_tokens_ends(api_server):
    """`max_tokens: 0`, echo, n = 2 and logprobs, streamed: the stream emptied the engine's own output of
    its one computed token while the second choice, which waits for the first to compute the shared
    prompt, still ran; its next token then failed in the output processor and the stream never ended."""
    for attempt in range(3):
        prompt = f"{attempt} the quick brown fox jumps over the lazy dog, again and again"
        body = {"prompt": prompt, "echo": True, "max_tokens": 0, "n": 2, "logprobs": 1, "stream": True}
        with httpx.stream("POST", api_server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        texts, reasons = {}, {}
        for ch in chunks:
            for c in ch["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
        assert texts == {0: prompt, 1: prompt} and reasons == {0: "length", 1: "length"}


def test_chat_prompt_logprobs_are_the_rendered_prompts(api_server, tokenizer):
    """vLLM's prompt_logprobs on chat: the rendered prompt's tokens, in the response beside the choices,
    each entry as completions gives it for the same ids; with stream, a 400 naming it on both endpoints."""
    messages = [{"role": "user", "content": "hello world"}]
    r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode_chat(messages)
    pl = body["prompt_logprobs"]
    assert len(pl) == len(ids) == body["usage"]["prompt_tokens"] and pl[0] is None
    want = httpx.post(api_server.url + "/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}).json()["choices"][0]["prompt_logprobs"]
    for got, ref, token in zip(pl[1:], want[1:], ids[1:]):
        assert str(token) in got and got.keys() == ref.keys() and len(got) >= 2
        for t in got:
            assert got[t]["logprob"] == pytest.approx(ref[t]["logprob"], abs=1e-5)
            assert (got[t]["rank"], got[t]["decoded_token"]) == (ref[t]["rank"], ref[t]["decoded_token"])
    assert "prompt_logprobs" not in httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 1}).json()
    for path, extra in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": "x"})):
        e = httpx.post(api_server.url + path, timeout=60, json={**extra, "stream": True, "prompt_logprobs": 1})
        assert e.status_code == 400 and e.json()["error"]["param"] == "prompt_logprobs", e.text


def test_lm_eval_style_loglikelihood_requests(api_server, hf_model, tokenizer):
    """What lm-eval's local-completions sends to score a continuation: echo, logprobs 1, max_tokens 0
    (or 1), token-id or text prompts in a batch."""
    context, continuation = "def main():\n    return", " 42"
    ids = tokenizer.encode(context + continuation)
    n_ctx = len(tokenizer.encode(context))
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, json={
        "prompt": [ids, ids[:n_ctx]], "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0, "seed": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    lp = choices[0]["logprobs"]
    ref = _hf_prompt_logprobs(hf_model, ids)
    assert sum(lp["token_logprobs"][n_ctx:]) == pytest.approx(sum(ref[n_ctx - 1:]), abs=1e-3)
    for token_text, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
        assert len(top) >= 1


def test_completions_default_to_16_tokens(api_server):
    r = httpx.post(api_server.url + "/v1/completions", timeout=60,
                   json={"prompt": "x", "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 16
    err = httpx.post(api_server.url + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 0}).json()
    assert err["error"]["param"] == "max_tokens"
    # an explicit null too, as vLLM reads it (it ran to the end of the context): 16 tokens leave no room here
    err = httpx.post(api_server.url + "/v1/completions", timeout=60,
                     json={"prompt": [5] * (MAX_MODEL_LEN - 8), "max_tokens": None}).json()["error"]
    assert err["code"] == "context_length_exceeded" and "16 in the completion" in err["message"], err


def test_usage_details_fingerprint_and_stream_options(api_server):
    client = api_server.client()
    prompt = "Continuous batching lets requests join and leave the batch at every step. " * 2
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 4          # whole blocks of the prefix
    assert first.system_fingerprint
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.system_fingerprint and chat.usage.prompt_tokens_details is not None
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 1, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_a_reply_without_calls_carries_no_tool_calls(api_server):
    """As OpenAI's (and vLLM's since it dropped `[]`): agent loops run `while message.tool_calls is not None`."""
    r = api_server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1)
    assert r.choices[0].message.tool_calls is None and "tool_calls" not in r.choices[0].message.model_fields_set


def test_models_retrieve(api_server):
    client = api_server.client()
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_messages_clients_send_back(api_server):
    client = api_server.client()
    first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
    returned = first.choices[0].message.model_dump()        # refusal, annotations, audio, ... as null
    history = [{"role": "user", "content": "hi"}, returned,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "42"},
               {"role": "user", "content": "and then?"}]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=2, prompt_cache_key="k",
                                       safety_identifier="u1", metadata={"a": "b"}, store=False,
                                       service_tier="auto", verbosity="medium", prompt_cache_retention="in_memory",
                                       prompt_cache_options={"mode": "implicit", "ttl": "30m"},
                                       prediction={"type": "content", "content": "Hello"})
    assert r.choices[0].message.role == "assistant"
    bad = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "prediction": {"type": "content", "content": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction", bad.text
    bad = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x", "audio": {"id": "a1"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.audio"
    bad = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "tool", "content": "x"}]})
    assert bad.status_code == 400 and "tool_call_id" in bad.json()["error"]["message"]


def test_messages_the_openai_clients_helpers_return_are_taken_back():
    """`client.chat.completions.parse()` keeps what it parsed beside the text (the message's `parsed`, each
    call's `function.parsed_arguments`) and the `stream()` helper each call's `index`: a message appended to
    the history as returned is accepted, and the template sees the text alone."""
    from openai.types.chat import ParsedChatCompletionMessage

    from tokenmill.server.protocol import ChatCompletionRequest
    call = {"id": "call_1", "type": "function", "index": 0,
            "function": {"name": "f", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}}}
    returned = ParsedChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "parsed": None, "tool_calls": [call]}).model_dump(mode="json")
    assert {"parsed", "tool_calls"} <= set(returned) and {"index", "function"} <= set(returned["tool_calls"][0])
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"}, returned, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]})
    assert req.chat_messages()[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}


def test_a_refusal_part_sent_back_reaches_the_template_as_text():
    """OpenAI's assistant content may be a list of text and refusal parts (the openai client's
    ChatCompletionContentPartRefusalParam): a refusal part is text to the template, as vLLM reads it, and a
    part of another type is refused by its type."""
    from tokenmill.server.protocol import ChatCompletionRequest
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}, {"type": "text", "text": "x"}]},
        {"role": "user", "content": "ok"}]})
    assert req.chat_messages()[1] == {"role": "assistant", "content": "I can't\nx"}
    with pytest.raises(ValueError, match="a content part's type is 'text' or 'refusal'"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "video"}]}]})


def test_a_call_without_arguments_reaches_the_template_as_an_empty_object():
    """A call sent back with empty `arguments` (a function without parameters, as some clients and servers
    write it) is a call with no arguments: the template gets {} (as vLLM gives it), not "", which a template
    that writes string arguments as they stand (Qwen3's) wrote as `"arguments": }`."""
    from tokenmill.server.protocol import ChatCompletionRequest
    for arguments, seen in (("", {}), (" \n", {}), ('{"a": 1}', {"a": 1}), ('{"a": 1', '{"a": 1')):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]})
        assert req.chat_messages()[0]["tool_calls"][0]["function"]["arguments"] == seen, arguments


def test_reasoning_sent_back_under_vllms_name_reaches_the_template():
    """vLLM names an answer's thinking `reasoning` (it was `reasoning_content`; this server writes both), and
    clients send it back with the history under either name: both are taken, and the template reads the
    text under both names, as vLLM hands it over."""
    from tokenmill.server.protocol import ChatCompletionRequest
    for field in ("reasoning", "reasoning_content"):
        req = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello", field: "think"},
            {"role": "user", "content": "and?"}]})
        assert req.chat_messages()[1] == {"role": "assistant", "content": "Hello", "reasoning_content": "think",
                                          "reasoning": "think"}, field
    with pytest.raises(ValueError, match="name one text"):
        ChatCompletionRequest.model_validate({"messages": [
            {"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}]})


def test_continue_final_message_and_template_kwargs(api_server, tokenizer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]
    r = httpx.post(api_server.url + "/tokenize", timeout=60, json={"messages": msgs, "add_generation_prompt": False})
    assert r.status_code == 200
    r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": msgs, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    bad = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": msgs, "continue_final_message": True, "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_template_kwargs_named_as_the_renderers_parameters(api_server):
    """chat_template_kwargs reached the renderer as its keyword arguments: a key named as one of its own
    parameters ('add_special_tokens', 'fits', 'self') collided there, a 500. The two that are no template
    variable are refused by name; any other reaches the template."""
    msgs = [{"role": "user", "content": "hi"}]
    for path, fields in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        for key in ("add_special_tokens", "self"):
            r = httpx.post(api_server.url + path, timeout=60, json={
                "messages": msgs, **fields, "chat_template_kwargs": {key: True}})
            assert r.status_code == 400, (path, key, r.text)
            err = r.json()["error"]
            assert err["param"] == "chat_template_kwargs" and repr(key) in err["message"]
        r = httpx.post(api_server.url + path, timeout=60, json={
            "messages": msgs, **fields, "chat_template_kwargs": {"fits": False}})
        assert r.status_code == 200, (path, r.text)


def test_tokenize_counts_a_conversation_past_the_context(api_server, tokenizer):
    """/tokenize counts any text, as a prompt: a conversation longer than the context was refused
    (context_length_exceeded), so a client could not learn by how much it was over."""
    long = "x" * (100 * MAX_MODEL_LEN)         # more characters than the longest token's times the context
    r = httpx.post(api_server.url + "/tokenize", timeout=60, json={"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 200, r.text
    assert r.json()["count"] > MAX_MODEL_LEN and r.json()["max_model_len"] == MAX_MODEL_LEN


def test_chat_echo_prefixes_each_choice_with_the_assistants_last_message(api_server):
    """vLLM's chat echo was refused by name: each choice's content now starts with the last message's where
    it is the assistant's (streamed: in the role chunk), its logprobs the generated tokens' alone (as vLLM's);
    beside a tool_choice that forces a call, which leaves no content to prefix, it is a 400 naming it."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2,
            "temperature": 0, "n": 2, "logprobs": True, "chat_template_kwargs": {"enable_thinking": False}}

    def post(**extra) -> httpx.Response:
        return httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={**body, **extra})

    for c in post(echo=True).json()["choices"]:
        generated = "".join(lp["token"] for lp in c["logprobs"]["content"])
        assert c["message"]["content"] == "Hello the" + generated and len(c["logprobs"]["content"]) == 2, c
    chunks = [json.loads(line[6:]) for line in post(echo=True, stream=True).text.splitlines()
              if line.startswith("data: {")]
    assert [(c["index"], c["delta"]) for c in chunks[0]["choices"]] == [
        (i, {"role": "assistant", "content": "Hello the"}) for i in (0, 1)]
    assert all(c["delta"].get("content") != "Hello the" for chunk in chunks[1:] for c in chunk["choices"])
    user_last = post(messages=msgs[:1], continue_final_message=False, add_generation_prompt=True, echo=True)
    assert user_last.status_code == 200 and not user_last.json()["choices"][0]["message"]["content"].startswith("hi")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = post(echo=True, tools=tools, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_documents_reach_the_template_as_vllm_passes_them(tokenizer_dir):
    """vLLM's chat `documents` (retrieval-augmented generation) go to the template's `documents`, on chat
    completions and /tokenize alike (they were a 400, an unknown field); chat_template_kwargs' documents,
    where given too, win, as in vLLM's."""
    post = _in_process_api(tokenizer_dir, "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                                          "{% for m in messages %}{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]

    def rendered(**body) -> str:
        r = post("/tokenize", {"messages": messages, **body})
        assert r.status_code == 200, r.text
        return post("/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    docs = [{"title": "T", "text": "the fox"}]
    assert rendered() == "hi" and rendered(documents=docs) == "[T: the fox]hi"
    assert rendered(documents=docs, chat_template_kwargs={"documents": [{"title": "U", "text": "x"}]}) == "[U: x]hi"
    r = post("/v1/chat/completions", {"messages": messages, "documents": docs, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        post("/tokenize", {"messages": messages, "documents": docs}).json()["tokens"]), r.text
    bad = post("/v1/chat/completions", {"messages": messages, "documents": "T: the fox", "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents", bad.text


def test_cache_salt_keeps_prefix_cache_hits_within_one_salt(api_server):
    """vLLM's cache_salt, on chat and completions: a prompt cached without a salt or under one salt is not
    served from the cache under another; an empty salt is refused by name."""
    def cached(path: str, body: dict, salt: str | None) -> int:
        body = {**body, "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
        r = httpx.post(api_server.url + path, timeout=60, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    for path, body in (("/v1/completions", {"prompt": "salted prefix caching, completions " * 3}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "salted chat " * 8}]})):
        cached(path, body, None)        # the prompt in the unsalted cache (its template's first block may be already)
        assert cached(path, body, "s1") == 0
        assert cached(path, body, "s2") == 0
        assert cached(path, body, "s1") > 0
        r = httpx.post(api_server.url + path, timeout=60, json={**body, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    r = httpx.post(api_server.url + "/v1/responses", timeout=60, json={"input": "x", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_vllms_fields_are_taken_at_their_defaults_and_refused_by_name_otherwise(api_server):
    """What vLLM clients send at vLLM's defaults (beam search off, length_penalty 1, chat's echo false, ...)
    was a 400 for an unknown field; each is taken where it changes nothing, and another value is a 400
    naming it. vllm_xargs reaches SamplingParams.extra_args, as vLLM's does."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
                "chat_template": None, "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": None,
                "structural_tag": None, "logits_processors": [], "kv_transfer_params": None,
                "mm_processor_kwargs": {}, "media_io_kwargs": None, "prompt_embeds": None,
                "vllm_xargs": {"plugin": [1, "a"]}, "max_tokens": 1}
    for path, body in (("/v1/chat/completions", {**chat, "echo": False}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(api_server.url + path, timeout=60, json={**body, **defaults})
        assert r.status_code == 200, (path, r.text)
    for field, value in (("use_beam_search", True), ("length_penalty", 0.8),
                         ("chat_template", "{{ messages }}"), ("guided_decoding_backend", "outlines"),
                         ("logits_processors", ["my.Processor"]), ("kv_transfer_params", {"do_remote_decode": True})):
        r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={**chat, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert f"'{field}' is not supported" in r.json()["error"]["message"]
    from tokenmill.server.protocol import CompletionRequest
    assert CompletionRequest(prompt="x", vllm_xargs={"k": 1}).sampling_params(None).extra_args == {"k": 1}


def test_request_id_names_the_response_as_vllms_does(api_server):
    """vLLM's request_id: the response's id is "chatcmpl-" / "cmpl-" and it (every streamed chunk's too),
    unless an X-Request-Id header names the request; a client's id need not be unique."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "request_id": "job-7"}
    for _ in range(2):
        r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json=chat)
        assert r.status_code == 200 and r.json()["id"] == "chatcmpl-job-7", r.text
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, json={"prompt": ["a", "b"], "max_tokens": 2,
                                                                        "request_id": "job-7", "n": 2})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-job-7" and len(r.json()["choices"]) == 4, r.text
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "trace-9"},
                   json={"prompt": "a", "max_tokens": 2, "request_id": "job-7", "stream": True})
    ids = {json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {")}
    assert ids == {"cmpl-trace-9"}, r.text
    unnamed = httpx.post(api_server.url + "/v1/completions", timeout=60, json={"prompt": "a", "max_tokens": 1})
    assert unnamed.json()["id"].startswith("cmpl-") and len(unnamed.json()["id"]) == 5 + 32
    r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={**chat, "request_id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text


def test_return_token_ids_gives_the_prompts_and_the_choices_tokens(api_server, tokenizer):
    """vLLM's return_token_ids: the prompt's ids (chat: beside the choices; completions: in each choice) and
    each choice's generated ids; streamed, the prompt's with the first chunk (of each choice) and each
    chunk's new tokens, which join up to the whole answer's."""
    def post(path: str, body: dict) -> httpx.Response:
        r = httpx.post(api_server.url + path, timeout=60, json={**body, "max_tokens": 5, "temperature": 0,
                                                                "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r
    def chunks(r: httpx.Response) -> list[dict]:
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    ids = tokenizer.encode("count with me: one two")
    done = post("/v1/completions", {"prompt": ids, "n": 2}).json()
    assert [c["prompt_token_ids"] for c in done["choices"]] == [ids, ids]
    assert [len(c["token_ids"]) for c in done["choices"]] == [5, 5]
    assert tokenizer.decode(done["choices"][0]["token_ids"]) == done["choices"][0]["text"]
    streamed = chunks(post("/v1/completions", {"prompt": ids, "stream": True}))
    assert streamed[0]["choices"][0]["prompt_token_ids"] == ids
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in streamed[1:])
    assert sum((c["choices"][0]["token_ids"] for c in streamed), []) == done["choices"][0]["token_ids"]

    chat = {"messages": [{"role": "user", "content": "count with me"}]}
    whole = post("/v1/chat/completions", chat).json()
    rendered = httpx.post(api_server.url + "/tokenize", json=chat).json()["tokens"]
    assert whole["prompt_token_ids"] == rendered and len(whole["choices"][0]["token_ids"]) == 5
    streamed = chunks(post("/v1/chat/completions", {**chat, "stream": True}))
    assert streamed[0]["prompt_token_ids"] == rendered and "prompt_token_ids" not in streamed[1]
    assert sum((c["choices"][0].get("token_ids", []) for c in streamed), []) == whole["choices"][0]["token_ids"]
    plain = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={**chat, "max_tokens": 1}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_what_would_change_the_result_is_still_refused(api_server):
    for field, value in (("suffix", "x"), ("reasoning_effort", "high"), ("store", True), ("functions", [{}])):
        r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert field in r.json()["error"]["message"]
    # a reasoning effort the model's template does not read (Qwen3's reads enable_thinking instead)
    r = httpx.post(api_server.url + "/v1/responses", timeout=60, json={"input": "x", "reasoning": {"effort": "low"}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "reasoning.effort", r.text
    assert "does not read reasoning_effort" in error["message"]
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, json={"prompt": "x", "reasoning_effort": "low"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_errors_name_what_the_client_sent(api_server):
    """Each refusal names the field as the client wrote it (nested fields with their path), and what a
    server of this policy does not honour is refused, not dropped."""
    def error(path: str, body: dict) -> dict:
        r = httpx.post(api_server.url + path, timeout=60, json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert error("/v1/chat/completions", {**chat, "max_completion_tokens": 10 ** 6})["param"] == "max_completion_tokens"
    assert error("/v1/completions", {"prompt": "x", "max_completion_tokens": 10 ** 6})["param"] == "max_completion_tokens"
    # a rendered chat longer than the context: the client sent messages, not a prompt
    err = error("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]})
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded", err
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err
    assert error("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"foo": 1}})["param"] == \
        "stream_options.foo"
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"})):
        err = error(path, {**body, "priority": -5})       # taken, as vLLM's, and refused by this engine's policy
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"], (path, err)
    for key in ("5_0", " 7 ", "\u0665"):         # int() takes each; a token id is ASCII digits only
        assert error("/v1/completions", {"prompt": "x", "logit_bias": {key: 5}})["param"] == "logit_bias"
    # past 4,300 digits int() refused with a message about Python's settings and no field
    err = error("/v1/completions", {"prompt": "x", "logit_bias": {"1" * 5000: 5}})
    assert err["param"] == "logit_bias" and "5000 characters" in err["message"], err
    # a batch is named by what it holds, not by every branch of the prompt's type failing
    for prompt, says in ((["ab", [5, 6]], "holds lists and strings"), ([], "empty list"), ([7, None], "holds integers "
                         "and nulls"), ([[5], []], "prompt 1 of the batch is an empty list"),
                         ([[5], [6, "x"]], "prompt 1 of the batch holds strings")):
        err = error("/v1/completions", {"prompt": prompt})
        assert err["param"] == "prompt" and says in err["message"] and "Input should be" not in err["message"], err
    assert "Token id 999999 is out of range" in error("/detokenize", {"tokens": [5, 999999]})["message"]
    err = error("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 3})
    assert err["param"] == "min_tokens" and "got 3" in err["message"]
    assert error("/v1/chat/completions", {**chat, "verbosity": "low"})["param"] == "verbosity"
    assert error("/v1/responses", {"input": "x", "stream_options": {}})["param"] == "stream_options"
    # a value outside the ones a field takes is named beside them
    for field, value, says in (("service_tier", "flex", "'default' (got string 'flex')"),
                               ("truncation", 5, "'disabled' (got number 5)")):
        err = error("/v1/responses", {"input": "x", field: value})
        assert err["param"] == field and says in err["message"], err
    r = httpx.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        **chat, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    # prompt_logprobs 0 beside echoed logprobs 5: each prompt token's entry holds that token alone
    r = httpx.post(api_server.url + "/v1/completions", timeout=60, json={
        "prompt": "one two three", "max_tokens": 1, "echo": True, "logprobs": 5, "prompt_logprobs": 0})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:]), entries
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][1]) >= 5


def test_completion_top_logprobs_always_hold_the_sampled_token(api_server):
    """Legacy completions: each position's top_logprobs holds the k most likely tokens and the sampled one
    too where it is not among them (OpenAI: "up to logprobs+1 elements"), with the logprob it was given (where
    no likelier token has its text: `test_tokens_of_equal_text_share_the_likeliest_ones_logprob`)."""
    client = api_server.client()
    r = client.completions.create(model="tiny", prompt="hello there", max_tokens=24, logprobs=1, temperature=2.0,
                                  seed=3)
    lp = r.choices[0].logprobs
    assert all(tok in top and top[tok] == value for tok, value, top in zip(lp.tokens, lp.token_logprobs,
                                                                       lp.top_logprobs))
    sizes = {len(top) for top in lp.top_logprobs}
    assert 2 in sizes and sizes <= {1, 2}      # temperature 2 samples off the top


def test_tokens_of_equal_text_share_the_likeliest_ones_logprob(api_server, tokenizer):
    """Tokens of one text (split characters' bytes, each U+FFFD) are one key of top_logprobs: it holds the
    likeliest one's logprob, so lm-eval's greedy check (the token's logprob is the top's largest) holds
    exactly where the token is the likeliest; a less likely one of that text overwrote it, and a token of
    rank 359 read as greedy."""
    text = "你好，世界！这是一个测试。"
    ids = tokenizer.encode(text)
    c = httpx.post(api_server.url + "/v1/completions", timeout=60, json={
        "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1, "prompt_logprobs": 1}).json()["choices"][0]
    lp, ranks = c["logprobs"], [None] + [e[str(t)]["rank"] for t, e in zip(ids[1:], c["prompt_logprobs"][1:])]
    shared = 0
    for tok, value, top, rank in list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], ranks))[1:]:
        assert (value == max(top.values())) == (rank == 1), (tok, value, top, rank)
        shared += top[tok] != value
    assert shared        # the text holds such tokens


def test_split_characters_keep_their_bytes_and_offsets(api_server):
    """Characters that span several tokens (the test tokenizer's 400 tokens hold few whole non-ASCII ones):
    chat logprobs' `bytes` join to the content's UTF-8, where each token's text alone is U+FFFD; the
    completions' text_offset puts each token at the character it starts or completes, never past the text."""
    client = api_server.client()
    text = "hé 👏 你好"
    c = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=0, max_tokens=0).choices[0]
    tokens, offsets = c.logprobs.tokens, c.logprobs.text_offset
    assert c.text == text and any("\ufffd" in t for t in tokens)
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert all(text[at:at + len(t)] == t for t, at in zip(tokens, offsets) if "\ufffd" not in t)
    want = "👏你好é"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"structured_outputs": {"regex": want}})
    entries = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want and any(e.token == "\ufffd" for e in entries)
    # the entries end with the stop token's (<|im_end|>, shown as logprobs show special tokens)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == want + entries[-1].token
    assert all(top.bytes for e in entries for top in e.top_logprobs)


def test_text_offsets_pass_over_special_tokens_the_text_leaves_out(api_server):
    """A special token that skip_special_tokens leaves out of the text takes none of its characters: the
    tokens after it are where the text holds them (their offsets had gone past its end), streamed or not."""
    client = api_server.client()
    for skip in (False, True):
        body = dict(model="tiny", prompt="hi", max_tokens=6, logprobs=0, seed=1,
                    extra_body={"allowed_token_ids": [1, 67, 74], "ignore_eos": True, "skip_special_tokens": skip})
        c = client.completions.create(**body).choices[0]
        tokens, offsets = c.logprobs.tokens, c.logprobs.text_offset
        assert "<|im_start|>" in tokens[:-1] and ("<|im_start|>" in c.text) != skip, (tokens, c.text)
        for t, at in zip(tokens, offsets):
            assert c.text[at:at + len(t)] == t or (skip and t == "<|im_start|>" and at <= len(c.text)), (t, at, c.text)
    streamed = [o for ch in client.completions.create(**body, stream=True) if ch.choices and ch.choices[0].logprobs
                for o in ch.choices[0].logprobs.text_offset]
    assert streamed == offsets


def _in_process_api(tokenizer_path: str | None, chat_template: str | None = None, **app_options):
    """POST to the API in process, on this tokenizer (None: none; and chat template, `--chat-template`'s) and a
    stand-in engine that answers a prompt with every prompt token's entry and one token. `app_options` go to
    `build_app`; the returned function takes another `method` and httpx's request arguments."""
    import asyncio

    from stand_in_engine import StandInEngine
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
    from tokenmill.server.app import build_app

    tok = Tokenizer(tokenizer_path) if tokenizer_path is not None else None

    class Engine(StandInEngine):
        async def generate(self, request_id, ids, params, priority, **kw):
            entries = [None] + [{t: Logprob(-1.0, 1)} for t in ids[1:]]
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "", [5], None, [{5: Logprob(-1.0, 1)}],
                                                                         "length")], True, prompt_logprobs=entries)

    from tokenmill.server.serving import ChatOptions
    app = build_app(Engine(tok, 64), chat=ChatOptions(chat_template=chat_template), **app_options)

    def post(path: str, body: dict | None = None, method: str = "POST", **kw) -> httpx.Response:
        async def send():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tokenmill") as c:
                return await c.request(method, path, json=body, **kw)
        return asyncio.run(send())
    return post


@pytest.fixture(scope="module")
def bos_app(tokenizer_dir, tmp_path_factory):
    """`_in_process_api` on the test tokenizer made to put a BOS (<|endoftext|>) before each text, as
    Llama's and Mistral's do."""
    import shutil
    path = tmp_path_factory.mktemp("bos") / "tokenizer"
    shutil.copytree(tokenizer_dir, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos, a = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, a],
                              "pair": [bos, a, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return _in_process_api(str(path))


def test_echoed_text_offsets_pass_over_the_bos_the_tokenizer_added(bos_app):
    """A text prompt is echoed as given, without the BOS its tokenizer put before it: the BOS takes none of
    the text's characters, so each token after it is where the text holds it (all were a BOS's length past
    it). A special token the text spells takes its characters."""
    for prompt in ("hello world", "hi<|im_end|>x"):
        r = bos_app("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0})
        c = r.json()["choices"][0]
        tokens, offsets = c["logprobs"]["tokens"], c["logprobs"]["text_offset"]
        assert c["text"] == prompt and tokens[0] == "<|endoftext|>" and len(tokens) > 3, c
        assert offsets[:2] == [0, 0] and all(prompt[at:at + len(t)] == t for t, at in zip(tokens[1:], offsets[1:])), c


def test_echoed_text_offsets_leave_out_a_sentencepiece_prefix_space(tmp_path):
    """A SentencePiece tokenizer (Llama 2's, Mistral's) marks a word boundary before the text's first word,
    which decoding strips at the text's start: the first word's token takes the characters of the text
    without it, so that each token after it is where the text holds it (all were one past it), whether the
    text is echoed as given (its BOS left out) or decoded from ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    sp = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.train_from_iterator(["hello world, the quick brown fox"] * 4, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=["\u2581", *"abcdefghijklmnopqrstuvwxyz,"]))
    sp.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    post = _in_process_api(str(tmp_path))
    text = "hello world, the fox"
    ids = post("/tokenize", {"prompt": text}).json()["tokens"]
    for prompt, echoed, first in ((text, text, 1), (ids[1:], text, 0), (ids, "<s> " + text, 1)):
        c = post("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0}).json()["choices"][0]
        tokens, offsets = c["logprobs"]["tokens"], c["logprobs"]["text_offset"]
        assert c["text"] == echoed and tokens[first].startswith("hello") and tokens[-1] == "fox", c
        assert all(echoed[at:at + len(t)] == t for t, at in zip(tokens[first + 1:], offsets[first + 1:])), c
        assert offsets[-1] == len(echoed) - len("fox"), c


def test_tokenize_adds_a_bos_to_messages_only_when_asked(bos_app):
    """/tokenize counts what a request would send: a prompt with its BOS unless add_special_tokens is false,
    messages without one unless it is true (chat completions' default and vLLM's; it was not read)."""
    messages = [{"role": "user", "content": "hi"}]

    def tokens(**body) -> list[int]:
        r = bos_app("/tokenize", body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    rendered = tokens(messages=messages)
    assert rendered[0] != 0 and tokens(messages=messages, add_special_tokens=False) == rendered
    assert tokens(messages=messages, add_special_tokens=True) == [0] + rendered
    assert tokens(prompt="hi")[0] == 0 and tokens(prompt="hi", add_special_tokens=False)[0] != 0


def test_responses_create_and_stream(api_server):
    client = api_server.client()
    # max_tool_calls bounds OpenAI's built-in tools' calls, which this server runs none of: taken, echoed;
    # prompt_cache_retention, prompt_cache_options and a null conversation (the Agents SDK sends what a user
    # sets) change nothing
    r = client.responses.create(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=8,
                                temperature=0, store=False, max_tool_calls=2, prompt_cache_retention="24h",
                                prompt_cache_options={"ttl": "12h", "prewarm": False}, conversation=None)
    assert r.status in ("completed", "incomplete") and r.output and r.output[0].type == "message"
    assert r.max_tool_calls == 2
    # the Response object's fields as OpenAI documents them: the values sampled with, the tier that served it,
    # the request's cache fields echoed, completed_at only once completed
    assert (r.temperature, r.top_p, r.background, r.service_tier) == (0.0, 1.0, False, "default")
    assert (r.prompt_cache_retention, r.prompt_cache_key, r.safety_identifier) == ("24h", None, None)
    assert (r.completed_at is not None) == (r.status == "completed")
    for field, value, param, says in (("conversation", "conv_1", "conversation", "conv_1"),
                                      ("conversation", {"id": "conv_1"}, "conversation", "Conversations API"),
                                      ("prompt_cache_options", {"prewarm": True}, "prompt_cache_options.prewarm",
                                       "only false")):
        bad = httpx.post(api_server.url + "/v1/responses", timeout=60, json={"input": "x", field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert says in bad.json()["error"]["message"], bad.text
    assert r.output_text and r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "hello"}],
                                          max_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    events = list(client.responses.create(model="tiny", input=[{"role": "user", "content": "hello"}],
                                          instructions="Be brief.", max_output_tokens=8, temperature=0,
                                          stream=True, stream_options={"include_obfuscation": False}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-1].response.output_text
    assert events[0].response.completed_at is None and events[0].response.temperature == 0.0
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.content == []        # OpenAI's message opens empty; the SDK's helper appends the parts
    # the SDK's stream helper assembles the response from the events, as agents' frameworks use it
    with client.responses.stream(model="tiny", input=[{"role": "user", "content": "hello"}], instructions="Be brief.",
                                 max_output_tokens=8, temperature=0) as stream:
        helped = [e for e in stream]
    assert "".join(e.delta for e in helped if e.type == "response.output_text.delta") == r.output_text


def test_responses_are_stored_retrieved_continued_and_deleted(api_server):
    """A response is stored unless `store: false`; `previous_response_id` continues its conversation as if
    its input and output had been sent again (its instructions not carried over, as OpenAI's API has it);
    a streamed response is stored as its last event carries it; deleting one ends its conversation."""
    client = api_server.client()
    first = client.responses.create(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    history = [{"role": "user", "content": "hello"}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "and then?"}]
    resent = client.responses.create(model="tiny", input=history, max_output_tokens=6, temperature=0, store=False)
    assert resent.store is False
    assert (resent.output_text, resent.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resent.id)
    # item_reference: the stored items by id, as if sent again
    asked = client.responses.input_items.list(first.id).data[0]
    refs = [{"type": "item_reference", "id": item.id} for item in [asked, *first.output]]
    referenced = client.responses.create(model="tiny", max_output_tokens=6, temperature=0, store=False,
                                         input=[*refs, {"role": "user", "content": "and then?"}])
    assert (referenced.output_text, referenced.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    with pytest.raises(openai.BadRequestError, match="Item with id 'msg_gone' not found") as e:
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "msg_gone"}])
    assert e.value.param == "input"
    events = list(client.responses.create(model="tiny", input="stream", previous_response_id=second.id,
                                          max_output_tokens=4, temperature=0, stream=True))
    assert client.responses.retrieve(events[-1].response.id).model_dump() == events[-1].response.model_dump()
    with pytest.raises(openai.BadRequestError, match="Previous response with id 'resp_1' not found") as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    # OpenAI cancels only background responses: a 400 for one answered in its request
    with pytest.raises(openai.BadRequestError, match="only responses created with background: true") as e:
        client.responses.cancel(first.id)
    assert e.value.param == "response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.cancel(first.id)
    assert e.value.code == "response_not_found"
    with pytest.raises(openai.BadRequestError, match=f"{first.id}.*no longer stored"):
        client.responses.create(model="tiny", input="x", previous_response_id=events[-1].response.id)


def test_a_background_response_ends_as_the_request_answered_at_once_would(api_server):
    """Polled until it has ended, a background response has the body that the same request answered in its
    request gets, but for its ids, times, `background` and the prompt tokens found cached."""
    client = api_server.client()
    args = dict(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=8, temperature=0)
    r = client.responses.create(background=True, **args)
    assert (r.status, r.background) == ("queued", True)
    while r.status in ("queued", "in_progress"):
        time.sleep(0.01)
        r = client.responses.retrieve(r.id)
    answered = client.responses.create(**args)
    assert r.background and not answered.background

    def same(response) -> dict:
        body = response.model_dump()
        body.update(id=None, created_at=None, completed_at=None, background=None)
        body["usage"]["input_tokens_details"]["cached_tokens"] = None
        body["output"] = [{**item, "id": None} for item in body["output"]]
        return body
    assert same(r) == same(answered) and r.output_text


def test_responses_take_function_call_history(api_server):
    client = api_server.client()
    r = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert r.output_text is not None


def test_responses_truncation_auto_drops_the_earliest_items(api_server):
    """truncation "disabled" (the default): an input past the context is a 400 naming it; "auto" (OpenAI's
    rule) drops the conversation's earliest items until it fits with room for max_output_tokens, a call's
    output with its call; where the last item alone cannot fit, still a 400."""
    client = api_server.client()
    text = "hello world " * 8                   # 88 tokens
    chat = [{"role": "user", "content": text},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": text * 3},
            {"type": "function_call_output", "call_id": "c2", "output": "ok"},
            {"role": "user", "content": "and?"}]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256") as e:
        client.responses.create(model="tiny", input=chat, max_output_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "input"
    r = client.responses.create(model="tiny", input=chat, max_output_tokens=1, truncation="auto", store=False)
    left = client.responses.create(model="tiny", input=[chat[2], chat[4], chat[5]], max_output_tokens=1, store=False)
    assert r.truncation == "auto" and r.usage.input_tokens == left.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="even the conversation's last item alone") as e:
        client.responses.create(model="tiny", input=[{"role": "user", "content": text}], max_output_tokens=250,
                                truncation="auto")
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_output_tokens"


def test_responses_give_the_output_texts_logprobs_as_chat_does(api_server):
    """include ["message.output_text.logprobs"] with top_logprobs: the message's text carries each
    output token's logprob and alternatives, equal to chat's for the same conversation; streamed, the
    output_text deltas carry them in order."""
    client = api_server.client()
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    want = [t.model_dump() for t in chat.choices[0].logprobs.content]
    args = dict(model="tiny", input="hello", max_output_tokens=6, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    r = client.responses.create(**args)
    part = r.output[-1].content[0]
    assert r.top_logprobs == 2 and len(want) == r.usage.output_tokens
    assert [t.model_dump() for t in part.logprobs] == want and all(len(t["top_logprobs"]) == 2 for t in want)
    events = list(client.responses.create(stream=True, **args))
    streamed = [t.model_dump() for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed == want
    assert [t.model_dump() for t in events[-1].response.output[-1].content[0].logprobs] == want
    plain = client.responses.create(model="tiny", input="hello", max_output_tokens=6, temperature=0)
    assert plain.output[-1].content[0].logprobs == [] and plain.output_text == r.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hello", top_logprobs=21)
    assert e.value.param == "top_logprobs"


def test_a_stored_responses_input_items_are_listed(api_server):
    """GET /v1/responses/{id}/input_items through the openai client: the request's own input items, each
    with an id, newest first by default, in pages that `after` continues."""
    client = api_server.client()
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
            "id": "fc_given"}
    r = client.responses.create(model="tiny", max_output_tokens=2, temperature=0, input=[
        {"role": "user", "content": "weather?"}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    page = client.responses.input_items.list(r.id)
    assert [i.type for i in page.data] == ["function_call_output", "function_call", "message"]
    assert not page.has_more and page.data[1].id == "fc_given" and len({i.id for i in page.data}) == 3
    message = page.data[2]
    assert (message.role, message.content[0].type, message.content[0].text) == ("user", "input_text", "weather?")
    first = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.type for i in first.data] == ["message", "function_call"] and first.has_more
    rest = client.responses.input_items.list(r.id, order="asc", limit=2, after=first.last_id)
    assert [i.type for i in rest.data] == ["function_call_output"] and not rest.has_more
    # the stored items continue the conversation as the input did
    again = client.responses.create(model="tiny", max_output_tokens=2, temperature=0, input="ok",
                                    previous_response_id=r.id)
    assert again.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, limit=101)
    assert e.value.param == "limit" and "101" in e.value.message
    bad = httpx.get(f"{api_server.url}/v1/responses/{r.id}/input_items", params={"limit": "ten"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    assert bad.json()["error"]["message"].startswith("limit: Input should be a valid integer")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
    # a streamed response's items keep the ids they were given while it streamed
    with client.responses.create(model="tiny", input="stream", max_output_tokens=200, temperature=1,
                                 stream=True) as events:
        rid = next(iter(events)).response.id
        during = [item.id for item in client.responses.input_items.list(rid)]
        assert [e.type for e in events][-1] in ("response.completed", "response.incomplete")
    assert [item.id for item in client.responses.input_items.list(rid)] == during


def test_lm_eval_local_completions_scores_a_multiple_choice_task(api_server, hf_model, tokenizer, qwen3_dir,
                                                                 tmp_path, monkeypatch):
    """lm-eval's `local-completions` model runs a loglikelihood task from a local file against the
    server; its per-choice scores equal transformers' on the same token ids. (lm-eval's own tasks are
    left unindexed: indexing them takes 10 s and this task needs none of them.)"""
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval.tasks import TaskManager
    docs = [{"question": "def main():\n    return", "choices": [" 42", " None", " banana"], "answer": 0},
            {"question": "The quick brown fox jumps over the lazy", "choices": [" dog", " cat"], "answer": 1},
            {"question": "你好，", "choices": ["世界", "模型"], "answer": 0}]
    data = tmp_path / "mc.jsonl"
    data.write_text("\n".join(json.dumps(d, ensure_ascii=False) for d in docs))
    (tmp_path / "mc.yaml").write_text(
        "task: tokenmill_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tokenmill_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        model_args=f"model=tiny,base_url={api_server.url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={qwen3_dir},num_concurrent=1,max_retries=1",
        log_samples=True, limit=None)
    samples = results["samples"]["tokenmill_mc"]
    assert len(samples) == len(docs)
    expected_acc = 0
    for sample in samples:
        doc = sample["doc"]
        context = tokenizer.encode(doc["question"])
        scores = []
        for choice in doc["choices"]:
            ids = tokenizer.encode(doc["question"] + choice)
            ref = _hf_prompt_logprobs(hf_model, ids)
            scores.append(sum(ref[len(context) - 1:]))
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == pytest.approx(scores, abs=1e-3)
        expected_acc += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert results["results"]["tokenmill_mc"]["acc,none"] == pytest.approx(expected_acc / len(docs))



def test_which_variables_a_chat_template_reads():
    """What decides whether reasoning_effort is honored, and the hint of its refusal."""
    from tokenmill.server.prompts import _template_reads
    qwen3 = ("{%- for m in messages %}{{ m.content }}{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
             "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
             "{%- endif %}")
    assert _template_reads(qwen3, "enable_thinking") and not _template_reads(qwen3, "reasoning_effort")
    assert _template_reads({"default": qwen3, "effort": "{{ reasoning_effort }}"}, "reasoning_effort")
    # transformers' own tag (SmolLM3's template marks its assistant turns with it) is read through; a tag of
    # another renderer counts as reading anything, so that only the render decides
    generation = "{% generation %}{{ enable_thinking }}{% endgeneration %}"
    assert _template_reads(generation, "enable_thinking") and not _template_reads(generation, "reasoning_effort")
    assert _template_reads("{% other %}{{ x }}{% endother %}", "reasoning_effort")
    assert not _template_reads(None, "reasoning_effort")
