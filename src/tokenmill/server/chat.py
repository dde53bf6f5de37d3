"""POST /v1/chat/completions: chat template (tools included), then OpenAI chat-completion JSON or chunks.

A choice's text goes through the reasoning parser first (`--reasoning-parser`: the thinking becomes
`reasoning`, vLLM's current name, and `reasoning_content`, the name DeepSeek's API and older vLLM give it),
then the tool-call parser (`--tool-call-parser`, with tool_choice "auto" and `--enable-auto-tool-choice`).
With tool_choice "required" or a named function, decoding is constrained to the tools' JSON schema, and that
JSON becomes the tool calls (`tool_choice.ConstrainedCalls`): each call's name once known, then its arguments
as generated, streamed as they come and kept partial when max_tokens cuts them short, as OpenAI and vLLM
return them. With tool_choice "auto" beside a JSON response_format, the grammar admits the parser's calls or
the format's JSON (`tool_choice.calls_or_format`), and the parser reads them as it reads any output.
"""
from __future__ import annotations

import copy
import dataclasses

from fastapi import Request

from tokenmill.engine.tokenizer import template_kwargs as chat_template_kwargs
from tokenmill.server.answers import ChoiceState, _lp, encoded, now, usage
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, NamedToolChoice
from tokenmill.server.reasoning import THINK_END, budget_think_tags
from tokenmill.server.serving import Serving
from tokenmill.server.token_text import prompt_logprobs_json
from tokenmill.server.tool_choice import ConstrainedCalls, NamedCall, RequiredCalls


def logprob_entries(serving: Serving, token_ids, entries, k: int, as_ids: bool) -> list[dict]:
    """`as_ids`: each token as "token_id:{id}" (`Serving.token_text`)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = serving.token_text(tid, chosen, as_ids)
        tops = []
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]:
            s = serving.token_text(t, lp, as_ids)
            tops.append({"token": s, "logprob": _lp(lp.logprob), "bytes": list(serving.token_bytes(t, s, as_ids))})
        content.append({"token": text, "logprob": _lp(chosen.logprob) if chosen is not None else _lp(float("-inf")),
                        "bytes": list(serving.token_bytes(tid, text, as_ids)), "top_logprobs": tops})
    return content


def _reasoning_delta(text: str) -> dict:
    # under both names, as vLLM sent it while it renamed the field: clients read one or the other
    return {"reasoning": text, "reasoning_content": text}


class ChoiceText:
    """Turns one choice's text into message fields: reasoning, content and tool calls, whole (`message`)
    or as stream deltas (`feed`, then `finish`)."""

    def __init__(self, serving: Serving, req: ChatCompletionRequest, prompt_text: str):
        self.reasoning = serving.reasoning_parser() if serving.reasoning_parser is not None else None
        self.prompt_text = prompt_text        # whether the output starts inside a thinking block
        self.include_reasoning = req.include_reasoning is not False
        shows_tools = bool(req.tools) and req.tool_choice != "none"
        constrained = shows_tools and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
        auto = shows_tools and req.tool_choice in (None, "auto")
        self.tools = serving.tool_parser() if auto and serving.tool_parser is not None else None
        # `parallel_tool_calls: false` with "auto": the parser's first call only, as OpenAI and vLLM return
        # it (a "required" grammar already admits one)
        self.one_call = req.parallel_tool_calls is False
        self.tool_choice = req.tool_choice
        self._req_tools = req.tools or ()
        self._calls = self._constrained_calls() if constrained else None   # the stream's reader
        self._reasoning_stream = self.reasoning.new_stream(prompt_text) if self.reasoning is not None else None
        self._tool_stream = self.tools.new_stream() if self.tools is not None else None
        self._buffer: list[str] = []     # constrained output before its first call: content if none comes
        self.called_tools = False

    def _constrained_calls(self) -> ConstrainedCalls:
        if isinstance(self.tool_choice, NamedToolChoice):
            return NamedCall(self.tool_choice.function.name)
        return RequiredCalls(t.function.name for t in self._req_tools)

    def message(self, text: str) -> dict:
        msg: dict = {"role": "assistant", "content": text}
        calls: list[dict] = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.extract(text, prompt=self.prompt_text)
            msg["reasoning"] = msg["reasoning_content"] = reasoning if self.include_reasoning else None
            msg["content"] = text
        if self._calls is not None:
            constrained = self._constrained_calls()
            constrained.feed(text or "")
            constrained.finish()
            calls = constrained.calls
            msg["content"] = None if calls else text
        elif self.tools is not None and text:
            extracted = self.tools.extract(text)
            msg["content"] = extracted.content
            calls = [c.to_openai() for c in extracted.tool_calls][:1 if self.one_call else None]
        self.called_tools = bool(calls)
        if calls:       # else left out, as OpenAI does: clients loop while `message.tool_calls is not None`
            msg["tool_calls"] = calls
        return msg

    def feed(self, text: str) -> list[dict]:
        """Message deltas for this piece of the choice's text."""
        deltas = []
        if self._reasoning_stream is not None:
            reasoning, text = self._reasoning_stream.feed(text)
            if reasoning and self.include_reasoning:
                deltas.append(_reasoning_delta(reasoning))
        deltas += self._content(text or "")
        return [d for d in deltas if d]         # a call dropped (parallel_tool_calls false) leaves none

    def finish(self) -> list[dict]:
        deltas = []
        if self._reasoning_stream is not None:
            reasoning, text = self._reasoning_stream.finish()
            if reasoning and self.include_reasoning:
                deltas.append(_reasoning_delta(reasoning))
            deltas += self._content(text or "")
        if self._tool_stream is not None:
            deltas += [self._tool_delta(d) for d in self._tool_stream.finish()]
        if self._calls is not None:
            deltas += self._call_deltas(self._calls.finish())
            if not self._calls.calls and self._buffer:
                deltas.append({"content": "".join(self._buffer)})
        return [d for d in deltas if d]

    def _content(self, text: str) -> list[dict]:
        if not text:
            return []
        if self._calls is not None:
            if not self._calls.calls:
                self._buffer.append(text)
            return self._call_deltas(self._calls.feed(text))
        if self._tool_stream is not None:
            return [self._tool_delta(d) for d in self._tool_stream.feed(text)]
        return [{"content": text}]

    def _call_deltas(self, pieces) -> list[dict]:
        """OpenAI's deltas for constrained calls' pieces: a call's first carries its id, type and name; the
        pieces of one call in a row share a delta."""
        deltas: list[dict] = []
        for index, name, arguments in pieces:
            self.called_tools = True
            if name is not None:
                call = self._calls.calls[index]
                deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                               "function": {"name": name, "arguments": arguments}}]})
            elif deltas and deltas[-1]["tool_calls"][0]["index"] == index:
                deltas[-1]["tool_calls"][0]["function"]["arguments"] += arguments
            elif arguments:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
        return deltas

    def _tool_delta(self, d) -> dict:
        if d.tool_call is not None:
            if self.one_call and d.tool_call["index"] > 0:
                return {}
            self.called_tools = True
            return {"tool_calls": [d.tool_call]}
        return {"content": d.content} if d.content else {}


def reasoning_tokens(serving: Serving, prompt_text: str, outputs) -> int | None:
    """How many of the whole `outputs`' (CompletionOutputs') tokens are reasoning; None without a
    reasoning parser."""
    if serving.reasoning_parser is None or serving.think_tags is None:
        return None
    parser = serving.reasoning_parser()
    return sum(parser.reasoning_tokens(c.token_ids, c.text, prompt_text, serving.think_tags) for c in outputs)


async def chat_params(serving: Serving, req: ChatCompletionRequest, effort_param: str = "reasoning_effort"):
    """A chat request's sampling parameters, after the checks of its tool choice and reasoning effort against
    the server and the template. `effort_param`: what the client called `reasoning_effort` (Responses nests
    it in `reasoning`)."""
    tools = req.tools_in_use()
    if tools is not None and req.tool_choice in (None, "auto") and not serving.enable_auto_tool_choice:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                            'set on the server', "tool_choice")
    if req.reasoning_effort is not None and not serving.prompts.template_reads("reasoning_effort"):
        hint = (': it reads enable_thinking, so chat_template_kwargs {"enable_thinking": false} turns thinking '
                'off' if serving.prompts.template_reads("enable_thinking") else "")
        raise APIError(400, f"{effort_param} {req.reasoning_effort!r} cannot be honored: this model's chat "
                            f"template does not read reasoning_effort{hint}", effort_param)
    return await serving.params(req, (req.top_logprobs or 0) if req.logprobs else None,
                                think_tags=budget_think_tags(serving.think_tags, req.thinking_token_budget))


async def prepare_chat(serving: Serving, req: ChatCompletionRequest, effort_param: str = "reasoning_effort",
                       params=None):
    """The rendered prompt (its text, as much as the reasoning parser reads: `reasoning.last_turn`; and its
    ids, checked) and the sampling parameters of a chat request. `params`: those `chat_params` built for
    this request already, which only its messages set apart (Responses' truncation renders several
    conversations of one request, and a grammar's build grows with its tools), copied: the prompt's
    adjustments below replace fields of the copy, never change one in place."""
    params = await chat_params(serving, req, effort_param) if params is None else copy.copy(params)
    tools = req.tools_in_use()
    add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
    template_kwargs = chat_template_kwargs(req.chat_template_kwargs, tools, req.continue_final_message,
                                           req.documents)
    if req.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = req.reasoning_effort
    prompt_text, prompt = await serving.prompts.render_chat(
        req.chat_messages(), add_gen, bool(req.add_special_tokens), fits=params.truncate_prompt_tokens is None,
        template_kwargs=template_kwargs)
    if serving.reasoning_parser is not None:
        from tokenmill.server.reasoning import last_turn
        prompt_text = last_turn(prompt_text, serving.turn_markers)
    prompt = serving.check_prompt(serving.truncate(prompt, params), "messages")
    if tools is not None and req.tool_choice in (None, "auto") and serving.tool_parser is not None:
        # where the tokenizer marks the call tags as special tokens, skipping them would hide every call
        # from the parser (vLLM's rule: tools in use keep special tokens)
        params.skip_special_tokens = False
    if serving.think_tags_skipped:
        # the same for the thinking tags: skipped, the block's text came back as content, tags stripped
        params.skip_special_tokens = False
    # the last turn closed a block: thinking turned off, none to come
    thinking_off = THINK_END in prompt_text
    if params.structured_outputs is not None and serving.think_tags is not None and not thinking_off:
        # the constraint holds the answer, after the thinking block (the reasoning parser's reading)
        params.structured_outputs = dataclasses.replace(
            params.structured_outputs, think_tags=serving.think_tags,
            in_think=serving.reasoning_parser().starts_in_reasoning(prompt_text))
    if params.thinking_token_budget is not None:
        if params.structured_outputs is not None and thinking_off:
            # the grammar holds the output from its first token, which then opens no block for a budget to
            # count (the engine would read the budget as leaving the grammar room for one)
            params.thinking_token_budget = None
        else:
            # the budget counts the block the reasoning parser reads
            params.in_think = serving.reasoning_parser().starts_in_reasoning(prompt_text)
    serving.check_room([prompt], params, req.max_tokens_field())
    return prompt_text, prompt, params


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, raw: Request):
    serving.check_model(req.model)
    prompt_text, prompt, params = await prepare_chat(serving, req)
    k, as_ids = params.logprobs, serving.tokens_as_ids(req)
    return_ids = bool(req.return_token_ids)
    model = req.model or serving.model_names[0]
    rid, created = serving.response_id(raw, req, "chatcmpl"), now()
    echoed = req.echoed()
    include_usage, continuous = req.stream_usage()

    def finish_reason(c, text: ChoiceText) -> str | None:
        if c.finish_reason == "stop" and text.called_tools and not isinstance(req.tool_choice, NamedToolChoice):
            return "tool_calls"
        return c.finish_reason

    def final(outs):
        out = outs[0]
        choices = []
        for c in out.outputs:
            lp = None
            if k is not None and c.logprobs is not None:
                lp = {"content": encoded(logprob_entries(serving, c.token_ids, c.logprobs, k, as_ids))}
            text = ChoiceText(serving, req, prompt_text)
            message = text.message(c.text)
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": finish_reason(c, text), "stop_reason": c.stop_reason})
            if return_ids:
                choices[-1]["token_ids"] = list(c.token_ids)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": serving.fingerprint, "choices": choices,
                "usage": usage(outs, reasoning_tokens(serving, prompt_text, out.outputs))}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = encoded(prompt_logprobs_json(serving, out, req.prompt_logprobs))
        if return_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    def chunk(choices, out, counted):
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": serving.fingerprint, "choices": choices}
        if include_usage:
            # vLLM's continuous usage: the prompt and the tokens of `counted`, the chunk's own choice so far
            # (none for the role chunk, which carries no token)
            c["usage"] = usage([out], choices=counted) if continuous else None
        return c

    async def stream(merged):
        states: dict[int, ChoiceState] = {}
        texts: dict[int, ChoiceText] = {}
        last = None
        async for _, out in merged:
            if last is None:
                first = chunk([{"index": i, "delta": {"role": "assistant", "content": echoed}, "logprobs": None,
                                "finish_reason": None} for i in range(params.n)], out, [])
                if return_ids:
                    first["prompt_token_ids"] = list(out.prompt_token_ids)      # with the first chunk (vLLM's)
                yield first
            last = out
            for c in out.outputs:
                delta = states.setdefault(c.index, ChoiceState()).advance(c, k is not None)
                if delta is None:
                    continue
                piece, new_ids, new_lps = delta
                text = texts.setdefault(c.index, ChoiceText(serving, req, prompt_text))
                lp = None
                if k is not None and new_lps is not None:
                    lp = {"content": logprob_entries(serving, new_ids, new_lps, k, as_ids)}
                parts = text.feed(piece) if piece else []
                if c.finish_reason is not None:
                    parts += text.finish()
                if not parts and (lp is not None or c.finish_reason is not None or (return_ids and new_ids)):
                    parts = [{}]
                for j, part in enumerate(parts):
                    done = c.finish_reason is not None and j == len(parts) - 1
                    choice = {"index": c.index, "delta": part, "logprobs": lp if j == 0 else None,
                              "finish_reason": finish_reason(c, text) if done else None,
                              "stop_reason": c.stop_reason if done else None}
                    if return_ids:
                        # the tokens new since the last output, with its first chunk (as its logprobs)
                        choice["token_ids"] = list(new_ids) if j == 0 else []
                    yield chunk([choice], out, [c])
        if include_usage and last is not None:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "system_fingerprint": serving.fingerprint, "choices": [],
                   "usage": usage([last], reasoning_tokens(serving, prompt_text, last.outputs))}

    serving.admit()
    return await serving.run(raw, [prompt], params, req.priority or 0, bool(req.stream), stream, final,
                             carries_tools=bool(req.tools), field_of=req.field_of, request_id=rid)
