"""`tool_choice` "required" or a named function, enforced by a grammar: the JSON schema a constrained
request's output is decoded under, and the readers that turn that JSON into OpenAI tool calls, whole or
streamed. And tool_choice "auto" beside a JSON response format: a structural tag that admits either the
tool-call parser's calls or the format's JSON (`calls_or_format`), read by that parser as usual."""
from __future__ import annotations

import copy
import json
import re

from tokenmill.sampling_params import SCHEMA_DATA_KEYS, SUBSCHEMA_MAPS, shown
from tokenmill.server.tool_parsers.base import CallForm, ToolCall


def _functions(tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, parameters schema) of each tool of a request, checked."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] is not a function tool")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        # a function's arguments are a JSON object: absent or empty parameters ({} alone would admit any
        # JSON value), a schema that names no type, or a list of types (one with "object", as the request's
        # check has it), take the object type
        if not params:
            params = {"type": "object", "properties": {}}
        elif not isinstance(params.get("type"), str):
            params = {**params, "type": "object"}
        out.append((name, params))
    return out


def _named(tool_choice) -> str | None:
    """The function a named tool_choice picks; None for "required"; ValueError for anything else."""
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError('tool_choice must be "required" or {"type": "function", "function": {"name": ...}} '
                     f"to be enforced by a schema, got {shown(tool_choice)}")


_DEFS_SECTIONS = ("$defs", "definitions")


def _moved_name(prefix: str, section: str, name: str) -> str:
    """The root `$defs` name of a tool's schema `name` of `section`: each section has a prefix of its own,
    neither a prefix of the other, so that a name in both stays two schemas."""
    return f"{prefix}{section.lstrip('$')}_{name}"


def _rehome_refs(node, prefix: str):
    """A copy of `node` with local `$ref`s into `$defs`/`definitions` renamed to their `_moved_name`."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key in SUBSCHEMA_MAPS and isinstance(value, dict):
                # names of schemas (a property called "type" or "enum"), never data
                out[key] = {name: _rehome_refs(sub, prefix) for name, sub in value.items()}
                continue
            if key in SCHEMA_DATA_KEYS:
                out[key] = copy.deepcopy(value)
                continue
            if key == "$ref" and isinstance(value, str):
                for section in _DEFS_SECTIONS:
                    root = f"#/{section}/"
                    if value.startswith(root):
                        value = "#/$defs/" + _moved_name(prefix, section, value[len(root):])
                        break
                else:
                    if value.startswith("#"):
                        raise ValueError(f"tool parameters: unsupported $ref {shown(value)} "
                                         "(only #/$defs/... and #/definitions/...)")
            out[key] = _rehome_refs(value, prefix)
        return out
    if isinstance(node, list):
        return [_rehome_refs(v, prefix) for v in node]
    return node


def required_tools_schema(tools: list[dict], tool_choice, *, parallel_tool_calls: bool = True) -> dict:
    """The JSON schema a grammar enforces for `tool_choice`.

    "required": an array of at least one (exactly one without `parallel_tool_calls`) object
    `{"name": <a tool's name>, "arguments": <an object of that tool's parameters>}`, anyOf over tools.
    A named function: an object of that function's parameters. Each tool's `$defs` are moved to the root,
    prefixed by the tool's position, so its `$ref`s still resolve. ValueError (a 400) for an unknown
    function, no tools, or any other tool_choice."""
    functions = _functions(tools)
    if not functions:
        raise ValueError("tool_choice requires at least one tool")
    name = _named(tool_choice)
    if name is not None:
        for fn_name, params in functions:
            if fn_name == name:
                return copy.deepcopy(params)
        raise ValueError(f"tool_choice names function {shown(name)}, which is not in tools")
    variants, defs = _call_variants(functions, "arguments")
    schema = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call_variants(functions: list[tuple[str, dict]], arguments_key: str) -> tuple[list[dict], dict]:
    """One schema per function of a call object `{"name": <its name>, <arguments_key>: <its parameters>}`, and the
    root `$defs` they share: each function's `$defs` moved there, prefixed by its position, so that its `$ref`s
    still resolve."""
    defs, variants = {}, []
    for i, (fn_name, params) in enumerate(functions):
        params = _rehome_refs(params, f"tool{i}_")
        for section in _DEFS_SECTIONS:
            for def_name, sub in (params.pop(section, None) or {}).items():
                defs[_moved_name(f"tool{i}_", section, def_name)] = sub
        variants.append({"type": "object",
                         "properties": {"name": {"const": fn_name}, arguments_key: params},
                         "required": ["name", arguments_key]})
    return variants, defs


# where the tag of `calls_or_format` holds the calls (its other element is the format): a schema error at a
# path under it is a tool's
CALLS_PATH = "format.elements.0"


def calls_or_format(tools: list[dict], form: CallForm, format_schema: dict, *, parallel_tool_calls: bool = True
                    ) -> dict:
    """The structural tag of tool_choice "auto" beside a JSON response format: the output is either one or more
    calls written as `form` has them (exactly one without `parallel_tool_calls`), each call's object under the
    schema of its tool's, or the format's JSON (`format_schema`). ValueError (a 400) for no tools."""
    functions = _functions(tools)
    if not functions:
        raise ValueError("tool_choice requires at least one tool")
    variants, defs = _call_variants(functions, form.arguments_key)
    call = {"anyOf": variants, **({"$defs": defs} if defs else {})}
    calls = {"type": "tags_with_separator", "separator": form.separator, "at_least_one": True,
             "stop_after_first": not parallel_tool_calls,
             "tags": [{"type": "tag", "begin": form.begin, "content": {"type": "json_schema", "json_schema": call},
                       "end": form.end}]}
    if form.opening or form.closing:
        calls = {"type": "sequence", "elements": [{"type": "const_string", "value": form.opening}, calls,
                                                  {"type": "const_string", "value": form.closing}]}
    return {"type": "structural_tag", "format": {"type": "or", "elements": [
        calls, {"type": "json_schema", "json_schema": format_schema}]}}


class ConstrainedCalls:
    """The tool calls of output decoded under `required_tools_schema`, read as it is generated. `feed`
    returns (call index, name or None, arguments text) pieces: a call's name once it is known, then its
    arguments' text as it comes, as generated (so that the pieces of a stream add up to the whole
    answer's `arguments`); `calls` holds each call in `message.tool_calls`'s shape, its `arguments` whole
    once `finish` has run (until then its pieces are kept apart: a long call costs its length, not its
    length per piece). Output cut short by max_tokens leaves its last call's arguments partial, as OpenAI
    and vLLM return them."""

    def __init__(self):
        self.calls: list[dict] = []
        self._arguments: list[list[str]] = []     # each call's arguments, as pieces

    def _start(self, name: str) -> tuple[int, str, str]:
        self.calls.append(ToolCall(name, "").to_openai())
        self._arguments.append([])
        return len(self.calls) - 1, name, ""

    def _extend(self, piece: str) -> tuple[int, None, str]:
        self._arguments[-1].append(piece)
        return len(self.calls) - 1, None, piece

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        raise NotImplementedError

    def finish(self) -> list[tuple[int, str | None, str]]:
        pieces = self._finish()
        for call, arguments in zip(self.calls, self._arguments):
            call["function"]["arguments"] = "".join(arguments)
        return pieces

    def _finish(self) -> list[tuple[int, str | None, str]]:
        """The pieces that only the output's end decides."""
        return []


class NamedCall(ConstrainedCalls):
    """A named function: the whole output is its one call's arguments (a call even if the output is empty)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        if not text:
            return []
        pieces = [] if self.calls else [self._start(self.name)]
        return pieces + [self._extend(text)]

    def _finish(self) -> list[tuple[int, str | None, str]]:
        return [] if self.calls else [self._start(self.name)]


# tool_choice "required": the grammar writes each item's keys in the schema's order with json.dumps's
# separators, so a call's name and the start of its arguments are this text
_REQUIRED_CALL_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
_NAME_KEY = '{"name": '


class RequiredCalls(ConstrainedCalls):
    """tool_choice "required": a JSON array of {"name": ..., "arguments": {...}} objects. Each piece of text
    is scanned once: between calls the text since the last call's arguments is searched for the next
    call's head, from its last possible start; inside arguments, brackets are counted outside strings
    until the object closes. A head counts only where it names one of `names`, the request's tools: text
    outside the grammar (a thinking block's end spelled out in smaller tokens than its tag's, after which
    the reasoning parser hands on what the grammar has not yet held) may hold anything."""

    def __init__(self, names):
        super().__init__()
        self.names = frozenset(names)
        # the longest a head can be: its name escaped (a surrogate pair's two \uXXXX for a character at most)
        self._max_head = len(_NAME_KEY) + 2 + 12 * max(map(len, self.names), default=0) + len(', "arguments": ')
        self._head = ""              # text since the last call's arguments closed, from where a head may begin
        self._head_from = 0          # where in it the next call's head can begin
        self._in_arguments = False
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        pieces = []
        while text:
            if not self._in_arguments:
                self._head += text
                found = self._next_head()
                if found is None:
                    return pieces
                end, name = found
                pieces.append(self._start(name))
                text, self._head, self._head_from = self._head[end:], "", 0
                self._in_arguments, self._depth = True, 0
                continue
            end = self._arguments_end(text)
            if end:
                pieces.append(self._extend(text[:end]))
            text = text[end:]
        return pieces

    def _next_head(self) -> tuple[int, str] | None:
        """The end and name of the next whole head naming a tool in `_head`; None while there is none, with
        `_head` cut to where one may still begin (so that it stays short)."""
        while True:
            m = _REQUIRED_CALL_HEAD.search(self._head, self._head_from)
            if m is None:
                break
            name = _json_string(m.group(1))
            if name in self.names:
                return m.end(), name
            self._head_from = m.start() + 1
        start = self._head.rfind(_NAME_KEY, self._head_from)
        if start >= 0 and len(self._head) - start > self._max_head:
            start = -1               # too long ago to open a head naming a tool
        keep = start if start >= 0 else max(self._head_from, len(self._head) - len(_NAME_KEY) + 1)
        self._head, self._head_from = self._head[keep:], 0
        return None

    def _arguments_end(self, text: str) -> int:
        """How much of `text` belongs to the open arguments (all of it unless they close in it)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._in_arguments = False
                    return i + 1
        return len(text)


def _json_string(literal: str) -> str | None:
    """A JSON string literal's text; None where it is no JSON or holds an unpaired surrogate (no text)."""
    try:
        text = json.loads(literal)
        text.encode()
    except (ValueError, UnicodeEncodeError):
        return None
    return text
