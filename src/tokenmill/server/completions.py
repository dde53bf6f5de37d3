"""POST /v1/completions: legacy text completions, in OpenAI's shape."""
from __future__ import annotations

import uuid

from fastapi import Request

from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving import ChoiceState, Serving, _lp, now, usage


def _logprobs(serving: Serving, token_ids, entries, k: int, offset: int) -> tuple[dict, int]:
    """OpenAI completion logprobs for these tokens; returns the block and the next text offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = serving.token_text(tid, chosen)
        tokens.append(text)
        token_lps.append(_lp(chosen.logprob) if chosen is not None else None)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k] if k > 0 else [(tid, chosen)]
        ranked = [(t, lp) for t, lp in ranked if lp is not None]
        tops.append({serving.token_text(t, lp): _lp(lp.logprob) for t, lp in ranked})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


async def create_completion(serving: Serving, req: CompletionRequest, raw: Request):
    serving.check_model(req.model)
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    prompts = [serving.check_prompt(await serving.encode(p, add_special) if isinstance(p, str) else p)
               for p in req.prompts()]
    params = serving.params(req, req.logprobs)
    serving.check_room(prompts, params)
    n, k = params.n, req.logprobs
    model = req.model or serving.model_names[0]
    rid, created = f"cmpl-{uuid.uuid4().hex}", now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def final(outs):
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                lp = None
                if k is not None and c.logprobs is not None:
                    lp, _ = _logprobs(serving, c.token_ids, c.logprobs, k, 0)
                choices.append({"index": i * n + c.index, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage(outs)}

    async def stream(merged):
        states: dict[int, ChoiceState] = {}
        last = {}
        async for i, out in merged:
            last[i] = out
            for c in out.outputs:
                st = states.setdefault(i * n + c.index, ChoiceState())
                delta = st.advance(c, k is not None)
                if delta is None:
                    continue
                text, new_ids, new_lps = delta
                lp = None
                if k is not None and new_lps is not None:
                    lp, st.text_offset = _logprobs(serving, new_ids, new_lps, k, st.text_offset)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": i * n + c.index, "text": text, "logprobs": lp,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if include_usage:
                    chunk["usage"] = usage(list(last.values())) if continuous else None
                yield chunk
        if include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage(list(last.values()))}

    serving.admit(len(prompts))
    return await serving.run(raw, prompts, params, req.priority or 0, bool(req.stream), stream, final)
