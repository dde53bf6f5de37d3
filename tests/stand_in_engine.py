"""The part of AsyncLLM that `build_app` and `Serving` read, for tests that script an engine's outputs in
process: a subclass gives `generate`, or `ScriptedEngine` answers with a script's text."""
from __future__ import annotations

import asyncio
import copy
import json

import httpx

from tokenmill.engine.output_processor import OutputProcessor


class StandInEngine:
    model_name, dead, on_output = "tiny", False, None

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.processor = OutputProcessor(tokenizer)

    def attach(self):
        pass


class ScriptedEngine(StandInEngine):
    """Answers each request with `script`'s tokens, one output a token, decoded as the engine's detokenizer
    decodes them under the request's skip_special_tokens, finishing with "stop". `seen` holds the last
    request's prompt (decoded with its special tokens), skip_special_tokens and sampling params."""
    script = ""

    def __init__(self, tokenizer, max_model_len: int):
        super().__init__(tokenizer, max_model_len)
        self.seen: dict = {}

    async def generate(self, request_id, ids, params, priority, **kw):
        from tokenmill.engine.detokenizer import IncrementalDetokenizer
        from tokenmill.outputs import CompletionOutput, RequestOutput
        tok = self.tokenizer
        self.seen.update(prompt=tok.decode(ids, skip_special_tokens=False), skip=params.skip_special_tokens,
                         params=params)
        script = tok.encode(self.script, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, ids, params.stop, params.skip_special_tokens)
        out = CompletionOutput(0, "", [], None, None)
        for i, token in enumerate(script):
            out.token_ids.append(token)
            detok.add(token)
            last = i == len(script) - 1
            if last:
                detok.finish()
                out.finish_reason = "stop"
            out.text = detok.output_text(last)
            yield RequestOutput(request_id, None, ids, [copy.copy(out)], last)


def post_chat(app, body: dict, stream: bool = False) -> tuple[int, dict | list[dict]]:
    """POST a chat completion to `app` in process: (status, the body, or the streamed choices' deltas)."""
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tokenmill") as c:
            body_ = {**body, "stream": stream}
            if not stream:
                r = await c.post("/v1/chat/completions", json=body_)
                return r.status_code, r.json()
            deltas = []
            async with c.stream("POST", "/v1/chat/completions", json=body_) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        deltas += [ch["delta"] for ch in json.loads(line[6:])["choices"]]
            return r.status_code, deltas
    return asyncio.run(send())
