"""POST /v1/completions: legacy text completions, in OpenAI's shape (plus vLLM's prompt_logprobs).

With `echo`, each choice's text starts with its prompt's text and, with `logprobs`, its logprobs start
with the prompt's tokens (the first token's logprob null: nothing precedes it), which is how
evaluation harnesses score a continuation. `max_tokens: 0` with `echo` returns the prompt alone.
"""
from __future__ import annotations

import asyncio
import codecs
from dataclasses import replace

from fastapi import Request

from tokenmill.outputs import RequestOutput
from tokenmill.server.answers import ChoiceState, _lp, encoded, now, usage
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.reasoning import budget_think_tags
from tokenmill.server.serving import Serving
from tokenmill.server.token_text import prompt_logprobs_json


class TextOffsets:
    """Where each token starts in a completion's text, in characters, from the bytes each token adds: a
    token that holds part of a character is at that character (its text alone shows U+FFFD, one
    character, which would move the offsets past the text's end)."""

    def __init__(self):
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, data: bytes) -> int:
        at = self.chars
        self.chars += len(self.decoder.decode(data))
        return at


def _logprobs(serving: Serving, token_ids, entries, k: int, offsets: TextOffsets, as_ids: bool,
              in_text=None) -> dict:
    """OpenAI completion logprobs for these tokens, their text offsets continuing `offsets`. An entry of
    None (a prompt's first token) gives a null logprob and null top_logprobs. `as_ids`: each token as
    "token_id:{id}" (`Serving.token_text`); the offsets stay those of the text. `in_text(token id, its
    text, its bytes)`: the part of those bytes the choice's text holds (none of a special token skipped in
    decoding or added by the tokenizer to a prompt echoed as given); by default all of them."""
    tokens, token_lps, tops, starts = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) if entry is not None else None
        text = serving.token_text(tid, chosen)
        tokens.append(serving.token_text(tid, chosen, as_ids))
        token_lps.append(_lp(chosen.logprob) if chosen is not None else None)
        data = serving.token_bytes(tid, text)
        starts.append(offsets.take(data if in_text is None else in_text(tid, text, data)))
        if entry is None:
            tops.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k] if k > 0 else []
        # the sampled token always has its entry, so there may be k + 1 (OpenAI's legacy logprobs)
        if chosen is not None and all(t != tid for t, _ in ranked):
            ranked.append((tid, chosen))
        # tokens of equal text (the bytes of split characters, all U+FFFD) share a key: it holds the most
        # likely one's logprob, so that a token is greedy only where it equals the most likely
        top: dict[str, float] = {}
        for t, lp in ranked:
            if lp is not None:
                top.setdefault(serving.token_text(t, lp, as_ids), _lp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": starts}


def _join(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


async def create_completion(serving: Serving, req: CompletionRequest, raw: Request):
    serving.check_model(req.model)
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    texts = req.prompts()
    echo = bool(req.echo)
    prompt_only = req.max_tokens == 0      # echo alone: the engine computes one token, which is dropped
    if prompt_only and req.min_tokens:
        raise APIError(400, f"min_tokens must be 0 with max_tokens 0 (the prompt echoed alone), got {req.min_tokens}",
                       "min_tokens")
    params = await serving.params(req, req.logprobs, max_tokens=1 if prompt_only else None,
                                  prompt_logprobs=_prompt_k(req),
                                  think_tags=budget_think_tags(serving.think_tags, req.thinking_token_budget))
    truncates = params.truncate_prompt_tokens is not None
    prompts = [serving.check_prompt(serving.truncate(
        await serving.prompts.encode(p, add_special, fits=not truncates) if isinstance(p, str) else p, params))
        for p in texts]
    # each choice starts with its prompt's logprobs (echo, prompt_logprobs)
    serving.check_room(prompts, params, req.max_tokens_field(), prompt_in_each_choice=True)
    n, k, as_ids = params.n, req.logprobs, serving.tokens_as_ids(req)
    return_ids = bool(req.return_token_ids)
    model = req.model or serving.model_names[0]
    rid, created = serving.response_id(raw, req, "cmpl"), now()
    include_usage, continuous = req.stream_usage()

    async def echoed(i: int) -> str:
        # the prompt the model read: a truncated one decoded
        return texts[i] if isinstance(texts[i], str) and not truncates else \
            await serving.prompts.decode(prompts[i], "echo")

    echoes = [await echoed(i) for i in range(len(prompts))] if echo else None

    # a generated special token is in the text unless decoding skipped it
    skipped = serving.skipped_special_ids() if k is not None and params.skip_special_tokens else frozenset()

    def generated_in_text(tid: int, text: str, data: bytes) -> bytes:
        return b"" if tid in skipped else data

    def prompt_block(i: int, out, offsets: TextOffsets) -> dict:
        # a prompt echoed as given holds a special token only where its text spells it (not a BOS the
        # tokenizer added); a decoded one (token ids, or truncated) holds every token
        as_given = isinstance(texts[i], str) and not truncates
        specials = serving.skipped_special_ids() if as_given else frozenset()

        def in_text(tid: int, text: str, data: bytes) -> bytes:
            if tid in specials and not echoes[i].startswith(text, offsets.chars):
                return b""
            if offsets.chars == 0 and data[:1] == b" " and data[1:] == text.encode("utf-8"):
                # the word-boundary space a SentencePiece tokenizer puts before a text, which decoding
                # strips at the text's start (as decoding the token alone does)
                return data[1:]
            return data
        return _logprobs(serving, out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids),
                         k, offsets, as_ids, in_text)

    def final(outs):
        if prompt_only:
            outs = [_drop_generated(out) for out in outs]
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                lp = None
                offsets = TextOffsets()
                if echo and k is not None:
                    lp = prompt_block(i, out, offsets)
                if k is not None and c.logprobs is not None:
                    gen = _logprobs(serving, c.token_ids, c.logprobs, k, offsets, as_ids, generated_in_text)
                    lp = _join(lp, gen) if lp is not None else gen
                choice = {"index": i * n + c.index, "text": (echoes[i] if echo else "") + c.text,
                          "logprobs": encoded(lp) if lp is not None else None,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = encoded(prompt_logprobs_json(serving, out, req.prompt_logprobs))
                if return_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = list(out.prompt_token_ids), list(c.token_ids)
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": serving.fingerprint, "choices": choices, "usage": usage(outs)}

    async def stream(merged):
        states: dict[int, ChoiceState] = {}
        last = {}
        async for i, out in merged:
            if prompt_only:
                out = _drop_generated(out)
            last[i] = out
            for c in out.outputs:
                index = i * n + c.index
                st = states.get(index)
                head, lp = "", None
                if st is None:
                    st = states[index] = ChoiceState()
                    st.text_offsets = TextOffsets()
                    if echo:            # the prompt comes first, with the choice's first chunk
                        head = echoes[i]
                        if k is not None:
                            # on a thread: a 4,000-token prompt with 20 alternatives a token takes ~0.13 s
                            lp = await asyncio.to_thread(prompt_block, i, out, st.text_offsets)
                delta = st.advance(c, k is not None)
                if delta is None and not head:
                    continue
                text, new_ids, new_lps = delta if delta is not None else ("", [], None)
                if k is not None and new_lps:
                    gen = _logprobs(serving, new_ids, new_lps, k, st.text_offsets, as_ids, generated_in_text)
                    lp = _join(lp, gen) if lp is not None else gen
                choice = {"index": index, "text": head + text, "logprobs": lp,
                          "finish_reason": c.finish_reason if delta is not None else None,
                          "stop_reason": c.stop_reason if delta is not None else None}
                if return_ids:
                    # the prompt's ids with the choice's first chunk, as vLLM sends them
                    choice["prompt_token_ids"] = None if st.started else list(out.prompt_token_ids)
                    choice["token_ids"] = list(new_ids)
                    st.started = True
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "system_fingerprint": serving.fingerprint, "choices": [choice]}
                if include_usage:
                    # vLLM's continuous usage: the chunk's own choice, its prompt and its tokens so far
                    chunk["usage"] = usage([out], choices=[c]) if continuous else None
                yield chunk
        if include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "system_fingerprint": serving.fingerprint, "choices": [], "usage": usage(list(last.values()))}

    serving.admit(len(prompts))
    return await serving.run(raw, prompts, params, req.priority or 0, bool(req.stream), stream, final,
                             field_of=req.field_of, prompt_in_each_choice=True,
                             request_id=rid)


def _drop_generated(out: RequestOutput) -> RequestOutput:
    """`max_tokens: 0` with echo: the one token the engine computed is not the client's (nor in usage). A
    copy: `out` is the output processor's own, which it goes on filling while any sequence runs (the other
    choices of `n` wait for the first to compute their shared prompt)."""
    return replace(out, outputs=[replace(c, text="", token_ids=[], finish_reason="length", stop_reason=None,
                                         logprobs=[] if c.logprobs is not None else None)
                                 for c in out.outputs])


def _prompt_k(req: CompletionRequest) -> int | None:
    """How many alternatives each prompt token's logprob entry needs (None: no prompt logprobs)."""
    wanted = [x for x in (req.prompt_logprobs, req.logprobs if req.echo else None) if x is not None]
    return max(wanted) if wanted else None
