"""The limits a structured-output spec (a JSON schema, regex, grammar, choice or structural tag) is held to when
its params are made, before the engine compiles it: its length, nesting and optional parts, and the JSON schema
keywords xgrammar would compile as if absent."""
from __future__ import annotations

import orjson

from tokenmill.param_errors import SamplingParamError

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
# what each kind of spec is called in its errors
SPEC_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
             "grammar": "grammar", "structural_tag": "structural tag"}


def check_spec_chars(kind: str, chars: int, at_least: bool = False) -> None:
    """A spec of `chars` characters (`at_least`: or more) within `MAX_SPEC_CHARS`, or a SamplingParamError
    naming its length."""
    if chars > MAX_SPEC_CHARS:
        raise SamplingParamError(f"structured_outputs.{kind}", f"the {SPEC_WHAT[kind]} is {'at least ' * at_least}"
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


def optional_parts(text: str) -> int:
    """An upper bound on the optional parts and rules of a regex or an EBNF grammar (`MAX_OPTIONAL_PARTS`)."""
    return text.count("?") + text.count("*") + text.count("{0,") + text.count("::=")


def check_optional_parts(param: str, what: str, parts: int) -> None:
    if parts > MAX_OPTIONAL_PARTS:
        raise SamplingParamError(param, f"{what} {parts:,} optional parts and rules ('?', '*', '{{0,', '::='); at most "
                                 f"{MAX_OPTIONAL_PARTS:,} are accepted: the grammar's compile time and memory grow "
                                 "with the square of their chains")


def check_schema(schema, param: str = "structured_outputs.json") -> None:
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
                pattern_parts += optional_parts(pattern)
                check_optional_parts(param, "the JSON schema's patterns have", pattern_parts)
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
