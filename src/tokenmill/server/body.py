"""A request body from its bytes to the JSON the routes validate, with what is refused on the way.

Parsing and validation run on the event loop, so what a body costs before its 400 is time every other
client waits: a body is parsed (orjson, which refuses lone UTF-16 surrogates such as "\\udfff"), then refused
where it nests past `MAX_JSON_DEPTH` or holds more than `MAX_BODY_CONTAINERS` arrays and objects, or where its
arrays cannot fit what they are for (`refuse_oversized`), before pydantic walks it. docs/SERVER.md ("Limits")
and BENCHMARKS.md ("What a bad body costs to validate") say what each costs.
"""
from __future__ import annotations

import gc

import numpy as np
import orjson

from tokenmill.sampling_params import MAX_JSON_DEPTH, truncated_length
from tokenmill.server.errors import BodyError
from tokenmill.server.protocol import MAX_METADATA, MAX_PROMPTS, MAX_TEMPLATE_KWARGS, MAX_XARGS
from tokenmill.server.request_checks import prompt_too_long


# the arrays and objects a body may hold. What a request reads is bounded by the context (40,960 chat messages
# of a Qwen3's context, with their content parts and tool calls, ~120,000; a 262,144-token context's, ~790,000)
# or by the grammar's 1,000,000 characters (a schema of at most ~333,000); the rest are values a request carries
# and no one reads. Each costs the garbage collector's passes while the body is held: ~0.1 us, and ~0.9 us under
# an object whose first fields are scalars (tracked as an object of containers only once its contents were
# made, it comes last in the collector's list, so that all of them are first taken for garbage): the three
# passes over 12.4M arrays nested 62 deep after a scalar field (25 MB) took 19 s.
MAX_BODY_CONTAINERS = 1_000_000


def parse_body(raw: bytes, max_model_len: int, vocab_size: int | None):
    """The parsed body, or a 400 (`BodyError`; orjson's JSONDecodeError for JSON that is not, which FastAPI
    answers naming where)."""
    body = _loads(raw)
    refuse_oversized(body, max_model_len, vocab_size)
    return body


def _loads(raw: bytes):
    """orjson's parse with the garbage collector paused, refused where it nests past `MAX_JSON_DEPTH` or holds
    more than `MAX_BODY_CONTAINERS` arrays and objects (freed before the collector runs again, so that it never
    walks them). The collector ran as the body's containers were made, thousands of passes, the later ones over
    all of them: 10M empty arrays (30 MB) parsed in 3.3 s, 0.46 s paused. Parsed JSON holds no reference cycle,
    so pausing leaves nothing for the collector to find, and orjson holds the GIL throughout, so no other thread
    allocates meanwhile."""
    paused = gc.isenabled()
    gc.disable()
    try:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            _refuse_invalid_utf8(raw)
            raise
        depth, containers = text_shape(raw)
        if depth > MAX_JSON_DEPTH or containers > MAX_BODY_CONTAINERS:
            del body
            raise BodyError(400, f"The request body nests arrays and objects {depth} levels deep; at most "
                                 f"{MAX_JSON_DEPTH} are accepted." if depth > MAX_JSON_DEPTH else
                                 f"The request body holds {containers:,} arrays and objects; at most "
                                 f"{MAX_BODY_CONTAINERS:,} are accepted.")
        return body
    finally:
        if paused:
            gc.enable()


# the bytes `text_shape` keeps: brackets and quotes
_NOT_MARKS = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = np.zeros(256, np.int16)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def text_shape(raw: bytes) -> tuple[int, int]:
    """How deeply arrays and objects nest in a valid JSON text, as `json_depth` counts them (a scalar 0, [] and
    {} 1), and how many there are, from its bytes: escaped backslashes and quotes dropped (in pairs, left to
    right, as JSON reads them), then every byte but brackets and quotes; a bracket after an odd number of quotes
    is in a string, and the depth is the highest running count of the others, opening brackets less closing
    ones. Each step is a loop in C, ~10 ms a MB whatever the body holds, where `json_depth`'s walk of the parsed
    body took ~0.25 us an array or object (230,000 arrays nested 63 deep, 29 MB: 14 s). orjson parses 1,024
    levels at most, so the count fits 16 bits."""
    if b"\\" in raw:         # two passes over the body (~55 ms for 30 MB), where it has an escape at all
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = raw.translate(None, _NOT_MARKS)
    if not marks:
        return 0, 0
    codes = np.frombuffer(marks, np.uint8)
    steps = _STEP[codes]
    steps[(np.cumsum(codes == ord('"'), dtype=np.uint8) & 1).view(bool)] = 0     # the count's parity is its low bit
    return int(np.cumsum(steps, dtype=np.int16).max()), int(np.count_nonzero(steps == 1))


def _refuse_invalid_utf8(raw: bytes) -> None:
    """A body that is not UTF-8 is refused naming its first invalid byte and where it is: orjson says 'str is
    not valid UTF-8: surrogates not allowed' at byte 0 for any of them."""
    try:
        raw.decode()
    except UnicodeDecodeError as e:
        head = raw[:e.start]
        line, column = head.count(b"\n") + 1, e.start - head.rfind(b"\n")
        raise BodyError(400, f"The request body is not valid UTF-8: byte 0x{raw[e.start]:02x} ({e.reason}) at line "
                             f"{line}, column {column} (byte {e.start}).") from None


def refuse_oversized(body, max_model_len: int, vocab_size: int | None) -> None:
    """Refuses, right after parsing, a body whose arrays cannot fit what they are for, before it is walked
    and validated: validation runs on the event loop at ~60 ns to ~10 us an element, so a 32 MB body of 16M
    prompt ids held every other client ~2 s (and took ~450 MB), 300,000 one-word messages 4.3 s, 1.5M
    logit_bias entries 3.2 s, /detokenize of 8M ids 4.2 s, 300,000 one-character prompts (1.1 MB) 2 s. A
    prompt of ids (or a batch's) that leaves no room in the context; /detokenize's tokens, chat messages or
    Responses input items with their content parts (and a message's tool calls), a prediction's content parts,
    tools and documents (and their fields), and the values nested in chat_template_kwargs (each at least a
    token) beyond the context; a batch of more than MAX_PROMPTS prompts; more logit_bias or allowed_token_ids
    entries than the vocabulary has tokens; and metadata, chat_template_kwargs or vllm_xargs past their counts
    (1M metadata pairs, 16 MB, held the loop ~1 s; 1M tool calls of null, 6 MB, 6.8 s making an error of each)
    are refused with what they hold and the limit. A prompt of ids longer than the request's
    truncate_prompt_tokens is cut to its last tokens here, before it is validated."""
    if type(body) is not dict:
        return
    prompt = body.get("prompt")
    keep = body.get("truncate_prompt_tokens")
    keep = truncated_length(keep, max_model_len) if keep == -1 or type(keep) is int and 0 < keep <= max_model_len \
        else None
    if type(prompt) is list and prompt:
        if type(prompt[0]) is not int and len(prompt) > MAX_PROMPTS:
            raise BodyError(400, f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} are accepted.",
                            "prompt")
        for ids in (prompt if type(prompt[0]) is list else [prompt]):
            if type(ids) is not list or not ids or type(ids[0]) is not int:
                continue
            if keep is not None and len(ids) > keep:
                del ids[:-keep]         # truncate_prompt_tokens: what the engine would drop is not validated
            if len(ids) >= max_model_len:
                raise BodyError(400, prompt_too_long(max_model_len, len(ids)), "prompt", "context_length_exceeded")
    prediction = body.get("prediction")
    for field, what, items in (("tokens", "token ids", body.get("tokens")),
                               ("messages", "messages", body.get("messages")),
                               ("input", "input items", body.get("input")), ("tools", "tools", body.get("tools")),
                               ("documents", "documents", body.get("documents")),
                               ("prediction", "content parts",
                                prediction.get("content") if type(prediction) is dict else None)):
        if type(items) is not list:
            continue
        count = len(items)
        if count <= max_model_len and field in ("messages", "input"):   # and the content parts (and a message's
            count = max(count, sum(len(parts) for m in items if type(m) is dict        # tool calls) within them
                                   for parts in (m.get("content"), m.get("output"), m.get("tool_calls"))
                                   if type(parts) is list))
            if count > len(items):
                what = "messages, content parts or tool calls" if field == "messages" else \
                    "input items or content parts"
        elif count <= max_model_len and field == "documents":              # and their fields
            count = max(count, sum(len(d) for d in items if type(d) is dict))
            what = "documents or document fields" if count > len(items) else what
        if count > max_model_len:
            raise BodyError(400, f"'{field}' holds {count} {what}, more than this model's maximum context "
                                 f"length of {max_model_len} tokens.", field, "context_length_exceeded")
    for field in ("logit_bias", "allowed_token_ids"):
        ids = body.get(field)
        if vocab_size is not None and type(ids) in (dict, list) and len(ids) > vocab_size:
            raise BodyError(400, f"{field} has {len(ids)} entries; the model's vocabulary has {vocab_size} "
                                 "tokens.", field)
    for field, limit in (("metadata", MAX_METADATA), ("chat_template_kwargs", MAX_TEMPLATE_KWARGS),
                         ("vllm_xargs", MAX_XARGS)):
        entries = body.get(field)
        if type(entries) is dict and len(entries) > limit:
            raise BodyError(400, f"'{field}' has {len(entries)} entries; at most {limit} are accepted.", field)
    # the template's variables reach transformers, which walks them value by value on the tokenizer thread every
    # request shares (~0.8 us each: 10M empty arrays held it 8.4 s)
    kwargs = body.get("chat_template_kwargs")
    if type(kwargs) is dict and _values_past(kwargs, max_model_len):
        raise BodyError(400, f"'chat_template_kwargs' holds more than {max_model_len} values (the items of its "
                             f"arrays and objects, at any depth), more than this model's maximum context length "
                             f"of {max_model_len} tokens.", "chat_template_kwargs", "context_length_exceeded")


def _values_past(value: dict | list, limit: int) -> bool:
    """Whether the arrays and objects within `value` (itself included) hold more than `limit` items together;
    read level by level, and no further than `limit` items."""
    count, level = 0, [value]
    while level:
        deeper = []
        for v in level:
            items = v.values() if type(v) is dict else v
            count += len(items)
            if count > limit:
                return True
            deeper.extend(c for c in items if type(c) is dict or type(c) is list)
        level = deeper
    return False
