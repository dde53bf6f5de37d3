"""`StructuredOutputsParams`: the grammar a request's output is held to, checked against
structured_output_limits.py's limits as it is made."""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.param_errors import SamplingParamError
from tokenmill.structured_output_limits import (
    check_optional_parts, check_schema, check_spec_chars, json_chars_at_least, optional_parts, structural_tag_schemas,
)


THINK_TAGS = "the token ids of <think> and </think> (two integers >= 0)"


def valid_think_tags(tags) -> bool:
    """Whether `tags` are (<think>, </think>) as a request's params take them (`THINK_TAGS`)."""
    return (isinstance(tags, (list, tuple)) and len(tags) == 2
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tags))


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
        if self.think_tags is not None:
            if not valid_think_tags(self.think_tags):
                raise SamplingParamError("structured_outputs.think_tags", f"think_tags must be {THINK_TAGS}, got "
                                         f"{self.think_tags!r}")
            self.think_tags = tuple(self.think_tags)
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
            check_schema(parsed)
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
            check_schema(self.json)
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
                check_optional_parts(f"structured_outputs.{name}", f"the {name} has", optional_parts(value))
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
            check_schema(node["json_schema"], f"structured_outputs.structural_tag.{path}")

    def _kinds(self) -> list[str]:
        # json={} is a schema (any value); json_object=False is unset
        return [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None] + \
            (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar", "structural_tag" or "json_object"."""
        return self._kinds()[0]
