"""A Responses API response as it is answered: the response object's fields (`_Shape`), and its output items,
made by `_EventStream` from the output's text as it comes, as the streaming events that build them; a response
not streamed gets the items of one delta (`output_items`), so that both give the same items.
"""
from __future__ import annotations

from tokenmill.server.answers import now
from tokenmill.server.chat import ChoiceText, reasoning_tokens
from tokenmill.server.protocol.response_includes import wrap_reasoning
from tokenmill.server.protocol.responses import NamedFunctionChoice, ResponsesRequest, _id
from tokenmill.server.serving import Serving


def output_items(shape: _Shape, text: ChoiceText, whole: str, logprobs: list[dict], cut: bool = False) -> list[dict]:
    """A response's output items from its whole text, as the streamed response's completed event holds
    them (the text one delta), so that text around a tool call makes the same messages either way;
    `logprobs` (the output's tokens') go with the first message's text; `cut`: max_output_tokens ended
    the output, so its last item is incomplete."""
    events = _EventStream(shape)
    events.pending_logprobs = logprobs
    for part in (text.feed(whole) if whole else []) + text.finish():
        events.delta(part)
    events.close_all(cut)
    return events.items


def _encrypted(item: dict, include: list[str] | None) -> dict:
    """A reasoning item with `encrypted_content` where the request included it."""
    if include and "reasoning.encrypted_content" in include:
        item["encrypted_content"] = wrap_reasoning(item["content"][0]["text"])
    return item


class _Shape:
    """The response object's fixed fields, for the final body and for every event that carries it."""

    def __init__(self, serving: Serving, req: ResponsesRequest, model: str, stored: bool, prompt_text: str, params):
        self.id, self.created, self.req, self.model = _id("resp"), now(), req, model
        self.serving, self.stored = serving, stored
        self.prompt_text = prompt_text        # where the output starts, for its reasoning tokens' count
        self.params = params                  # the sampling parameters, the server's defaults filled in

    def body(self, status: str, output: list[dict], out=None, finish: str | None = None) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {
            "type": "text"}
        # OpenAI's spelling of the retention this server also takes as "in-memory"
        retention = r.prompt_cache_retention.replace("-", "_") if r.prompt_cache_retention else None
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "completed_at": now() if status == "completed" else None, "background": bool(r.background),
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                # the values sampled with, as OpenAI's and vLLM's responses give them (1.0 where neither the
                # request nor the model's generation config sets one)
                "temperature": self.params.temperature, "top_p": self.params.top_p, "top_logprobs": r.top_logprobs,
                "parallel_tool_calls": r.parallel_tool_calls is not False, "max_tool_calls": r.max_tool_calls,
                "tool_choice": (r.tool_choice.model_dump() if isinstance(r.tool_choice, NamedFunctionChoice)
                                else r.tool_choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
                "text": {"format": fmt}, "reasoning": r.reasoning.model_dump() if r.reasoning else None,
                "store": self.stored, "previous_response_id": r.previous_response_id, "metadata": r.metadata or {},
                "truncation": r.truncation or "disabled", "user": r.user, "service_tier": "default",
                "prompt_cache_key": r.prompt_cache_key, "prompt_cache_retention": retention,
                "safety_identifier": r.safety_identifier, "usage": None}
        if out is not None:
            prompt = len(out.prompt_token_ids)
            completion = sum(len(c.token_ids) for c in out.outputs)
            reasoning = reasoning_tokens(self.serving, self.prompt_text, out.outputs) or 0
            body["usage"] = {"input_tokens": prompt,
                             "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0},
                             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
                             "total_tokens": prompt + completion}
        return body


class _EventStream:
    """Responses' streaming events, each with its sequence number: an item is added, its deltas
    follow, and it is done before the next item opens."""

    def __init__(self, shape: _Shape):
        self.shape = shape
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None       # the item receiving deltas
        # the open item's text (a message's, a reasoning's) or a call's arguments after its first delta, as
        # pieces: joined into it once, as it closes
        self.text: list[str] = []
        self.calls: dict[int, dict] = {}    # streamed tool-call index -> its item
        self.index: dict[str, int] = {}     # item id -> its output_index
        self.pending_logprobs: list[dict] = []   # tokens' logprobs not yet sent with an output_text delta
        self.last = None                    # the latest (cumulative) output read

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.open = item
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        # a message or reasoning item opens with its content list empty, as OpenAI's do (the SDK's stream
        # helpers append the parts that follow to it)
        opened = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            opened["content"] = []
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=opened))
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if item["type"] == "message" else \
                {"type": "reasoning_text", "text": ""}
            item["content"] = [dict(part)]
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=part))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.index[item["id"]]
        if item["type"] in ("message", "reasoning"):
            item["content"][0]["text"], self.text = "".join(self.text), []
        elif item["type"] == "function_call":
            item["arguments"], self.text = item["arguments"] + "".join(self.text), []
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=part["logprobs"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=item["content"][0]))
            _encrypted(item, self.shape.req.include)
        elif item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def delta(self, part: dict) -> list[dict]:
        events = []
        if "reasoning_content" in part:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"type": "reasoning", "id": _id("rs"), "summary": []})
            self.text.append(part["reasoning_content"])
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     delta=part["reasoning_content"]))
        if part.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start({"type": "message", "id": _id("msg"), "role": "assistant"})
            self.text.append(part["content"])
            lps, self.pending_logprobs = self.pending_logprobs, []
            self.open["content"][0]["logprobs"] += lps
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=part["content"],
                                     logprobs=lps))
        for call in part.get("tool_calls") or ():
            item = self.calls.get(call["index"])
            if item is None:
                fn = call.get("function", {})
                item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                        "name": fn.get("name", ""), "arguments": ""}
                self.calls[call["index"]] = item
                events += self._start(item)
            args = call.get("function", {}).get("arguments") or ""
            if args:
                if item is self.open:
                    self.text.append(args)
                else:
                    item["arguments"] += args
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.index[item["id"]], delta=args))
        return events

    def close_all(self, cut: bool = False) -> list[dict]:
        """The last item's done events (its status "incomplete" where `cut`: max_output_tokens ended the output within
        it, as OpenAI marks it, so that an agent does not run a call cut short). Tokens after the last text
        delta (the end-of-sequence token, a trailing tool call's) go with the message's text, as in the
        response that is not streamed: in its output_text.done while it is open, and in the completed
        response's items either way."""
        message = next((item for item in reversed(self.items) if item["type"] == "message"), None)
        if message is not None and self.pending_logprobs:
            message["content"][0]["logprobs"] += self.pending_logprobs
            self.pending_logprobs = []
        return self._close("incomplete" if cut else "completed")
