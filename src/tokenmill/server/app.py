"""The FastAPI application: OpenAI routes, tokenizer routes, health and Prometheus metrics."""
from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.server import errors
from tokenmill.server.chat import create_chat_completion, render_chat
from tokenmill.server.completions import create_completion
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from tokenmill.server.serving import Serving, json_response


def build_app(engine: AsyncLLM, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              max_queue_len: int = 1024, vocab_size: int | None = None, model_path: str | None = None) -> FastAPI:
    names = list(served_model_names or [engine.model_name])
    serving = Serving(engine, names, max_queue_len, vocab_size)
    stats: dict = {}
    metrics = ServerMetrics(names[0], lambda: stats)
    engine.on_output = metrics.observe_output
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach()
        yield

    app = FastAPI(title="tokenmill", version="0.1.0", lifespan=lifespan)
    app.state.serving = serving
    app.state.engine = engine
    app.state.metrics = metrics
    errors.install(app)

    async def check_key(request: Request):
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Missing or invalid API key.", code="invalid_api_key")

    auth = [Depends(check_key)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(serving, req, raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, req, raw)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
             "root": model_path or name, "parent": None, "max_model_len": engine.max_model_len}
            for name in names]})

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if req.messages is not None:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
            ids = render_chat(serving, msgs, req.add_generation_prompt is not False)
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        if vocab_size is not None and any(t >= vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be below the vocabulary size {vocab_size}", "tokens")
        try:
            text = serving.tokenizer.decode(req.tokens, skip_special_tokens=False)
        except (OverflowError, ValueError, TypeError) as e:
            raise APIError(400, f"cannot decode these tokens: {e}", "tokens") from None
        return json_response({"prompt": text})

    @app.get("/health")
    async def health():
        if engine.dead:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        stats.clear()
        stats.update(await engine.get_stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
