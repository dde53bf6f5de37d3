"""`hermes` (Qwen3, Nanbeige4.1, Hermes): a JSON object per call between `<tool_call>` and `</tool_call>`, read
by `ToolParser`'s tagged `extract` and `ToolCallStream`."""
from __future__ import annotations

from tokenmill.server.tool_parsers.base import CallForm, ToolCall, ToolParser, _json_call


TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    start_tag = TOOL_CALL_START
    end_tag = TOOL_CALL_END
    # as Qwen's and Hermes' templates write calls
    call_form = CallForm(TOOL_CALL_START + "\n", "\n" + TOOL_CALL_END, "\n", "arguments")

    def parse_call(self, body: str) -> ToolCall | None:
        return _json_call(body, ("arguments",))
