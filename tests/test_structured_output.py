"""Structured output (xgrammar) and logit_bias through `LLM.generate` on a tiny random Qwen3 model with the
400-token byte-level tokenizer (its model vocabulary has 512 rows: ids 400-511 are never allowed).

A random model does not close JSON by itself: the schemas bound every string, number and array, and JSON
is asked without free whitespace, so the grammar itself must end each output with EOS."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import SamplingParamError, StructuredOutputsParams

EOS = 2
PROMPTS = ["The quick brown fox", "def main():", "你好，世界", "Continuous batching"]

NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    "active": {"type": "boolean"}}, "required": ["user", "active"]}
ENUMS = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "XL"]}},
    "required": ["color", "size"]}
ARRAYS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9]{0,4}$"}, "minItems": 1,
             "maxItems": 3},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4}},
    "required": ["tags", "scores"]}
TOP_ARRAY = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4}
# xgrammar 0.2.9 writes a length-bounded string as [^"\\\r\n]{0,n}; the engine keeps control characters out
BOUNDED = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
# propertyNames' constraints need no type (a name is a string), as pydantic writes a dict's constrained keys
KEYED = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
         "propertyNames": {"pattern": "^[a-z]{1,3}$"}, "minProperties": 1, "maxProperties": 2}


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=256, num_kv_blocks=512)


def constrained(max_tokens=80, temperature=0.0, **kw) -> SamplingParams:
    seed, n = kw.pop("seed", None), kw.pop("n", 1)
    bias = kw.pop("logit_bias", None)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=n, logit_bias=bias,
                          structured_outputs=StructuredOutputsParams(**kw))


def ended_by_grammar(c) -> bool:
    return c.finish_reason == "stop" and c.token_ids[-1] == EOS


def step_until_done(engine, params: dict) -> tuple[dict, list, set]:
    """Adds each (request id, params) of `params` with the prompt [5, 6, 7] and steps the engine until none is
    left: each request's tokens as the step reports carried them, the engine's errors, the finished ids."""
    handles = {engine.add_request(rid, [5, 6, 7], p): rid for rid, p in params.items()}
    tokens = {rid: [] for rid in params}
    errors, finished = [], set()
    while engine.has_unfinished_requests():
        report = engine.step()
        errors += engine.take_errors()
        for handle, token in zip(report.handles.tolist(), report.tokens.tolist()):
            tokens[handles[handle]].append(token)
        finished |= {handles[f[0]] for f in report.finished}
    return tokens, errors, finished


def served_in_process(model_dir):
    """An engine core in this process and the app serving it as "tiny" (its grammars and their limits
    patchable from the test)."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.server.app import build_app
    engine = AsyncLLM(EngineConfig(model=model_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                                   max_model_len=256), in_process=True)
    return engine, build_app(engine, served_model_names=["tiny"])


@pytest.mark.parametrize("schema", [NESTED, ENUMS, ARRAYS, TOP_ARRAY, BOUNDED, KEYED],
                         ids=["nested", "enums", "arrays", "array", "max-length", "property-names"])
def test_json_schema_outputs_validate(llm, schema):
    outs = llm.generate(PROMPTS[:2], constrained(json=schema, disable_any_whitespace=True))
    for out in outs:
        c = out.outputs[0]
        assert ended_by_grammar(c), (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_schema_as_text_and_sampled_with_seeds(llm):
    params = constrained(json=json.dumps(NESTED), disable_any_whitespace=True, temperature=1.0, seed=7, n=3)
    first = llm.generate(PROMPTS[:1], params)
    for out in first:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert ended_by_grammar(c)
            jsonschema.validate(json.loads(c.text), NESTED)
    assert len({c.text for c in first[0].outputs}) > 1          # each sequence its own draws and matcher
    again = llm.generate(PROMPTS[:1], params)                  # seeded: the same outputs again
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in first]


def test_regex_choice_and_grammar(llm):
    regex = r"[a-z]{2,4}-\d{3}(!|\?)"
    choices = ["yes", "no", "café au lait", 'say "hi"\n']
    grammar = 'root ::= "(" num op num ")" | num\nop ::= "+" | "*"\nnum ::= [1-9] [0-9]?'
    params = [constrained(regex=regex), constrained(choice=choices), constrained(grammar=grammar)]
    outs = llm.generate(PROMPTS[:3] * 3, [p for p in params for _ in range(3)])
    texts = [o.outputs[0].text for o in outs]
    assert all(ended_by_grammar(o.outputs[0]) for o in outs)
    assert all(re.fullmatch(regex, t) for t in texts[:3]), texts[:3]
    assert all(t in choices for t in texts[3:6]), texts[3:6]
    assert all(re.fullmatch(r"\([1-9][0-9]?[+*][1-9][0-9]?\)|[1-9][0-9]?", t) for t in texts[6:]), texts[6:]


NO_TOKEN = "after 0 tokens the choice allows none of allowed_token_ids [2], which leaves no token to generate"


def test_allowed_token_ids_the_grammar_refuses_fail_the_request_under_every_filter(llm):
    """allowed_token_ids that the grammar refuses leave a row no token (every logit -inf): greedy or drawn under
    top-p, top-k or min-p, it took token 0, which the grammar refused too, and the request ended "stop" with
    token 0 for its output. The fill of its mask now fails it, naming the position and the fields, beside the
    batch's other request, which completes; so do bad words that ban every token the grammar allows, one of
    one token at once, one of two after its first. `LLM.generate` raises the error."""
    engine = llm.engine
    filters = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.5),
               dict(temperature=1.0, top_k=3), dict(temperature=1.0, min_p=0.1)]
    spec = StructuredOutputsParams(choice=["yes", "no"])
    params = {f"refused{i}": SamplingParams(max_tokens=4, allowed_token_ids=[EOS], structured_outputs=spec, **f)
              for i, f in enumerate(filters)}
    x, y = llm.get_tokenizer().encode("xy", add_special_tokens=False)
    params["word"] = constrained(max_tokens=4, choice=["x"])
    params["word"].bad_words_token_ids = [[x]]
    params["two"] = constrained(max_tokens=4, choice=["xy"])
    params["two"].bad_words_token_ids = [[x, y]]
    params["fine"] = constrained(choice=["yes", "no"])
    tokens, errors, finished = step_until_done(engine, params)
    assert len(errors) == 7 and {rid for rid, _, _ in errors} == set(params) - {"fine"}, errors
    for rid, message, param in errors:
        if rid.startswith("refused"):
            assert message == NO_TOKEN and param == "allowed_token_ids", (rid, message, param)
    assert {rid: (m, p) for rid, m, p in errors if not rid.startswith("refused")} == {
        "word": (f"after 0 tokens the choice allows only [{x}], which bad_words ban there: no token is left to "
                 "generate", "bad_words"),
        "two": (f"after 1 token the choice allows only [{y}], which bad_words ban there: no token is left to "
                "generate", "bad_words")}
    assert tokens["two"] == [x] and all(not tokens[rid] for rid in params if rid not in ("two", "fine"))
    assert finished == {"fine"} and llm.get_tokenizer().decode(tokens["fine"][:-1]) in ("yes", "no")
    assert not engine.groups and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(SamplingParamError, match=re.escape(NO_TOKEN)) as e:
        llm.generate(PROMPTS[:2], [params["refused0"], constrained(choice=["yes", "no"])])
    assert e.value.param == "allowed_token_ids" and not engine.groups


def test_bad_words_that_ban_every_allowed_token_fail_the_request_without_a_grammar(llm):
    """Without a grammar, a word of two tokens bans its last only once the output ends with its first, which the
    sampler decides on the device: allowed_token_ids [x] with the bad word [x, x] leave the second token none,
    and the sampler drew token 0 (outside allowed_token_ids) as the request's output, greedy or under top-p.
    The engine now fails the request when it reads that token, naming the position and the fields, beside a
    request that completes; so does one whose only other allowed token is an end of sequence that min_tokens
    holds back. `LLM.generate` raises the error."""
    engine = llm.engine
    x, y = llm.get_tokenizer().encode("xy", add_special_tokens=False)
    params = {f"banned{i}": SamplingParams(max_tokens=6, allowed_token_ids=[x], **f)
              for i, f in enumerate([dict(temperature=0.0), dict(temperature=1.0, top_p=0.5, seed=3)])}
    params["held"] = SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=[x, EOS], min_tokens=4)
    params["fine"] = SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=[x, y], ignore_eos=True)
    for p in params.values():
        p.bad_words_token_ids = [[x, x]]
    tokens, errors, finished = step_until_done(engine, params)
    message = f"at output token 1 bad_words ban [{x}] of allowed_token_ids [{x}]: no token is left to generate"
    assert sorted(errors) == sorted([("banned0", message, "bad_words"), ("banned1", message, "bad_words"), (
        "held", f"at output token 1 bad_words ban [{x}] of allowed_token_ids [{x}, {EOS}], and min_tokens=4 bans "
        f"[{EOS}]: no token is left to generate", "bad_words")])
    assert all(tokens[rid] == [x] for rid in ("banned0", "banned1", "held"))
    fine = tokens["fine"]
    assert finished == {"fine"} and len(fine) == 6 and set(fine) <= {x, y}
    assert [x, x] not in [fine[i:i + 2] for i in range(5)]
    assert not engine.groups and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(SamplingParamError, match=re.escape(message)) as e:
        llm.generate(PROMPTS[:2], [params["banned0"], params["fine"]])
    assert e.value.param == "bad_words" and not engine.groups


def test_json_object_and_eos_only_where_the_grammar_accepts(llm):
    tok = llm.get_tokenizer()
    close = tok.encode("}")[0]
    # +100 on "}" steers the object shut at once; the grammar still decides what may follow
    out = llm.generate(PROMPTS[0], constrained(json_object=True, logit_bias={close: 100}))[0].outputs[0]
    assert ended_by_grammar(out) and json.loads(out.text) == {}
    # EOS pushed with +100 is still refused until the regex is complete
    out = llm.generate(PROMPTS[0], constrained(regex=r"[a-z]{5}", logit_bias={EOS: 100}))[0].outputs[0]
    assert ended_by_grammar(out) and re.fullmatch(r"[a-z]{5}", out.text)


def test_plain_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 4 + [constrained(json=ENUMS, disable_any_whitespace=True),
                                                           constrained(choice=["a", "b"]),
                                                           constrained(regex=r"\d{4}"),
                                                           SamplingParams(temperature=0.0, max_tokens=12,
                                                                          logit_bias={7: 50.0, 9: -100})])
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    assert json.loads(mixed[4].outputs[0].text)["size"] in ("S", "M", "XL")


def test_logit_bias_forces_and_bans_tokens(llm):
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    plain = llm.generate(PROMPTS[0], base)[0].outputs[0]
    first = plain.token_ids[0]
    runner_up = next(t for t, lp in plain.logprobs[0].items() if lp.rank == 2)
    forced = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5,
                                                     logit_bias={runner_up: 100}))[0].outputs[0]
    assert forced.token_ids == [runner_up] * 6
    # logprobs are the model's, before the bias (vLLM's raw_logprobs)
    assert forced.logprobs[0][runner_up].logprob == pytest.approx(plain.logprobs[0][runner_up].logprob, abs=1e-5)
    banned = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                     logit_bias={first: -100}))[0].outputs[0]
    assert banned.token_ids[0] != first and first not in banned.token_ids
    sampled = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                      logit_bias={"333": 100}))[0].outputs[0]
    assert sampled.token_ids == [333] * 6


def test_logit_bias_limits(llm):
    with pytest.raises(SamplingParamError, match=r"\[0, 512\)") as e:
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={512: 1.0}))
    assert e.value.param == "logit_bias" and "512" in str(e.value)
    for bad in (100.5, -101, float("nan"), "x"):
        with pytest.raises(SamplingParamError, match=r"\[-100, 100\]") as e:
            SamplingParams(logit_bias={5: bad})
        assert e.value.param == "logit_bias"
    with pytest.raises(SamplingParamError, match="not a token id"):
        SamplingParams(logit_bias={"five": 1})
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spec, param, message", [
    (dict(json={"type": "nonsense"}), "structured_outputs.json", 'Unsupported type "nonsense"'),
    (dict(json='{"type": '), "structured_outputs.json", "not valid JSON"),
    (dict(regex="a(b"), "structured_outputs.regex", "parenthesis is not closed"),
    (dict(grammar='root ::= "a" |'), "structured_outputs.grammar", "EBNF parser error"),
    (dict(choice=[]), "structured_outputs.choice", "non-empty list"),
    (dict(json={}, regex="a"), "structured_outputs", "exactly one of"),
    (dict(json={}, whitespace_pattern=" "), "structured_outputs.whitespace_pattern", "not supported"),
    (dict(json={"enum": ["x" * 100] * 9_901}), "structured_outputs.json",
     "JSON schema is at least 1,019,813 characters long, over the limit of 1,000,000"),
    (dict(choice=["y" * 999] * 1_001), "structured_outputs.choice", "over the limit of 1,000,000"),
    (dict(structural_tag=json.dumps({"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "const_string", "value": "a"}, {"type": "regex", "pattern": "b*"}]}})),
     "structured_outputs.structural_tag.format.elements.1", "format 'regex' at format.elements.1 is not supported"),
    (dict(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"type": "nonsense"}}})),
     "structured_outputs.structural_tag.format", 'Unsupported type "nonsense"'),
])
def test_invalid_specs_name_the_problem(llm, spec, param, message):
    with pytest.raises(SamplingParamError, match=re.escape(message)) as e:
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert e.value.param == param
    assert "/project/" not in str(e.value)       # xgrammar's source location is stripped
    assert not llm.engine.has_unfinished_requests()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Tokyo"]}, "unit": {"type": "string", "pattern": "^[a-z]{1,2}$"}},
    "required": ["city", "unit"]}}}, {"type": "function", "function": {"name": "ping"}}]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_auto_tools_beside_a_format_decode_to_calls_or_the_format(llm, parser):
    """Sampled under the grammar of tool_choice "auto" beside a response format, every output that ends is the
    parser's calls of the tools, under their schemas (one without parallel calls), or the format's JSON; both
    come."""
    from tokenmill.server.protocol import ChatCompletionRequest
    from tokenmill.server.tool_parsers import TOOL_PARSERS
    jsonschema = pytest.importorskip("jsonschema")
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ENUMS}}})
    tool_parser = TOOL_PARSERS[parser]()
    params = SamplingParams(temperature=1.5, max_tokens=100, seed=0, n=8,
                            structured_outputs=req.structured_params(tool_parser.call_form))
    kinds = []
    for c in (c for out in llm.generate(PROMPTS[:2], params) for c in out.outputs if ended_by_grammar(c)):
        extracted = tool_parser.extract(c.text)
        if extracted.tool_calls:
            assert extracted.content is None and len(extracted.tool_calls) == 1, c.text
            call = extracted.tool_calls[0]
            schema = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}[call.name]
            jsonschema.validate(json.loads(call.arguments), schema)
        else:
            jsonschema.validate(json.loads(extracted.content), ENUMS)
        kinds.append(bool(extracted.tool_calls))
    assert len(kinds) >= 12 and set(kinds) == {True, False}, kinds


def test_bench_serve_structured_fraction_payloads():
    from tokenmill.bench.serve_payload import BENCH_SCHEMA, build_payload, structured_indices
    from tokenmill.bench.serve_datasets import ServeRequest
    assert sorted(structured_indices(12, 0.25)) == [3, 7, 11]
    assert len(structured_indices(200, 0.25)) == 50 and not structured_indices(10, 0.0)
    req = ServeRequest("hi", 8, 1)
    chat = build_payload("/v1/chat/completions", "m", req, True, 0.0, BENCH_SCHEMA)
    assert chat["response_format"]["json_schema"]["schema"] == BENCH_SCHEMA
    assert build_payload("/v1/completions", "m", req, True, 0.0, BENCH_SCHEMA)["structured_outputs"] == \
        {"json": BENCH_SCHEMA}
    assert "response_format" not in build_payload("/v1/chat/completions", "m", req, True, 0.0)


def test_a_slow_grammar_stalls_no_other_request(qwen3_dir, monkeypatch):
    """The engine core compiled a request's grammar inside its loop: a schema of thousands of tools (tool_choice
    "required") took 16 s to compile on the CPU machine, and every other request's steps waited for it. The
    core now compiles on threads of its own and adds the request when its grammar is ready: here a compile
    made to last until a plain request and one whose grammar is cached have finished beside it; the
    constrained one then completes under its grammar, and an invalid spec compiled there is still that
    request's error alone. A compile that does not end (an object of 2,000 optional properties: minutes, GBs)
    held the one compile thread, and every constrained request queued behind it: past MAX_COMPILE_SECONDS its
    request fails naming the limit, the others compile beside it, and its spec sent again is refused at once."""
    import asyncio
    import threading
    import time

    from tokenmill.config import EngineConfig
    from tokenmill.engine import structured_output
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.engine.structured_output import StructuredOutputManager

    compile_grammar = StructuredOutputManager._compile
    release, others_done, endless = threading.Event(), threading.Event(), []

    def slow(self, kind, spec, any_whitespace):
        if kind == "regex" and spec.startswith("(yes|no)"):
            assert others_done.wait(20)
            finished["slow compile"] = time.monotonic()
        elif kind == "regex" and spec == "(a|b)*!":
            endless.append(spec)
            release.wait(30)
        return compile_grammar(self, kind, spec, any_whitespace)
    monkeypatch.setattr(StructuredOutputManager, "_compile", slow)
    engine = AsyncLLM(EngineConfig(model=qwen3_dir, device="cpu", dtype="float32"), in_process=True)
    finished = {}

    async def run(rid, params):
        async for out in engine.generate(rid, [5, 6, 7], params):
            last = out
        finished[rid] = time.monotonic()
        if rid == "plain":                  # two others wait for their grammars, and are counted so
            finished["waiting"] = (await engine.get_stats())["num_waiting"]
        if "plain" in finished and "cached" in finished:
            others_done.set()
        return last.outputs[0].text

    def json_object():
        return SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True))

    def endless_regex():
        return SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a|b)*!"))

    async def main():
        engine.attach()
        await run("warm-up", json_object())                  # its grammar compiled, and cached
        tasks = [asyncio.ensure_future(run(rid, params)) for rid, params in (
            ("endless", endless_regex()),                     # first: one compile thread would be held by it
            ("slow", SamplingParams(max_tokens=8, n=2, structured_outputs=StructuredOutputsParams(regex="(yes|no)!"))),
            ("plain", SamplingParams(max_tokens=4, ignore_eos=True)),
            ("cached", json_object()),
            ("bad", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(("))))]
        results = await asyncio.wait_for(asyncio.gather(*tasks[1:], return_exceptions=True), 30)
        monkeypatch.setattr(structured_output, "MAX_COMPILE_SECONDS", 0.5)    # "endless" has compiled longer
        results += await asyncio.wait_for(asyncio.gather(tasks[0], return_exceptions=True), 10)
        again = time.monotonic()
        results += await asyncio.gather(run("again", endless_regex()), return_exceptions=True)
        return results, time.monotonic() - again
    try:
        (slow_text, plain_text, cached_text, bad, endless_error, again), again_seconds = asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()
    assert finished["plain"] < finished["slow compile"] < finished["slow"], finished
    assert finished["cached"] < finished["slow compile"] and isinstance(cached_text, str), finished
    assert finished["waiting"] == 3, finished       # "slow"'s two sequences, as the scheduler counts them
    assert slow_text in ("yes!", "no!") and isinstance(plain_text, str)
    assert isinstance(bad, SamplingParamError) or (isinstance(bad, ValueError) and "invalid regex" in str(bad)), bad
    message = re.compile(r"^the regex did not compile in \d+\.\d s; the limit is 0\.5 s: compile time grows faster")
    assert isinstance(endless_error, ValueError) and message.match(str(endless_error)), endless_error
    assert isinstance(again, ValueError) and message.match(str(again)) and again_seconds < 1, (again, again_seconds)
    assert endless == ["(a|b)*!"], endless           # refused without a second compile


def test_the_grammar_cache_is_bounded_in_bytes(llm):
    """Compiled grammars kept for reuse hold at most `cache_bytes` together (a schema of 5,000 tools
    compiles to ~216 MB with SmolLM2's vocabulary, so 256 entries could take tens of GB): the most
    recently used stay, and one larger than the budget is used but not kept."""
    from tokenmill.engine.structured_output import StructuredOutputManager
    engine = llm.engine
    schemas = [{"type": "object", "properties": {f"k{i}": {"enum": list(range(i + 2))}}, "required": [f"k{i}"]}
               for i in range(6)]
    size = StructuredOutputManager(engine.tokenizer.hf, engine.model_config.vocab_size, [EOS]).compile(
        StructuredOutputsParams(json=schemas[0]))[0].memory_size_bytes
    manager = StructuredOutputManager(engine.tokenizer.hf, engine.model_config.vocab_size, [EOS],
                                      cache_bytes=int(size * 3.5))
    params = [StructuredOutputsParams(json=schema) for schema in schemas]
    for p in params:
        manager.compile(p)
        assert manager.cached_bytes <= int(size * 3.5)
    assert manager.cached(params[0]) is None and manager.cached(params[-1]) is not None
    assert manager.cached_bytes == sum(manager.cached(p)[0].memory_size_bytes
                                       for p in params if manager.cached(p) is not None)
    small = StructuredOutputManager(engine.tokenizer.hf, engine.model_config.vocab_size, [EOS], cache_bytes=size // 2)
    assert small.compile(params[0])[0] is not None and small.cached(params[0]) is None and small.cached_bytes == 0


def test_requests_with_one_spec_share_its_compile(llm, monkeypatch):
    """Grammars compile on several threads: a second request with a spec that is compiling waits for that
    compile rather than starting its own, and one given up on (past MAX_COMPILE_SECONDS) fails at once
    those waiting on it, while the compile itself runs on."""
    import threading

    from tokenmill.engine.structured_output import StructuredOutputManager
    engine = llm.engine
    manager = StructuredOutputManager(engine.tokenizer.hf, engine.model_config.vocab_size, [EOS])
    compile_grammar, release, calls = StructuredOutputManager._compile, threading.Event(), []

    def held(self, kind, spec, any_whitespace):
        calls.append(spec)
        assert release.wait(10)
        return compile_grammar(self, kind, spec, any_whitespace)
    monkeypatch.setattr(StructuredOutputManager, "_compile", held)
    results = {}

    def run(name, regex):
        try:
            results[name] = manager.compile(StructuredOutputsParams(regex=regex))[0]
        except SamplingParamError as e:
            results[name] = e
    threads = []
    for name, regex, compiles in (("a", "[a-c]{3}", 1), ("b", "[a-c]{3}", 1), ("slow", "x+", 2), ("waiting", "x+", 2)):
        threads.append(threading.Thread(target=run, args=(name, regex)))
        threads[-1].start()
        while len(calls) < compiles:
            threads[-1].join(0.001)
    threads[-1].join(0.05)
    manager.gave_up(StructuredOutputsParams(regex="x+"), 61.0)
    threads[-1].join(5)
    assert str(results["waiting"]).startswith("the regex did not compile in 61.0 s; the limit is 60 s"), results
    with pytest.raises(SamplingParamError, match="did not compile in 61.0 s"):
        manager.compile(StructuredOutputsParams(regex="x+"))
    assert "slow" not in results and "a" not in results and "b" not in results
    release.set()
    for t in threads:
        t.join(10)
    # the compile given up on ran on; its grammar is kept as any other
    assert calls == ["[a-c]{3}", "x+"] and results["a"] is results["b"], (calls, results)
    assert manager.compile(StructuredOutputsParams(regex="x+"))[0] is results["slow"] and len(calls) == 2


def test_a_compile_queued_for_an_aborted_request_never_runs():
    """The engine core compiles grammars one at a time on a thread of its own: a request aborted (or whose
    client left) while its compile waited behind another's was dropped, but its compile still ran,
    holding up every constrained request queued after it (a 2,500-tool schema: 9 s)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from tokenmill.engine.core_messages import AbortRequests, AddRequest, CoreUpdate
    from tokenmill.engine.core_proc import _Client
    release, compiled = threading.Event(), []

    class Engine:
        def grammar_to_compile(self, params):
            return True

        def cached_grammar(self, params):
            return None

        def compile_grammar(self, params):
            compiled.append(params.structured_outputs.regex)
            release.wait(10)
            return ("grammar",)

        def abort_request(self, request_ids):
            pass

    def constrained(regex):
        return SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
    pool = ThreadPoolExecutor(1)
    engine, update = Engine(), CoreUpdate()
    client = _Client(0, 1, conn=_pipe_end(), compiler=pool)
    for i, regex in enumerate(["a", "b", "c"]):
        client.apply(engine, AddRequest(regex, [1], constrained(regex), handle=i), update)
    client.apply(engine, AbortRequests(["b"]), update)          # queued behind "a"'s compile
    other = _Client(0, 1, conn=_pipe_end(), compiler=pool)
    other.apply(engine, AddRequest("d", [1], constrained("d"), handle=0), update)
    other.leave(engine)                                          # its client left while "d" waited
    release.set()
    pool.shutdown(wait=True)
    assert compiled == ["a", "c"] and set(client.compiling) == {"a", "c"} and not other.compiling


def test_compile_threads_and_the_threads_they_start_run_nicer_than_the_core():
    """A compile holds no GIL, but xgrammar spreads it over 8 workers of its own: at the core's priority they
    took 8/9 of the process's CPU from the loop thread (runnable, waiting for a core) and slowed every stream
    beside the compile. The compile threads run COMPILE_NICE nicer, and so do the threads they start."""
    import os
    import threading

    from tokenmill.engine.structured_output import COMPILE_NICE, compile_pool

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def compile_thread() -> tuple[int, int]:
        started = []
        worker = threading.Thread(target=lambda: started.append(nice()))    # as xgrammar starts its workers
        worker.start()
        worker.join()
        return nice(), started[0]
    pool = compile_pool()
    try:
        assert pool.submit(compile_thread).result() == (min(19, nice() + COMPILE_NICE),) * 2
    finally:
        pool.shutdown()


def test_a_grammar_that_waits_for_a_busy_compile_thread_is_a_503(qwen3_dir, monkeypatch):
    """Compiles past MAX_COMPILE_SECONDS keep their threads (a compile cannot be interrupted), so such specs,
    one a thread, left every later uncached grammar queued until one of them ended, however long. A
    request whose grammar waits that long for a thread is now a 503 `engine_busy` with Retry-After (its
    compile never runs, the rejection is counted), and the same request succeeds once a thread is free."""
    import asyncio
    import threading

    import httpx

    from tokenmill.engine import structured_output
    from tokenmill.engine.structured_output import StructuredOutputManager

    compile_grammar = StructuredOutputManager._compile
    release, compiled = threading.Event(), []

    def blocking(self, kind, spec, any_whitespace):
        compiled.append(spec)
        if spec == "(a|b)*!":
            release.wait(30)
        return compile_grammar(self, kind, spec, any_whitespace)
    monkeypatch.setattr(StructuredOutputManager, "_compile", blocking)
    monkeypatch.setattr(structured_output, "COMPILE_THREADS", 1)
    monkeypatch.setattr(structured_output, "MAX_COMPILE_SECONDS", 0.5)
    engine, app = served_in_process(qwen3_dir)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}

    async def main():
        engine.attach()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t", timeout=30) as c:
            stuck = asyncio.ensure_future(c.post("/v1/completions", json={**body, "guided_regex": "(a|b)*!"}))
            await asyncio.sleep(0.1)                     # its compile holds the one thread
            queued = await c.post("/v1/completions", json={**body, "guided_regex": "[a-z]{3}"})
            release.set()
            again = await c.post("/v1/completions", json={**body, "guided_regex": "[a-z]{3}"})
            return await stuck, queued, again
    try:
        stuck, queued, again = asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()
    assert stuck.status_code == 400 and "did not compile" in stuck.json()["error"]["message"], stuck.text
    assert queued.status_code == 503 and queued.headers["retry-after"] == "5", queued.text
    error = queued.json()["error"]
    assert error["code"] == "engine_busy" and error["type"] == "service_unavailable_error", error
    assert re.match(r"The request's grammar waited \d+\.\d s for one of the engine's 1 grammar compile threads, "
                    r"all busy .*\(the limit is 0\.5 s\); retry later\.$", error["message"]), error
    assert again.status_code == 200 and re.fullmatch("[a-z]{3}", again.json()["choices"][0]["text"]), again.text
    assert compiled == ["(a|b)*!", "[a-z]{3}"], compiled          # the queued compile never ran
    assert app.state.metrics.rejected.labels("tiny", "engine_busy")._value.get() == 1
    # counted once, as refused: not also as a request that ran and failed
    assert app.state.metrics.finished.labels("tiny", "error")._value.get() == 0


def test_the_grammar_holds_the_answer_after_the_thinking_block(llm):
    """With think tags (a server's reasoning parser sets them), the output is free inside the thinking block
    and the grammar holds from after its close: where the prompt leaves the block open, and where the
    output's first token opens one. "(" and ")" stand in for <think> and </think> (single tokens here)."""
    tok = llm.get_tokenizer()
    open_tag, close_tag = tok.encode("(")[0], tok.encode(")")[0]
    regex = r"[a-z]{5}"

    def run(in_think: bool, bias: dict, tags=(open_tag, close_tag)):
        so = StructuredOutputsParams(regex=regex, think_tags=tags, in_think=in_think)
        return llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, logit_bias=bias,
                                                       structured_outputs=so))[0].outputs[0]
    # the block is open: ")" (which the regex forbids) closes it, then the answer is the regex's
    out = run(True, {close_tag: 100})
    assert out.token_ids[0] == close_tag and ended_by_grammar(out) and re.fullmatch(regex, out.text[1:]), out.text
    # without tags the grammar holds from the first token: ")" is never sampled
    out = run(False, {close_tag: 100}, tags=None)
    assert close_tag not in out.token_ids and re.fullmatch(regex, out.text)
    # the block is not open: the first token may open one ("(" beside the regex's letters), after which the
    # output is free ("(" again and again, which the regex forbids)
    out = run(False, {open_tag: 100})
    assert out.token_ids[:3] == [open_tag] * 3 and out.finish_reason == "length"
    # or it answers at once
    out = run(False, {})
    assert ended_by_grammar(out) and re.fullmatch(regex, out.text)


def test_schemas_that_cannot_be_compiled_or_enforced_are_refused():
    """A schema text nested past the body's limit (a RecursionError past ~1,000 levels, and seconds of compile
    on the one grammar thread before that), a dict that is not JSON (the core crashed computing its cache
    key), keywords the grammar would ignore (a property named like one is fine)."""
    deep = '{"type": "array", "items": ' * 70 + '{"type": "integer"}' + "}" * 70
    for spec, message in ((deep, "nests 71 levels deep; at most 64"), ("[" * 5000 + "]" * 5000, "not valid JSON"),
                          ({"type": "array", "items": {"enum": {1, 2}}}, "not JSON"),
                          ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
                          ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, "'not'")):
        with pytest.raises(SamplingParamError, match=message) as e:
            StructuredOutputsParams(json=spec)
        assert e.value.param == "structured_outputs.json"
    StructuredOutputsParams(json={"type": "object", "properties": {"not": {"type": "string"}}, "uniqueItems": False})
    # an object of 2,000 optional properties (60 KB) compiled for minutes; 20 objects of 64 required ones, 0.1 s
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    for schema, optional in ((wide, 300), ({"type": "array", "items": {**wide, "required": ["p0", "p1"]}}, 298)):
        with pytest.raises(SamplingParamError, match=f"has {optional} optional properties \\(not in 'required'\\); "
                           "at most 256 are accepted") as e:
            StructuredOutputsParams(json=json.dumps(schema))
        assert e.value.param == "structured_outputs.json"
    StructuredOutputsParams(json={**wide, "required": [f"p{i}" for i in range(44)]})
    # 40 objects of 256 optional properties (312 KB) compiled for 41 s; 8 of them, 1 s
    objects = {f"o{j}": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(256)}}
               for j in range(9)}
    with pytest.raises(SamplingParamError, match="the JSON schema has over 2,048 optional properties \\(not in "
                                                 "'required'\\) in all; at most 2,048 are accepted"):
        StructuredOutputsParams(json={"type": "object", "properties": objects, "required": list(objects)})
    StructuredOutputsParams(json={"type": "object", "properties": dict(list(objects.items())[:8]),
                                  "required": list(objects)[:8]})
    # a regex of 40,000 optional groups (349 KB) compiled for 40 s into 3.3 GB; 2,000: 0.08 s, 11 MB
    groups = "".join(f"(x{i})?" for i in range(2001))
    chain = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "x" r{i + 1}\n' for i in range(2000)) + 'r2000 ::= "z"'
    for spec, param, what in (({"regex": groups}, "regex", "the regex has 2,001"),
                              ({"grammar": chain}, "grammar", "the grammar has 2,002"),
                              ({"json": {"type": "string", "pattern": groups[:-6] + "(x)*"}}, "json",
                               "the JSON schema's patterns have 2,001")):
        with pytest.raises(SamplingParamError, match=f"^{what} optional parts and rules \\('\\?', '\\*', '{{0,', "
                                                     "'::='\\); at most 2,000 are accepted") as e:
            StructuredOutputsParams(**spec)
        assert e.value.param == f"structured_outputs.{param}"
    StructuredOutputsParams(regex=groups[:-6])


@pytest.mark.parametrize("schema, message", [
    ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, "'allOf' with 2 schemas"),
    ({"type": "integer", "minimum": 0, "allOf": [{"maximum": 10}]}, "'type' beside 'allOf'"),
    ({"$ref": "#/$defs/p", "maximum": 3, "$defs": {"p": {"type": "integer"}}}, "'maximum' beside '\\$ref'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "'required' naming 'b', which 'properties' does not define"),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "if": {"properties": {"k": {"const": "n"}}},
      "then": {"required": ["k"]}}, "'if'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "'dependentRequired'"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' \\(only on an integer without bounds\\)"),
    ({"type": "integer", "minimum": 0, "multipleOf": 7}, "'multipleOf'"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 5}, "'minLength'/'maxLength' beside 'pattern'"),
    ({"type": "string", "pattern": "^(?!foo)[a-z]+$"}, "a lookahead in a pattern"),
    ({"$ref": "#anchor"}, "the \\$ref '#anchor'"),
    ({"$ref": "#/x", "x": {"not": {"type": "integer"}}}, "'not'"),          # reached through a $ref
    ({"minLength": 2}, "'minLength' without a 'type'"),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, "draft-04's boolean 'exclusiveMinimum'"),
    ({"type": "array", "items": [{"type": "integer"}]}, "'items' as a list"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}, "an empty 'anyOf'"),  # {"a": }
    ({"oneOf": []}, "an empty 'oneOf' \\(no value can match it\\)"),                            # an empty output
])
def test_schema_constraints_the_grammar_would_drop_are_refused(schema, message):
    """Each was accepted and compiled as if the constraint were absent (xgrammar drops it, at most with a
    warning on the server's stderr): at temperature 1.5, 14-38 of ~37 outputs broke such schemas. Data and
    annotations are not schemas: a const holding '$ref' or 'not' passes."""
    with pytest.raises(SamplingParamError, match=message):
        StructuredOutputsParams(json=schema)
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"const": {"not": 1, "$ref": "#x"}}},
                                  "required": ["a"], "examples": [{"allOf": [1, 2]}]})
    StructuredOutputsParams(json={"anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}], "default": None,
                                  "title": "P", "$defs": {"p": {"type": "integer", "multipleOf": 3}}})


def test_a_choice_with_a_control_character_before_a_hex_digit(llm):
    choices = ["a\x00b", "\x1b1m"]
    outs = llm.generate(PROMPTS[:2], constrained(choice=choices))
    assert all(o.outputs[0].text in choices for o in outs), [o.outputs[0].text for o in outs]


def test_a_length_bounded_string_holds_no_raw_tab_where_json_allows_whitespace(llm):
    # xgrammar's bounded-string class admits a raw tab, which the token mask lets through where whitespace
    # may appear; +30 on the tab token fills the string with it unless the grammar refuses it there
    tab = llm.get_tokenizer().encode("\t")[0]
    for schema in ({"type": "string", "maxLength": 8}, {"type": "string", "minLength": 1, "maxLength": 4}):
        out = llm.generate(PROMPTS[0], constrained(json=schema, logit_bias={tab: 30}))[0].outputs[0]
        assert ended_by_grammar(out) and "\t" not in out.text, out.text
        jsonschema.validate(json.loads(out.text), schema)


SLOW_REGEX, SLOW_GRAMMAR = "[a-z]{30}", "root ::= [a-z]{30}"


@pytest.fixture
def slow_fills(monkeypatch):
    """Grammars of SLOW_REGEX and SLOW_GRAMMAR whose fill spends 150 ms of CPU (over MAX_FILL_SECONDS) from the sequence's 5th token
    on, as an ambiguous grammar's fill grows with each token."""
    import time

    from tokenmill.engine.structured_output import StructuredOutputManager

    class SlowMatcher:
        def __init__(self, matcher):
            self.matcher, self.accepted = matcher, 0

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def accept_token(self, token):
            self.accepted += 1
            return self.matcher.accept_token(token)

        def fill_next_token_bitmask(self, bitmask, row):
            if self.accepted >= 5:      # CPU time, as the limit counts it (a sleep is not)
                start = time.thread_time()
                while time.thread_time() - start < 0.15:
                    pass
            return self.matcher.fill_next_token_bitmask(bitmask, row)

    sequence_grammar = StructuredOutputManager.sequence_grammar

    def slow(self, compiled, params=None):
        grammar = sequence_grammar(self, compiled, params)
        if compiled[1][1] in (SLOW_REGEX, SLOW_GRAMMAR):
            grammar.matcher = SlowMatcher(grammar.matcher)
        return grammar
    monkeypatch.setattr(StructuredOutputManager, "sequence_grammar", slow)


SLOW_MESSAGE = re.compile(r"^the (?:regex|grammar) took (\d[\d,]*\.\d) ms to compute the allowed tokens after 5 tokens; the limit is "
                          r"100 ms a token: an ambiguous grammar grows its parse with every token; make it unambiguous$")


def test_a_grammar_slower_than_the_limit_fails_its_request_alone(llm, slow_fills):
    """An ambiguous grammar (root ::= (x | x x | x x x)*, x ::= ("a" | "aa" | [a-z]*)*) made xgrammar's fill
    slower with every token (a second by token 180), on the host inside the engine step: every other
    request stalled behind it, and a long max_tokens hung the server. A sequence whose fill takes over
    MAX_FILL_SECONDS now fails its request at once, naming the time and the limit, with its blocks freed;
    a plain request and a constrained one beside it finish as they would have."""
    engine = llm.engine
    slow = constrained(max_tokens=30, regex=SLOW_REGEX)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    fine = constrained(max_tokens=30, regex="[a-z]{12}")
    expected = [llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids for p in (plain, fine)]
    tokens, errors, finished = step_until_done(engine, {"slow": slow, "plain": plain, "fine": fine})
    assert [(rid, param) for rid, _, param in errors] == [("slow", "structured_outputs.regex")], errors
    assert float(SLOW_MESSAGE.match(errors[0][1]).group(1).replace(",", "")) >= 150, errors[0][1]
    assert len(tokens["slow"]) <= 6 and "slow" not in finished
    assert [tokens["plain"], tokens["fine"]] == expected and finished == {"plain", "fine"}
    assert not engine.groups and not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_grammar_slower_than_the_limit_is_an_error_of_generate(llm, slow_fills):
    """Offline, `LLM.generate` raises the slow grammar's error and leaves no request in the engine."""
    with pytest.raises(SamplingParamError, match=SLOW_MESSAGE) as e:
        llm.generate(PROMPTS[:2], [constrained(max_tokens=30, regex=SLOW_REGEX), constrained(regex="[a-z]{12}")])
    assert e.value.param == "structured_outputs.regex"
    assert not llm.engine.groups and not llm.engine.scheduler.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert llm.generate(PROMPTS[:1], constrained(regex="[a-z]{12}"))[0].outputs[0].finish_reason == "stop"


def test_a_grammar_slower_than_the_limit_is_the_requests_http_error(qwen3_dir, slow_fills):
    """Served, the slow grammar's error is a 400 naming the request's field (guided_grammar) where nothing
    was sent yet, the stream's error event where it had begun; a plain request beside them completes. In
    the metrics the failed ones finish as "error" (they had a first token each, and no latency)."""
    import asyncio

    import httpx

    engine, app = served_in_process(qwen3_dir)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 30, "temperature": 0}

    async def main():
        engine.attach()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t", timeout=60) as c:
            async def streamed():
                async with c.stream("POST", "/v1/completions", json={**body, "guided_regex": SLOW_REGEX,
                                                                      "stream": True}) as r:
                    return r.status_code, [line async for line in r.aiter_lines() if line.startswith("data: ")]
            answers = await asyncio.gather(
                c.post("/v1/completions", json={**body, "guided_grammar": SLOW_GRAMMAR}), streamed(),
                c.post("/v1/completions", json={**body, "max_tokens": 20, "ignore_eos": True}))
        return answers, await engine.get_stats()
    try:
        (whole, (status, events), plain), stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert whole.status_code == 400, whole.text
    error = whole.json()["error"]
    assert SLOW_MESSAGE.match(error["message"]) and error["param"] == "guided_grammar", error
    assert status == 200 and events[-1] == "data: [DONE]" and len(events) >= 3, events
    error = json.loads(events[-2][len("data: "):])["error"]
    assert SLOW_MESSAGE.match(error["message"]) and error["param"] == "guided_regex", error
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 20, plain.text
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    metrics = app.state.metrics
    assert [metrics.finished.labels("tiny", r)._value.get() for r in ("stop", "length", "abort", "error")] \
        == [0, 1, 0, 2]
    assert sum(b.get() for b in metrics.e2e._buckets) == sum(b.get() for b in metrics.ttft._buckets) == 3


def test_a_grammar_that_leaves_no_token_is_the_requests_http_error(qwen3_dir):
    """Served, a grammar that allows none of allowed_token_ids fails its request as a slow grammar does: a 400
    naming the conflict where nothing was sent yet, the stream's error event where it had begun;
    allowed_token_ids that min_tokens bans (end of sequence, which only the engine knows) are a 400 when the
    request arrives. The server goes on serving."""
    import asyncio

    import httpx

    from tokenmill.engine.tokenizer import Tokenizer

    y, e = Tokenizer(qwen3_dir).encode("ye", add_special_tokens=False)
    engine, app = served_in_process(qwen3_dir)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}

    async def main():
        engine.attach()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t", timeout=60) as c:
            whole = await c.post("/v1/completions", json={**body, "guided_choice": ["yes", "no"],
                                                          "allowed_token_ids": [EOS]})
            async with c.stream("POST", "/v1/completions", json={**body, "guided_choice": ["yes"], "stream": True,
                                                                  "allowed_token_ids": [y, e]}) as r:
                streamed = r.status_code, [line async for line in r.aiter_lines() if line.startswith("data: ")]
            held_back = await c.post("/v1/completions", json={**body, "allowed_token_ids": [EOS], "min_tokens": 2})
            banned = await c.post("/v1/completions", json={**body, "allowed_token_ids": [y], "bad_words": ["yy"]})
            plain = await c.post("/v1/completions", json={**body, "ignore_eos": True})
        return whole, streamed, held_back, banned, plain
    try:
        whole, (status, events), held_back, banned, plain = asyncio.run(main())
    finally:
        engine.shutdown()
    assert whole.status_code == 400 and whole.json()["error"] | {"type": None, "code": None} == {
        "message": NO_TOKEN, "param": "allowed_token_ids", "type": None, "code": None}, whole.text
    assert status == 200 and events[-1] == "data: [DONE]", events
    assert "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-2]) in ("y", "ye"), events
    assert json.loads(events[-2][len("data: "):])["error"] | {"type": None, "code": None} == {
        "message": f"after 2 tokens the choice allows none of allowed_token_ids [{y}, {e}], which leaves no token "
                   "to generate", "param": "allowed_token_ids", "type": None, "code": None}, events
    assert held_back.status_code == 400 and held_back.json()["error"]["param"] == "min_tokens", held_back.text
    assert held_back.json()["error"]["message"] == ("allowed_token_ids [2] are all stop or end-of-sequence tokens, "
                                                    "which min_tokens=2 bans for the first 2 tokens: no token is "
                                                    "left to generate")
    # a bad word of two tokens bans the only allowed token once the output ends with its first
    assert banned.status_code == 400 and banned.json()["error"] | {"type": None, "code": None} == {
        "message": f"at output token 1 bad_words ban [{y}] of allowed_token_ids [{y}]: no token is left to generate",
        "param": "bad_words", "type": None, "code": None}, banned.text
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4, plain.text


def _pipe_end():
    """One end of a pipe, for a core client whose other end no one reads."""
    import multiprocessing as mp
    return mp.Pipe(duplex=True)[0]
