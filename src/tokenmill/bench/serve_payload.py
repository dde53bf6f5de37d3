"""The JSON body of each `bench serve` request (OpenAI's fields, streamed with usage), and the schema and
tools of its structured and tool-carrying classes, with which requests fall in them (`structured_indices`)."""
from __future__ import annotations

import math

from tokenmill.bench.serve_datasets import ServeRequest

# an agent-style answer: mostly free text, as JSON outputs mostly are
BENCH_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "confidence": {"type": "number"},
    "sources": {"type": "array", "items": {"type": "string"}}}, "required": ["answer", "confidence", "sources"]}


# two functions an agent might offer; the model may call them or answer in text
BENCH_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the documentation for a query.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer"}}, "required": ["query"]}}},
]


def structured_indices(n: int, fraction: float) -> set[int]:
    """round(n * fraction) of range(n), evenly spread."""
    return {i for i in range(n) if math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)}


def build_payload(endpoint: str, model: str, req: ServeRequest, ignore_eos: bool, temperature: float,
                  schema: dict | None = None, tools: list[dict] | None = None) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        if tools is not None:
            body["tools"] = tools
            body["tool_choice"] = "auto"
    else:
        if tools is not None:
            raise ValueError("tools are sent on the chat endpoint only")
        body["prompt"] = req.prompt
        if schema is not None:
            body["structured_outputs"] = {"json": schema}
    return body
