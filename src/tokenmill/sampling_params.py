"""Per-request sampling parameters, validated on construction (vLLM's names and meanings).

What needs the engine (token ids against the vocabulary, grammars compiled for the tokenizer) is checked
in `LLMEngine.add_request`, with the same error type."""
from __future__ import annotations

import copy
import enum
import json
import reprlib
from dataclasses import dataclass, field

import orjson

LOGIT_BIAS_LIMIT = 100.0
# a positive temperature below this samples at this (vLLM's rule); 0 is greedy
MIN_TEMPERATURE = 1e-2

# the deepest nesting of arrays and objects a request body or a JSON schema may have (the body itself is
# level 1): a JSON schema of about 30 nested objects. orjson parses up to 1,024 levels, but a request's
# parameters travel to the engine core pickled, and the pickler's recursion gives out at a few hundred.
MAX_JSON_DEPTH = 64
# the most properties one object of a JSON schema may leave optional: xgrammar chains them, each optional
# before the next, and its compile grows with the square of the chain (SmolLM2's vocabulary, CPU machine:
# 256 optional properties 0.4 s, 800 5 s, 2,000 (60 KB of schema) over a minute, every one of the
# engine core's compile threads held as long); OpenAI's strict schemas make every property required. The
# whole schema may leave at most MAX_SCHEMA_OPTIONAL_PROPERTIES optional: 8 objects of 256 compile in 1 s,
# 32 of 64 0.7 s, but 40 of 256 (312 KB) took 41 s, and the compile grows with the square of the schema
MAX_OPTIONAL_PROPERTIES = 256
MAX_SCHEMA_OPTIONAL_PROPERTIES = 2048
# the most optional parts ('?', '*', '{0,') and rules ('::=') a regex or a grammar may have, or a JSON schema's
# patterns together: each lets the parser skip ahead, and xgrammar's compile time and memory grow with the
# square of such a chain (SmolLM2's vocabulary, CPU machine: a regex of 800 optional groups 0.06 s and 2.3 MB
# compiled, of 20,000 7.4 s and 835 MB, of 40,000 (349 KB) 40 s and 3.3 GB, 6.5 GB at its peak; an EBNF
# grammar of 1,600 rules, each optional before the next, 2.3 s, of 6,400 over 40 s and 2.2 GB)
MAX_OPTIONAL_PARTS = 2000
# A spec's text (a JSON schema as JSON, a regex, a grammar, the choices together) is at most this long:
# xgrammar's compile grows faster than the text (SmolLM2's vocabulary, one CPU thread: a schema of 162,401
# characters 0.7 s and 21 MB compiled, of 1,628,901 characters 34 s and 216 MB), and COMPILE_THREADS
# threads serve every constrained request. A tool list that fits a 40,960-token context is ~160,000 characters.
# Checked as the params are made, before a schema is walked (a 990,000-property schema, 31 MB, took ~2 s to
# check first), and by the engine's compile (`StructuredOutputManager`), for a structural tag too.
MAX_SPEC_CHARS = 1_000_000
_SPEC_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def check_spec_chars(kind: str, chars: int, at_least: bool = False) -> None:
    """A spec of `chars` characters (`at_least`: or more) within `MAX_SPEC_CHARS`, or a SamplingParamError
    naming its length."""
    if chars > MAX_SPEC_CHARS:
        raise SamplingParamError(f"structured_outputs.{kind}", f"the {_SPEC_WHAT[kind]} is {'at least ' * at_least}"
                                 f"{chars:,} characters long, over the limit of {MAX_SPEC_CHARS:,}")


def json_chars_at_least(value) -> int:
    """A lower bound of `len(json.dumps(value))`, the length the grammar's limit measures, at C speed: orjson's
    compact UTF-8 (json.dumps adds a space after each separator and escapes each character past ASCII as 6 or
    12); 0 for what orjson cannot write (an integer past 64 bits)."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return 0


def json_depth(value) -> int:
    """How deeply arrays and objects nest in a value as orjson parses it (a scalar 0, [] and {} 1), level by
    level rather than by recursion; a container of scalars (a prompt's token ids) is scanned by type alone."""
    depth, level = 0, [value] if type(value) in (dict, list) else []
    while level:
        depth += 1
        deeper = []
        for v in level:
            items = v.values() if type(v) is dict else v
            kinds = set(map(type, items))
            if dict in kinds or list in kinds:
                deeper.extend(c for c in items if type(c) in (dict, list))
        level = deeper
    return depth

# JSON schema keywords xgrammar compiles as if absent (the output would not honour them): refused
_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef")
# where a schema holds a map of names to schemas (any other object in a schema is walked as a schema)
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
# a schema's keys whose values are data or annotations, never schemas (no $ref in them resolves)
SCHEMA_DATA_KEYS = ("const", "enum", "default", "examples", "discriminator", "required", "type")
# keywords that constrain a value, which xgrammar drops beside anyOf / oneOf / allOf / $ref
_CONSTRAINTS = ("type", "properties", "required", "additionalProperties", "items", "prefixItems", "minimum",
                "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
                "pattern", "format", "minItems", "maxItems", "minProperties", "maxProperties", "enum", "const",
                "patternProperties", "propertyNames")
_STRING_ONLY = ("minLength", "maxLength", "pattern", "format")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_NUMBER_ONLY = (*_BOUNDS, "multipleOf")


def _unenforced(node: dict) -> str | None:
    """What in one schema node xgrammar would compile as if absent (its own check, not its subschemas'):
    the message's subject, or None."""
    used = [k for k in _UNENFORCED if k in node and (k != "uniqueItems" or node[k])]
    if used:
        return repr(used[0])
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(bound), bool):
            return f"draft-04's boolean {bound!r} (give the bound itself as {bound})"
    if isinstance(node.get("items"), list):
        return "'items' as a list (draft-07's tuples; give them as 'prefixItems')"
    for key in ("anyOf", "oneOf"):
        if node.get(key) == []:        # xgrammar writes an empty output for it, a value missing from the JSON
            return f"an empty {key!r} (no value can match it)"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return f"'allOf' with {len(node['allOf'])} schemas"
    combined = [k for k in ("anyOf", "oneOf", "allOf", "$ref") if k in node]
    beside = [k for k in _CONSTRAINTS if k in node]
    if combined and beside:
        return f"{beside[0]!r} beside {combined[0]!r}"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"the $ref {ref!r} (only '#' and '#/...' references resolve)"
    required = node.get("required")
    if isinstance(required, list):
        missing = [name for name in required if name not in (node.get("properties") or {})]
        if missing:
            return f"'required' naming {missing[0]!r}, which 'properties' does not define"
    kind = node.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if "multipleOf" in node and (kinds != {"integer"} or any(k in node for k in _BOUNDS)):
        return "'multipleOf' (only on an integer without bounds)"
    if any(k in node for k in ("minLength", "maxLength")) and any(k in node for k in ("pattern", "format")):
        return "'minLength'/'maxLength' beside 'pattern' or 'format'"
    if kind is None and "enum" not in node and "const" not in node:
        untyped = [k for k in (*_STRING_ONLY, *_NUMBER_ONLY) if k in node]
        if untyped:
            return f"{untyped[0]!r} without a 'type'"
    patterns = [node.get("pattern"), *(node.get("patternProperties") or {}),
                (node.get("propertyNames") or {}).get("pattern") if isinstance(node.get("propertyNames"), dict) else None]
    if any(isinstance(p, str) and ("(?=" in p or "(?!" in p) for p in patterns):
        return "a lookahead in a pattern"
    return None


def _optional_parts(text: str) -> int:
    """An upper bound on the optional parts and rules of a regex or an EBNF grammar (`MAX_OPTIONAL_PARTS`)."""
    return text.count("?") + text.count("*") + text.count("{0,") + text.count("::=")


def _check_optional_parts(param: str, what: str, parts: int) -> None:
    if parts > MAX_OPTIONAL_PARTS:
        raise SamplingParamError(param, f"{what} {parts:,} optional parts and rules ('?', '*', '{{0,', '::='); at most "
                                 f"{MAX_OPTIONAL_PARTS:,} are accepted: the grammar's compile time and memory grow "
                                 "with the square of their chains")


def _check_schema(schema, param: str = "structured_outputs.json") -> None:
    """Refuses a schema nested past `MAX_JSON_DEPTH` (it travels pickled to the engine core, and xgrammar's
    compile time grows with the cube of the depth), with an object of more than `MAX_OPTIONAL_PROPERTIES`
    optional properties or more than `MAX_SCHEMA_OPTIONAL_PROPERTIES` in all, patterns of more than
    `MAX_OPTIONAL_PARTS` optional parts together, or using what xgrammar would compile as if absent
    (`_unenforced`), anywhere a `$ref` could point: every object in it but data and annotations."""
    depth = json_depth(schema)
    if depth > MAX_JSON_DEPTH:
        raise SamplingParamError(param, f"the JSON schema nests {depth} levels deep; at most {MAX_JSON_DEPTH} are "
                                        "accepted")
    todo, all_optional, pattern_parts = [schema], 0, 0
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        pattern_map = node.get("patternProperties")
        for pattern in (node.get("pattern"), *(pattern_map if isinstance(pattern_map, dict) else ())):
            if isinstance(pattern, str):
                pattern_parts += _optional_parts(pattern)
                _check_optional_parts(param, "the JSON schema's patterns have", pattern_parts)
        what = _unenforced(node)
        if what is not None:
            raise SamplingParamError(param, f"the JSON schema uses {what}, which structured output cannot enforce")
        properties, required = node.get("properties"), node.get("required")
        if isinstance(properties, dict):
            optional = len(properties.keys() - {r for r in required if isinstance(r, str)}) \
                if isinstance(required, list) else len(properties)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise SamplingParamError(param, f"an object of the JSON schema has {optional:,} "
                                         f"optional properties (not in 'required'); at most {MAX_OPTIONAL_PROPERTIES} "
                                         "are accepted: the grammar's compile time grows with their square")
            all_optional += optional
            if all_optional > MAX_SCHEMA_OPTIONAL_PROPERTIES:
                raise SamplingParamError(param, f"the JSON schema has over {MAX_SCHEMA_OPTIONAL_PROPERTIES:,} optional "
                                         f"properties (not in 'required') in all; at most "
                                         f"{MAX_SCHEMA_OPTIONAL_PROPERTIES:,} are accepted: the grammar's compile time "
                                         "grows with their square")
        for key, value in node.items():
            if key in SCHEMA_DATA_KEYS:
                continue
            if key in SUBSCHEMA_MAPS and isinstance(value, dict):
                todo.extend(value.values())
            elif key == "propertyNames" and isinstance(value, dict) and any(k in value for k in _STRING_ONLY):
                todo.append({"type": "string", **value})     # a name is a string: xgrammar reads it as typed
            elif isinstance(value, list):
                todo.extend(value)
            else:
                todo.append(value)


# The formats of a structural tag (xgrammar's names) the engine compiles, and the fields that hold their parts.
# Each JSON schema in a tag is checked as `json`'s is and compiled as `json`'s (compact JSON where
# `disable_any_whitespace`); free text, regexes and grammars are not taken: their limits are `regex`'s and
# `grammar`'s, which a tag would step around.
STRUCTURAL_TAG_FORMATS = {"const_string": (), "json_schema": (), "sequence": ("elements",), "or": ("elements",),
                          "tag": ("content",), "tags_with_separator": ("tags",)}


def structural_tag_schemas(tag) -> list[tuple[str, dict]]:
    """(path, format) of each `json_schema` format of a structural tag (parsed), the path dotted from the tag's
    root ("format.elements.0.content"), in the tag's order; SamplingParamError for a tag of other formats."""
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise SamplingParamError("structured_outputs.structural_tag", 'a structural tag is an object {"type": '
                                 '"structural_tag", "format": {...}}')
    out, todo = [], [("format", tag["format"])]
    while todo:
        path, node = todo.pop()
        kind = node.get("type") if isinstance(node, dict) else None
        if kind not in STRUCTURAL_TAG_FORMATS:
            raise SamplingParamError(f"structured_outputs.structural_tag.{path}", f"structural tag format "
                                     f"{kind!r} at {path} is not supported (only "
                                     f"{', '.join(STRUCTURAL_TAG_FORMATS)})")
        if kind == "json_schema":
            schema = node.get("json_schema")
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamError(f"structured_outputs.structural_tag.{path}", f"the json_schema at {path} "
                                         "must be a JSON schema object")
            out.append((path, node))
        for name in STRUCTURAL_TAG_FORMATS[kind]:
            parts = node.get(name)
            if isinstance(parts, list):
                todo += [(f"{path}.{name}.{i}", part) for i, part in enumerate(parts)]
            else:
                todo.append((f"{path}.{name}", parts))
    return out[::-1]


# the characters of a client's value an error message quotes at most: it names the value, and a 30 MB name
# or list is not sent back (nor built) whole
MAX_SHOWN_CHARS = 40
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = MAX_SHOWN_CHARS
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = 4


def shown(value) -> str:
    """`value` as an error message quotes it: a string cut to `MAX_SHOWN_CHARS` (with its length where cut),
    a container to its first few items, each cut the same way."""
    if isinstance(value, str):
        return repr(value) if len(value) <= MAX_SHOWN_CHARS else \
            f"{value[:MAX_SHOWN_CHARS]!r}... ({len(value):,} characters)"
    return _SHORT_REPR.repr(value)


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):       # it crosses to the frontend process
        return type(self), (self.param, str(self))


@dataclass
class StructuredOutputsParams:
    """Constrains the output to a grammar (vLLM's `StructuredOutputsParams`); exactly one of `json` (a
    JSON schema, as a dict or its text), `regex`, `choice` (the output is one of the strings), `grammar`
    (EBNF / GBNF), `structural_tag` (xgrammar's, as JSON text, of `STRUCTURAL_TAG_FORMATS`) and `json_object`
    (any JSON object) is set. JSON output allows any whitespace between tokens unless
    `disable_any_whitespace` (then none). `whitespace_pattern` is refused: xgrammar has no
    such option.

    `think_tags` ((<think>, </think>) ids), set by a server with a reasoning parser: the grammar holds
    the answer after the thinking block, as vLLM's does, not the reasoning. Where the prompt leaves a
    block open (`in_think`) the output is free until its first `</think>`; otherwise its first token may
    be `<think>` besides what the grammar allows, and opens a block the same way. A prompt whose last
    turn has closed its block (thinking turned off) sets none."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    think_tags: tuple[int, int] | None = None
    in_think: bool = False

    def __post_init__(self):
        kinds = self._kinds()
        if len(kinds) != 1:
            raise SamplingParamError("structured_outputs", "exactly one of json, regex, choice, grammar, "
                                     f"structural_tag and json_object must be set, got {kinds or 'none'}")
        if self.whitespace_pattern is not None:
            raise SamplingParamError("structured_outputs.whitespace_pattern",
                                     "whitespace_pattern is not supported; set disable_any_whitespace to allow "
                                     "no whitespace in JSON output")
        if isinstance(self.json, str):
            check_spec_chars("json", len(self.json))
            try:
                parsed = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise SamplingParamError("structured_outputs.json", f"the JSON schema is not valid JSON: {e}") \
                    from None
            if not isinstance(parsed, (dict, bool)):
                raise SamplingParamError("structured_outputs.json", "the JSON schema must be a JSON object")
            _check_schema(parsed)
        elif self.json is not None and not isinstance(self.json, dict):
            raise SamplingParamError("structured_outputs.json",
                                     f"the JSON schema must be a dict or its JSON text, got {type(self.json).__name__}")
        elif self.json is not None:
            check_spec_chars("json", json_chars_at_least(self.json), at_least=True)     # before json.dumps (1 s a 30 MB)
            try:
                text = json.dumps(self.json)          # as the engine's compile measures it
            except (TypeError, ValueError, RecursionError) as e:    # a set, an object, a cycle: not JSON
                raise SamplingParamError("structured_outputs.json", f"the JSON schema is not JSON: {e}") from None
            check_spec_chars("json", len(text))
            _check_schema(self.json)
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamError("structured_outputs.choice", "choice must be a non-empty list of non-empty "
                                     "strings")
        if self.choice is not None:
            check_spec_chars("choice", sum(len(c) + 1 for c in self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SamplingParamError(f"structured_outputs.{name}", f"{name} must be a string")
            if value is not None:
                check_spec_chars(name, len(value))
                _check_optional_parts(f"structured_outputs.{name}", f"the {name} has", _optional_parts(value))
        if self.structural_tag is not None:
            self._check_structural_tag()

    def _check_structural_tag(self):
        if not isinstance(self.structural_tag, str):
            raise SamplingParamError("structured_outputs.structural_tag", "structural_tag must be its JSON text, "
                                     f"got {type(self.structural_tag).__name__}")
        try:
            tag = json.loads(self.structural_tag)
        except (ValueError, RecursionError) as e:
            raise SamplingParamError("structured_outputs.structural_tag", f"the structural tag is not valid JSON: "
                                     f"{e}") from None
        for path, node in structural_tag_schemas(tag):
            _check_schema(node["json_schema"], f"structured_outputs.structural_tag.{path}")

    def _kinds(self) -> list[str]:
        # json={} is a schema (any value); json_object=False is unset
        return [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None] + \
            (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar", "structural_tag" or "json_object"."""
        return self._kinds()[0]


def truncated_length(truncate_prompt_tokens: int, max_model_len: int) -> int:
    """The prompt tokens `truncate_prompt_tokens` keeps (k >= 1, or -1): k, or with -1 the longest prompt the
    engine admits, `max_model_len - 1` (it leaves room for the one token every request generates)."""
    return max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens


class RequestOutputKind(enum.Enum):
    """vLLM's: what each output of a streamed request holds. `LLM.generate` returns every request's final
    output whatever its params say (vLLM's LLM sets FINAL_ONLY), so `output_kind` changes nothing here."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to the model's context length
    # tokens generated before an end-of-sequence or stop token id may be sampled, or a stop string end
    # the output (vLLM's)
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None         # number of top alternatives per token (0: the sampled one only)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit before any sampling step, in [-100, 100]; ids are checked against the
    # model's vocabulary when the request is added
    logit_bias: dict[int, float] | None = None
    # vLLM's: the only token ids the request may sample (checked against the vocabulary as logit_bias' are);
    # its logprobs stay those of the model's whole distribution, as logit_bias leaves them
    allowed_token_ids: list[int] | None = None
    # vLLM's: the prompt's last k tokens only (left truncation), -1 for as many as the context admits
    truncate_prompt_tokens: int | None = None
    # vLLM's: words the output may not contain, each as its tokens at the text's start and after a space
    # (`bad_words_token_ids`, which the frontend fills from the tokenizer: `resolve_bad_words`)
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: a secret mixed into the hash of the prompt's first block (so into every block's, through the
    # chain): requests of different salts share no prefix-cache block, so one tenant cannot learn from its
    # time to first token whether another's prompt began as its own did (a cache-timing side channel). A
    # secret: no repr or log line shows it.
    cache_salt: str | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)
    # vLLM's fields taken where they change nothing here (other values are refused, naming the field):
    # best_of None or n, detokenize True, no logits_processors. spaces_between_special_tokens either way: the
    # output is decoded as the fast tokenizer joins special tokens, which takes no such option (neither does
    # vLLM's detokenizer of a fast tokenizer). extra_args is data for plugins, as vLLM's, which no in-tree
    # sampler reads. output_kind any `RequestOutputKind` (see there).
    best_of: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    extra_args: dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:          # vLLM's "no seed"
            self.seed = None
        if self.logit_bias:
            self.logit_bias = self._parse_logit_bias(self.logit_bias)
        else:
            self.logit_bias = None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise SamplingParamError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        self._check()
        if 0 < self.temperature < MIN_TEMPERATURE:
            # vLLM's floor: logits scaled by a smaller one can overflow to inf
            self.temperature = MIN_TEMPERATURE

    @staticmethod
    def _parse_logit_bias(bias) -> dict[int, float]:
        """Keys as ints (JSON sends them as strings), values as floats in [-100, 100]."""
        if not isinstance(bias, dict):
            raise SamplingParamError("logit_bias", "logit_bias must be a map of token ids to numbers")
        parsed = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise SamplingParamError("logit_bias", f"logit_bias key {shown(key)} is not a token id") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise SamplingParamError("logit_bias", f"logit_bias value for token {token} must be in "
                                         f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {shown(value)}")
            if token < 0:
                raise SamplingParamError("logit_bias", f"logit_bias token id {token} must be >= 0")
            parsed[token] = float(value)
        return parsed

    def _check(self):
        def bad(name, value, limit):
            raise SamplingParamError(name, f"{name} must be {limit}, got {shown(value)}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if not self.temperature >= 0:        # NaN too: the sampler would take its NaN scores' argmax, token 0
            bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer: 0 or -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured_outputs is not None:
            # the grammar decides where the output ends: held-back end tokens would leave it no token
            bad("min_tokens", self.min_tokens, "0 with structured outputs (the grammar decides the length)")
        # counts of alternatives: a float one fails only inside a step (topk, slicing), which kills the engine core
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                bad(name, value, "an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "an integer")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", self.bad_words, "a list of words (non-empty strings)")
        # the sampler bans each word's last token after the rest: a word of no tokens has no last token
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, (list, tuple))
                or any(not isinstance(w, (list, tuple)) or not w
                       or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in w)
                       for w in self.bad_words_token_ids)):
            bad("bad_words_token_ids", self.bad_words_token_ids,
                "a list of words, each a non-empty list of token ids (integers >= 0)")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1):
            bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "an integer >= 1, or -1 (the context length)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "non-empty strings (a string or a list of them)")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", self.best_of, f"None or n ({self.n}): tokenmill returns every sequence it samples")
        if not self.detokenize:
            bad("detokenize", self.detokenize, "True: tokenmill always detokenizes the output")
        if self.logits_processors:
            bad("logits_processors", self.logits_processors, "None or empty: per-request logits processors are not "
                "run (logit_bias, allowed_token_ids, bad_words and structured_outputs are)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt", self.cache_salt, "a non-empty string")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad("extra_args", self.extra_args, "a dict")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", self.output_kind, "a RequestOutputKind")

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's: parameters where None stands for the default (as a request's unset fields), except
        `max_tokens`, where None is the model's context length."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), to change without changing this one."""
        return copy.deepcopy(self)

    def resolve_bad_words(self, tokenizer) -> SamplingParams:
        """These params with `bad_words_token_ids` filled from `bad_words` (vLLM's rule): each word's tokens
        at the text's start, and after a space where that gives the word a token of its own (the same number
        of tokens, a different first one). A copy where ids are filled: ids kept in the caller's params
        would outlive a change of its words, or go to a model with another tokenizer."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        if tokenizer is None:
            raise SamplingParamError("bad_words", "bad_words needs the model's tokenizer, and this model has none")
        words = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                words.append(spaced)
        resolved = copy.copy(self)
        resolved.bad_words_token_ids = [w for w in words if w]
        return resolved

    def truncate(self, prompt: list[int], max_model_len: int) -> list[int]:
        """The prompt as `truncate_prompt_tokens` leaves it: its last k tokens; with -1 its last
        `max_model_len - 1`, the longest prompt the engine admits (it leaves room for the one token every
        request generates), so that a prompt longer than the context runs instead of being refused."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        if k > max_model_len:
            raise SamplingParamError("truncate_prompt_tokens", f"truncate_prompt_tokens {k} is greater than the "
                                     f"maximum context length ({max_model_len} tokens)")
        keep = truncated_length(k, max_model_len)
        return prompt[max(0, len(prompt) - keep):]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
