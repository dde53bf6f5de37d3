"""Tool-call parsers (`--tool-call-parser NAME`); the schemas that enforce `tool_choice` are in
`tool_choice.py`.

A parser turns the model's text into OpenAI `tool_calls` plus the remaining `content`. It runs on the
content left by the reasoning parser (`reasoning.py`), never on the reasoning itself.

`hermes` (Qwen3, Nanbeige4.1, Hermes) writes each call as a tagged JSON object, several in a row,
possibly after some text:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rules, the same for `extract` and for a stream fed any chunking:
- A block runs from `<tool_call>` to the next `</tool_call>`, or to the end of the output if never closed.
- A block is a call when its body is a JSON object with a non-empty string `name` and `arguments` that
  is an object (or a string holding one, or absent: `{}`), every string in it Unicode (no unpaired
  surrogate escape). `arguments` is re-serialised with
  `json.dumps(..., ensure_ascii=False)`, as OpenAI sends it. Any other block stays in the content
  verbatim, tags included; parsing never raises.
- Content is all text outside call blocks, verbatim; None when it is only whitespace.

A stream buffers each block until it closes, then sends the call as two deltas in OpenAI's shape: the
header (`index`, `id`, `type`, `function.name`, `function.arguments: ""`) and the whole arguments
string. Sending no part of a call before its JSON is known to parse is what keeps streamed and
non-streamed answers identical: a malformed block turns into content, never into half a call.

`llama3_json` (JSON objects at the start of the output or after `<|python_tag|>`, Llama 3.1-3.3),
`pythonic` (a Python list of calls starting the output, Llama 3.2 / 4), `granite` (a JSON list of calls
after `<|tool_call|>`, IBM Granite 3.x) and `phi4_mini_json` (a JSON list of calls after `functools`,
Phi-4-mini) have no end tag: each reads its format with a stream (the last three with one `ListStream`),
and its `extract` is that stream fed the whole output, under the same rules on names, arguments and content.

The package: `base.py` (the call and delta types, JSON reading, `ToolParser` and its tagged stream),
`hermes.py`, `untagged.py` (what the untagged formats' streams share), `llama3_json.py` and
`list_formats.py` (`pythonic`, `granite`, `phi4_mini_json`); `TOOL_PARSERS` here names them all.
"""
from __future__ import annotations

from tokenmill.server.tool_parsers.base import ToolParser
from tokenmill.server.tool_parsers.hermes import HermesToolParser
from tokenmill.server.tool_parsers.list_formats import GraniteToolParser, Phi4MiniJsonToolParser, PythonicToolParser
from tokenmill.server.tool_parsers.llama3_json import Llama3JsonToolParser


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                              "pythonic": PythonicToolParser, "granite": GraniteToolParser,
                                              "phi4_mini_json": Phi4MiniJsonToolParser}
