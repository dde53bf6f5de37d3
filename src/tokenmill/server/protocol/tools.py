"""Function tools and tool_choice as chat completions take them, and the checks Responses shares with them:
only function tools, parameters that are a schema of an object, and the tools' schemas within a grammar's
size."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from tokenmill.sampling_params import MAX_SHOWN_CHARS, MAX_SPEC_CHARS, json_chars_at_least, shown
from tokenmill.server.protocol.base import UnsupportedValue, _Strict


def _json_shown(value) -> str:
    """`value` as JSON, as an error quotes it: a string cut as `shown` cuts it, a list to its first 4 items."""
    if isinstance(value, str):
        return json.dumps(value) if len(value) <= MAX_SHOWN_CHARS else \
            f"{json.dumps(value[:MAX_SHOWN_CHARS])}... ({len(value):,} characters)"
    if isinstance(value, list):
        return "[" + ", ".join(_json_shown(v) if isinstance(v, str) else shown(v) for v in value[:4]) \
            + (", ...]" if len(value) > 4 else "]")
    return shown(value)


def check_function_parameters(params: dict | None) -> dict | None:
    """A function tool's `parameters`, checked: a schema of an object (OpenAI's rule: a function's arguments
    are one JSON object; a schema naming no type takes it), its `$defs` / `definitions` objects."""
    kind = (params or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise UnsupportedValue("tools", f'a function\'s parameters must be a JSON Schema of type "object", '
                                        f"got type {_json_shown(kind)}")
    for key in ("$defs", "definitions"):
        if key in (params or {}) and not isinstance(params[key], dict):
            raise UnsupportedValue("tools", f"a function's parameters.{key} must be an object of schemas, "
                                            f"got {type(params[key]).__name__}")
    return params


def function_tools_only(tools):
    """A request's tools as given, unless one is of a type this server does not run (OpenAI's built-in tools,
    custom and MCP tools): then a 400 naming that type, rather than one listing the fields a function would need
    or calling the tool's own fields unknown. Chat completions and Responses alike."""
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise UnsupportedValue("tools", f"tool type {shown(kind)} is not supported by tokenmill (only 'function')")
    return tools


def function_choice_only(choice):
    """A tool_choice as given, unless it is an object of a type other than a function (allowed_tools, a custom or
    built-in tool): then a 400 naming that type, as `function_tools_only` does for a tool."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise UnsupportedValue("tool_choice", f"tool_choice type {shown(kind)} is not supported by tokenmill (only "
                                              "'none', 'auto', 'required' or a function by name)")
    return choice


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _check_parameters = field_validator("parameters")(check_function_parameters)


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def check_tools_chars(tools: list, named: str | None = None) -> None:
    """The parameters of the tools (FunctionDefinition's) a grammar holds, those of the function `named` else
    all, within its MAX_SPEC_CHARS as JSON before a schema is built of them: the schema holds each, so it would
    be refused once built (35,678 tools of 24 properties, 26 MB, took 4.8 s)."""
    chars = sum(json_chars_at_least(fn.parameters or {}) for fn in tools if named is None or fn.name == named)
    if chars > MAX_SPEC_CHARS:
        raise UnsupportedValue("tools", f"the tools' parameters are at least {chars:,} characters of JSON schema "
                                        f"together, over the grammar's limit of {MAX_SPEC_CHARS:,}")


def _tool_choice_value(choice):
    return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
