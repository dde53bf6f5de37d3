"""The argparse types of `tokenmill`'s options: ints with vLLM's k/K suffixes, counts of at least one,
ports, seconds, JSON objects and CORS entries; each refusal names the value and the limit."""
from __future__ import annotations

import argparse
import json
import math
import re
from decimal import Decimal


_SUFFIXES = "kmgt"


def human_int(text: str) -> int:
    """An int, or one with vLLM's suffixes: k, m, g, t powers of 1,000 (25.6k = 25,600), K, M, G, T powers
    of 1,024 (32K = 32,768, a whole number before them)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"invalid int value: {text!r} (an integer, or one with a suffix: 32k, 32K)") from None
    number, suffix = match.groups()
    power = _SUFFIXES.index(suffix.lower()) + 1
    if suffix.isupper():
        if "." in number:
            raise ValueError(f"invalid int value: {text!r} (a binary suffix, {suffix}, takes a whole number)")
        return int(number) * 1024 ** power
    value = Decimal(number) * 1000 ** power
    if value != int(value):
        raise ValueError(f"invalid int value: {text!r} is not a whole number")
    return int(value)


def plain_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"invalid int value: {text!r}") from None


def int_value(text: str) -> int:
    """An argparse type: an int, the refusal naming the value."""
    try:
        return plain_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def at_least_one(what: str, parse_int=plain_int):
    """An argparse type: an int of at least 1 (read by `parse_int`, whose ValueError says what is wrong),
    the refusal naming `what` one of them is."""
    def parse(text: str) -> int:
        try:
            value = parse_int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1 ({what}), got {value}")
        return value
    return parse


api_server_count = at_least_one("one API server process")
data_parallel_size = at_least_one("one engine core")
queue_len = at_least_one("a request that may wait")
context_len = at_least_one("a token of context", human_int)
step_tokens = at_least_one("a token a step", human_int)        # vLLM reads this one with suffixes too
stream_interval = at_least_one("a token a chunk")


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: a free port), got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def uvicorn_log_level(text: str) -> str:
    """vLLM's --uvicorn-log-level values onto --log-level's: trace is debug, critical is error."""
    return {"trace": "debug", "critical": "error"}.get(text, text)


def json_object(text: str) -> dict:
    """--hf-overrides: one JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object (such as '{{\"rope_scaling\": {{...}}}}'), got "
                                         f"a JSON {type(value).__name__}: {text!r}")
    return value


def cors_entry(text: str) -> str | list[str]:
    """One CORS origin, method or header, or vLLM's JSON list of them (flattened by `http_options`)."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return text
