"""What a bad body costs the API server before it answers: bodies of at most the body limit (32 MiB,
--max-request-body-bytes' default), each built to be expensive to validate, posted in process to the app
(`build_app`, httpx's ASGI transport) on the bundled model's tokenizer. Per case: the body's size, the time
from sending it to the answer read whole (the median of --repeat runs; one where it took over 5 s), the
answer's status and size.

    PYTHONPATH=src python lab/validation_cost.py [--vocab-size 151936] [--repeat 3] [--only SUBSTRING] [-v]

The engine is a stand-in that runs what the real engine checks of a request before its first step (the token
ids it names against the vocabulary, `LLMEngine._check_token_ids`; its grammar, compiled by a real
`StructuredOutputManager`, which refuses a spec over its length limit before compiling) and then answers one
token. `--vocab-size` is the vocabulary the server knows (Qwen3-4B's by default: the bounds before
validation admit as many logit_bias and allowed_token_ids entries as it has tokens); the tokenizer stays the
bundled model's. `-v` prints each answer's first 160 characters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

LIMIT = 32 * 1024 * 1024
TARGET = 30_000_000          # what each body fills, short of the limit
ONCE_S = 5                   # a case that takes longer is run once
MODEL = Path(__file__).resolve().parents[1] / "src/tokenmill/assets/tiny"


def make_app(vocab_size: int, context: int):
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.engine.structured_output import StructuredOutputManager
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.server.app import build_app

    tok = Tokenizer(str(MODEL))
    grammars = StructuredOutputManager(tok.hf, len(tok.hf), [2])
    checks = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab_size))

    class Engine:
        model_name, tokenizer, max_model_len, dead, on_output = "tiny", tok, context, False, None
        processor = OutputProcessor(tok)

        def attach(self):
            pass

        async def generate(self, request_id, ids, params, priority, **kw):
            LLMEngine._check_token_ids(checks, params)
            if params.structured_outputs is not None:
                await asyncio.to_thread(grammars.compile, params.structured_outputs)
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "a", [40], None, None, "length")], True)

    return build_app(Engine(), vocab_size=vocab_size, max_request_body_bytes=LIMIT)


def fill(item: str, overhead: int = 200, target: int = TARGET) -> int:
    """How many `item`s (their JSON text, a separator each) fit the target beside `overhead` bytes."""
    return (target - overhead) // (len(item) + 1)


def long(target: int = TARGET) -> str:
    return "x" * (target - 500)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}
RESPONSE = {"input": "hi", "max_output_tokens": 1}


def json_list(item: str, count: int) -> str:
    return "[" + ",".join([item] * count) + "]"


def with_raw(base: dict, field: str, raw: str) -> bytes:
    """`base` with `field` set to the JSON text `raw` (built as text: a list of millions of items is
    written faster than json.dumps writes it)."""
    return (json.dumps(base)[:-1] + f', "{field}": {raw}}}').encode()


def token_map(vocab: int, value: str, start: int = 0) -> str:
    """A logit_bias of `vocab` entries, ids from `start`, each of `value` (JSON text)."""
    return "{" + ",".join(f'"{start + i}": {value}' for i in range(vocab)) + "}"


def schema(properties: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def cases(vocab: int, context: int):
    """(name, path, body), each body built as it is asked for. `context` items: one short of the context, the
    most the bounds before validation let through."""
    n = context - 1
    per_item = TARGET // n
    tool = {"type": "function", "function": {"name": "f", "parameters": schema(24)}}
    tools = min(n, 999_000 // 28)          # 28 arrays and objects a tool
    wide = json_list("[]", fill("[]"))             # millions of empty arrays
    deep = json_list("[" * 63 + "]" * 63, fill("[" * 63 + "]" * 63))     # arrays nested 65 deep in the body
    role = "x" * (per_item - 40)
    generic = [("model name of 30 MB", lambda base: json.dumps({**base, "model": long()}).encode()),
               ("an unknown field named in 30 MB", lambda base: json.dumps({**base, long(): 1}).encode()),
               ("an unknown field of millions of empty arrays", lambda base: with_raw(base, "x", wide)),
               ("an unknown field of arrays nested past the limit", lambda base: with_raw(base, "x", deep))]
    bases = [("chat", "/v1/chat/completions", CHAT), ("completions", "/v1/completions", COMPLETION),
             ("responses", "/v1/responses", RESPONSE), ("tokenize", "/tokenize", {"prompt": "hi"}),
             ("detokenize", "/detokenize", {"tokens": [1]}), ("invocations", "/invocations", CHAT)]
    for endpoint, path, base in bases:
        for name, build in generic:
            yield f"{endpoint}: {name}", path, build(base)
    for endpoint, path, base in bases[:2] + bases[-1:]:        # the sampling fields
        yield (f"{endpoint}: logit_bias, {vocab:,} entries whose values are strings", path,
               with_raw(base, "logit_bias", token_map(vocab, '"x"')))
        yield (f"{endpoint}: logit_bias, {vocab:,} entries past the vocabulary", path,
               with_raw(base, "logit_bias", token_map(vocab, "1", start=10 ** 12)))
        yield (f"{endpoint}: allowed_token_ids, {vocab:,} strings", path,
               with_raw(base, "allowed_token_ids", json_list('"x"', vocab)))
        yield (f"{endpoint}: allowed_token_ids, {vocab:,} ids past the vocabulary", path,
               with_raw(base, "allowed_token_ids", json_list(str(10 ** 15), vocab)))
    chat = "/v1/chat/completions"
    # just under the bound on arrays and objects, after a scalar field: the collector's worst order
    at_bound = json_list("[" * 59 + "]" * 59, 999_000 // 59)
    yield "chat: an unknown field of 999,000 arrays nested 60 deep", chat, with_raw(CHAT, "x", at_bound)
    yield "chat: a message's parsed, 999,000 arrays nested 60 deep", chat, \
        ('{"max_tokens": 1, "messages": [{"role": "user", "content": "hi", "parsed": ' + at_bound + "}]}").encode()
    yield "chat: logit_bias, a key of 30 MB whose value is a string", chat, \
        with_raw(CHAT, "logit_bias", json.dumps({long(): "x"}))
    yield "chat: stop_token_ids, millions of strings", chat, \
        with_raw(CHAT, "stop_token_ids", json_list('"x"', fill('"x"')))
    yield "chat: stop_token_ids, 16 ids past the vocabulary", chat, \
        with_raw(CHAT, "stop_token_ids", json_list(str(10 ** 15), 16))
    yield "chat: stop, millions of nulls", chat, with_raw(CHAT, "stop", json_list("null", fill("null")))
    yield "chat: stop, 15 strings of 2 MB and an empty one", chat, \
        json.dumps({**CHAT, "stop": ["x" * (TARGET // 16)] * 15 + [""]}).encode()
    yield "chat: bad_words, millions of nulls", chat, with_raw(CHAT, "bad_words", json_list("null", fill("null")))
    yield "chat: bad_words, 128 words of 256 spaces", chat, \
        json.dumps({**CHAT, "bad_words": [" " * 256] * 128}).encode()
    yield "chat: metadata, 16 keys of 2 MB", chat, \
        json.dumps({**CHAT, "metadata": {str(i) + "k" * (TARGET // 16): "v" for i in range(16)}}).encode()
    yield "chat: metadata, 16 values of 2 MB", chat, \
        json.dumps({**CHAT, "metadata": {f"k{i}": "v" * (TARGET // 16) for i in range(16)}}).encode()
    yield "chat: chat_template_kwargs, millions of empty arrays", chat, \
        with_raw(CHAT, "chat_template_kwargs", '{"k": ' + wide + "}")
    yield "chat: chat_template_kwargs, millions of numbers", chat, \
        with_raw(CHAT, "chat_template_kwargs", '{"k": ' + json_list("1", fill("1")) + "}")
    yield "chat: response_format schema, 990,000 properties", chat, json.dumps({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema(990_000)}}}).encode()
    yield "chat: response_format schema, a type of 30 MB", chat, json.dumps({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": long()}}}}).encode()
    yield "chat: response_format type of 30 MB", chat, \
        json.dumps({**CHAT, "response_format": {"type": long()}}).encode()
    yield f"chat: {tools:,} tools of 24 properties, tool_choice required", chat, \
        json.dumps({**CHAT, "tools": [tool] * tools, "tool_choice": "required"}).encode()
    yield f"chat: {tools:,} tools of 24 properties, tool_choice auto", chat, \
        json.dumps({**CHAT, "tools": [tool] * tools}).encode()
    yield "chat: a tool of 990,000 properties, tool_choice auto", chat, json.dumps({**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": schema(990_000)}}]}).encode()
    yield f"chat: {n:,} tools without a name", chat, \
        json.dumps({**CHAT, "tools": [{"type": "function", "function": {}}] * n}).encode()
    yield "chat: tools, parameters of a type of 30 MB", chat, json.dumps({**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": long()}}}]}).encode()
    yield "chat: tools, a tool type of 30 MB", chat, json.dumps({**CHAT, "tools": [{"type": long()}]}).encode()
    yield "chat: tool_choice, a function name of 30 MB", chat, json.dumps({**CHAT, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": long()}}}).encode()
    yield "chat: tool_choice, a type of 30 MB", chat, json.dumps({**CHAT, "tool_choice": {"type": long()}}).encode()
    yield f"chat: {n:,} messages of a role of {len(role):,} bytes", chat, \
        json.dumps({**CHAT, "messages": [{"role": role, "content": "hi"}] * n}).encode()
    yield f"chat: {n:,} messages whose content is a number", chat, \
        json.dumps({**CHAT, "messages": [{"role": "user", "content": 1}] * n}).encode()
    yield f"chat: {n:,} content parts of a number", chat, \
        json.dumps({**CHAT, "messages": [{"role": "user", "content": [1] * n}]}).encode()
    yield "chat: prediction, millions of nulls", chat, \
        with_raw(CHAT, "prediction", '{"type": "content", "content": ' + json_list("null", fill("null")) + "}")
    yield "chat: prediction, millions of empty text parts", chat, with_raw(CHAT, "prediction", (
        '{"type": "content", "content": ' + json_list('{"type":"text","text":""}', fill('{"type":"text","text":""}'))
        + "}"))
    yield "chat: a message's parsed, millions of empty arrays", chat, \
        ('{"max_tokens": 1, "messages": [{"role": "user", "content": "hi", "parsed": ' + wide + "}]}").encode()
    yield f"chat: documents, {n:,} fields that are numbers", chat, \
        json.dumps({**CHAT, "documents": [{f"k{i}": 1 for i in range(n)}]}).encode()
    yield "chat: reasoning_effort of 30 MB", chat, json.dumps({**CHAT, "reasoning_effort": long()}).encode()
    yield "chat: max_tokens, a string of 30 MB digits", chat, \
        json.dumps({**CHAT, "max_tokens": "9" * (TARGET - 500)}).encode()
    yield "chat: guided_regex of 30 MB", chat, json.dumps({**CHAT, "guided_regex": "a" * (TARGET - 500)}).encode()
    yield "chat: guided_choice, millions of strings", chat, \
        with_raw(CHAT, "guided_choice", json_list('"x"', fill('"x"')))
    yield "chat: 8 unknown fields named in 3.7 MB each", chat, \
        json.dumps({**CHAT, **{str(i) + "x" * (TARGET // 8): 1 for i in range(8)}}).encode()
    completions = "/v1/completions"
    yield "completions: 256 prompts of 117 KB", completions, \
        json.dumps({**COMPLETION, "prompt": ["hello " * (TARGET // 256 // 6)] * 256}).encode()
    yield f"completions: a prompt of {n:,} ids past the vocabulary", completions, \
        json.dumps({**COMPLETION, "prompt": [10 ** 15] * n}).encode()
    yield "completions: a prompt of millions of empty arrays", completions, with_raw({"max_tokens": 1}, "prompt", wide)
    yield "completions: vllm_xargs, 256 lists of nulls", completions, with_raw(COMPLETION, "vllm_xargs", "{" + ",".join(
        f'"k{i}": ' + json_list("null", fill("null", target=TARGET // 256)) for i in range(256)) + "}")
    yield "completions: vllm_xargs, a list of millions of numbers", completions, \
        with_raw(COMPLETION, "vllm_xargs", '{"k": ' + json_list("1", fill("1")) + "}")
    responses = "/v1/responses"
    yield f"responses: {n:,} input items of a type of {len(role):,} bytes", responses, \
        json.dumps({**RESPONSE, "input": [{"type": role}] * n}).encode()
    yield f"responses: {n:,} messages of a role of {len(role):,} bytes", responses, \
        json.dumps({**RESPONSE, "input": [{"role": role, "content": "hi"}] * n}).encode()
    yield "responses: include, millions of nulls", responses, \
        with_raw(RESPONSE, "include", json_list("null", fill("null")))
    yield "responses: include, millions of strings", responses, \
        with_raw(RESPONSE, "include", json_list('"x"', fill('"x"')))
    yield "responses: text.format schema, 990,000 properties", responses, json.dumps({**RESPONSE, "text": {"format": {
        "type": "json_schema", "name": "s", "schema": schema(990_000)}}}).encode()
    yield "responses: tools, parameters of a type of 30 MB", responses, json.dumps({**RESPONSE, "tools": [
        {"type": "function", "name": "f", "parameters": {"type": long()}}]}).encode()
    yield "responses: tools, a tool type of 30 MB", responses, \
        json.dumps({**RESPONSE, "tools": [{"type": long()}]}).encode()
    yield "responses: tool_choice, a function name of 30 MB", responses, json.dumps({
        **RESPONSE, "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": long()}}).encode()
    yield "responses: previous_response_id of 30 MB", responses, \
        json.dumps({**RESPONSE, "previous_response_id": long()}).encode()
    yield "responses: metadata, 16 keys of 2 MB", responses, \
        json.dumps({**RESPONSE, "metadata": {str(i) + "k" * (TARGET // 16): "v" for i in range(16)}}).encode()
    yield "responses: a reasoning item's summary, millions of empty arrays", responses, (
        '{"max_output_tokens": 1, "input": [{"type": "reasoning", "id": "r", "summary": ' + wide + "}, "
        '{"role": "user", "content": "hi"}]}').encode()
    yield f"tokenize: {n:,} messages of a role of {len(role):,} bytes", "/tokenize", \
        json.dumps({"messages": [{"role": role, "content": "hi"}] * n}).encode()
    yield "tokenize: a prompt of 30 MB", "/tokenize", json.dumps({"prompt": long()}).encode()
    yield "tokenize: chat_template_kwargs, millions of empty arrays", "/tokenize", (
        '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": ' + wide + "}}").encode()
    yield "tokenize: tools, parameters of a type of 30 MB", "/tokenize", json.dumps({
        "messages": CHAT["messages"], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": long()}}}]}).encode()
    yield f"detokenize: {n:,} tokens of strings", "/detokenize", json.dumps({"tokens": [role] * n}).encode()
    yield "invocations: neither messages nor prompt, 8 keys of 3.7 MB", "/invocations", \
        json.dumps({str(i) + "x" * (TARGET // 8): 1 for i in range(8)}).encode()

async def post(client: httpx.AsyncClient, path: str, body: bytes) -> tuple[float, int, bytes]:
    t0 = time.perf_counter()
    r = await client.post(path, content=body, headers={"content-type": "application/json"})
    return time.perf_counter() - t0, r.status_code, r.content


async def main(args) -> None:
    app = make_app(args.vocab_size, args.max_model_len)
    print("| case | body MB | ms | status | answer bytes |\n|---|---|---|---|---|")
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tokenmill",
                                     timeout=600) as client:
            for name, path, body in cases(args.vocab_size, args.max_model_len):
                if args.only is not None and args.only not in name:
                    continue
                assert len(body) <= LIMIT, (name, len(body))
                runs = [await post(client, path, body)]
                while len(runs) < args.repeat and runs[0][0] < ONCE_S:
                    runs.append(await post(client, path, body))
                ms = statistics.median(t for t, _, _ in runs) * 1e3
                _, status, answer = runs[-1]
                print(f"| {name} | {len(body) / 1e6:.1f} | {ms:,.0f} | {status} | {len(answer):,} |", flush=True)
                if args.verbose:
                    print("    " + answer[:160].decode(errors="replace"), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, default=151_936)
    p.add_argument("--max-model-len", type=int, default=40_960)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only")
    p.add_argument("-v", "--verbose", action="store_true")
    asyncio.run(main(p.parse_args()))
