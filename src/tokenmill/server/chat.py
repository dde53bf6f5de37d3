"""POST /v1/chat/completions: chat template, then OpenAI chat-completion JSON or chunks."""
from __future__ import annotations

import uuid

from fastapi import Request

from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import ChoiceState, Serving, _lp, now, usage


def _logprobs(serving: Serving, token_ids, entries, k: int) -> list[dict]:
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = serving.token_text(tid, chosen)
        tops = []
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]:
            s = serving.token_text(t, lp)
            tops.append({"token": s, "logprob": _lp(lp.logprob), "bytes": list(s.encode("utf-8"))})
        content.append({"token": text, "logprob": _lp(chosen.logprob) if chosen is not None else _lp(float("-inf")),
                        "bytes": list(text.encode("utf-8")), "top_logprobs": tops})
    return content


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, raw: Request):
    serving.check_model(req.model)
    add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
    prompt = serving.check_prompt(await serving.render_chat(req.chat_messages(), add_gen))
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.params(req, k)
    serving.check_room([prompt], params)
    model = req.model or serving.model_names[0]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def final(outs):
        out = outs[0]
        choices = []
        for c in out.outputs:
            lp = None
            if k is not None and c.logprobs is not None:
                lp = {"content": _logprobs(serving, c.token_ids, c.logprobs, k)}
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(outs)}

    def chunk(choices, out=None):
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = usage([out]) if continuous and out is not None else None
        return c

    async def stream(merged):
        states: dict[int, ChoiceState] = {}
        last = None
        async for _, out in merged:
            if last is None:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(params.n)], out)
            last = out
            for c in out.outputs:
                delta = states.setdefault(c.index, ChoiceState()).advance(c, k is not None)
                if delta is None:
                    continue
                text, new_ids, new_lps = delta
                lp = None
                if k is not None and new_lps is not None:
                    lp = {"content": _logprobs(serving, new_ids, new_lps, k)}
                yield chunk([{"index": c.index, "delta": {"content": text} if text else {}, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}], out)
        if include_usage and last is not None:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage([last])}

    serving.admit()
    return await serving.run(raw, [prompt], params, req.priority or 0, bool(req.stream), stream, final)
