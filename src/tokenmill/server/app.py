"""The FastAPI application: OpenAI routes, tokenizer routes, health and Prometheus metrics."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from fastapi.routing import APIRoute

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.engine.tokenizer import template_kwargs
from tokenmill.server import errors, tokenizer_info
from tokenmill.server.answers import json_response
from tokenmill.server.background import BackgroundResponses
from tokenmill.server.body import parse_body
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.errors import APIError, document_errors_only, documented_errors
from tokenmill.server.guard import RequestGuard, api_keys
from tokenmill.server.invocations import INVOCATION_BODY, invocation_request
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.responses import create_response, list_page, response_store, retrieve
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.server.protocol.responses import ResponsesRequest
from tokenmill.server.serving import ChatOptions, Serving


DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024

# The OpenAPI schema's responses. Every route behind the guard (all but /health, /ping, /version and
# /metrics) can answer 400 (a malformed body or Content-Length), 401, 413, 500 and 503 (draining); the
# generating routes stream Server-Sent Events where asked to.
GUARDED_ERRORS = (400, 401, 413, 500, 503)
GENERATE = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                  "description": "The result, or its Server-Sent Events with `stream: true`."},
            **documented_errors(*GUARDED_ERRORS, 404)}
LOOKUP = documented_errors(*GUARDED_ERRORS, 404)
RETRIEVE = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                  "description": "The stored response, or with `stream=true` its events (background and stream "
                                 "responses only)."},
            **LOOKUP}
GUARDED = documented_errors(*GUARDED_ERRORS)
# liveness, as vLLM's: a draining server (SIGTERM: new requests get 503) still answers 200, so that a
# liveness probe does not kill it before its requests in flight finish
HEALTH = {200: {"description": "The engine is running (also while the server drains)."},
          503: {"description": "The engine is not running."}}


class _OrjsonRequest(Request):
    """Bodies are parsed, and refused where they cannot be what they are for, by `body.parse_body`."""

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body(), self.app.state.engine.max_model_len,
                                    self.app.state.serving.vocab_size)
        return self._json


class _OrjsonRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_OrjsonRequest(request.scope, request.receive))
        return route


class RequestIdHeaders:
    """ASGI middleware: X-Request-Id on every response, the request's own where it sent one (as vLLM's
    --enable-request-id-headers), else a new one. It names the HTTP exchange for logs and proxies; the
    engine's request ids stay the server's own, since clients' ids need not be unique."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)
        await self.app(scope, receive, send_with_id)


def package_version() -> str:
    try:
        return version("tokenmill")
    except PackageNotFoundError:
        return "unknown"


def build_app(engine: AsyncLLM, *, served_model_names: list[str] | None = None,
              api_key: str | Sequence[str] | None = None,
              max_queue_len: int = 1024, vocab_size: int | None = None, model_path: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              allowed_origins: list[str] | None = None, allowed_methods: list[str] | None = None,
              allowed_headers: list[str] | None = None, allow_credentials: bool = False,
              chat: ChatOptions = ChatOptions(), metrics_dir: str | None = None,
              store_responses: bool = True, sampling_defaults: dict | None = None, docs: bool = True,
              root_path: str = "", request_id_headers: bool = False, stream_interval: int = 1,
              enable_tokenizer_info_endpoint: bool = False) -> FastAPI:
    """The API key (when given; any of several) guards every path but /health, /ping, /metrics and /version, the
    OpenAPI docs included; it is checked, like the body size, before any body is read. `metrics_dir`:
    the prometheus_client multiprocess directory that several API server processes share.
    `store_responses`: this process keeps the Responses it makes (off where several API server processes
    share the socket, as a later request may reach another). `sampling_defaults`: what requests that leave
    those fields unset sample with (`generation_config.sampling_defaults`). `docs`: serve /docs, /redoc and
    /openapi.json. `root_path`: the prefix under which a proxy serves this app (paths answer with it and
    without it). `request_id_headers`: every response carries X-Request-Id (`RequestIdHeaders`).
    `stream_interval`: a streamed request's tokens go out that many at a time (its first and last at once).
    `enable_tokenizer_info_endpoint`: serve GET /tokenizer_info (off by default, as vLLM's: it shows the chat
    template)."""
    names = list(served_model_names or [engine.model_name])
    serving = Serving(engine, names, max_queue_len, vocab_size, chat, sampling_defaults, stream_interval)
    if store_responses:
        serving.responses = ResponseStore()
        serving.background = BackgroundResponses(serving.responses)
    stats: dict = {}
    metrics = ServerMetrics(names[0], lambda: stats, multiprocess_dir=metrics_dir,
                            max_model_len=engine.max_model_len)
    engine.on_output = metrics.observe_output
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach()
        yield
        if serving.background is not None:
            await serving.background.close()

    app = FastAPI(title="tokenmill", version=package_version(), lifespan=lifespan,
                  **({} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)))
    # set on the app, not passed to FastAPI(), whose root_path argument warns that it is deprecated: the
    # app puts it in every request's scope, so routes answer with the prefix and without it
    app.root_path = root_path
    app.router.route_class = _OrjsonRoute
    app.state.serving = serving
    app.state.engine = engine
    app.state.metrics = metrics
    errors.install(app)
    default_openapi = app.openapi
    app.openapi = lambda: app.openapi_schema or document_errors_only(default_openapi())
    # the guard inside CORS, so that refusals carry CORS headers and preflights need no key
    app.add_middleware(RequestGuard, api_keys=api_keys(api_key), max_body_bytes=max_request_body_bytes)
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"],
                       allow_methods=allowed_methods or ["*"], allow_headers=allowed_headers or ["*"],
                       allow_credentials=allow_credentials)
    if request_id_headers:         # outermost: the guard's and CORS' answers carry it too
        app.add_middleware(RequestIdHeaders)

    @app.post("/v1/completions", responses=GENERATE)
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(serving, req, raw)

    @app.post("/v1/chat/completions", responses=GENERATE)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, req, raw)

    @app.post("/invocations", responses=GENERATE, openapi_extra=INVOCATION_BODY)
    async def invocations(raw: Request, body: Any = Body()):
        # the body is parsed (and checked) as the endpoints' are; its fields pick the endpoint
        req = invocation_request(body)
        if isinstance(req, ChatCompletionRequest):
            return await create_chat_completion(serving, req, raw)
        return await create_completion(serving, req, raw)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                "root": model_path or name, "parent": None, "max_model_len": engine.max_model_len}

    @app.post("/v1/responses", responses=GENERATE)
    async def responses(req: ResponsesRequest, raw: Request):
        return await create_response(serving, req, raw)

    @app.get("/v1/responses/{response_id}", responses=RETRIEVE)
    async def get_response(response_id: str, stream: bool = False, starting_after: int | None = None,
                           include: list[str] = Query([], alias="include[]"),
                           include_unbracketed: list[str] = Query([], alias="include"),
                           include_obfuscation: bool | None = None):
        """`stream`: the events of a response created with background and stream true, those after sequence
        number `starting_after` (all where it is left out) and then each new one until it ends. `include`: as
        POST's (`include[]=...`, as OpenAI's clients send it, or `include=...`), honored or refused by
        `retrieve`. `include_obfuscation`: taken, and changes nothing (this server pads no event)."""
        store = response_store(serving, "response_id")
        body = retrieve(store, response_id, include + include_unbracketed, stream)
        if not stream:
            if starting_after is not None:
                raise APIError(400, "'starting_after' is only allowed when 'stream' is true", "starting_after")
            if body is None:          # no include: the stored JSON as it is kept
                return Response(store.get_json(response_id), media_type="application/json")
            return json_response(body)
        if starting_after is not None and starting_after < 0:
            raise APIError(400, f"'starting_after' must be 0 or more, got {starting_after} (leave it out to stream "
                                "from the first event)", "starting_after")
        return serving.background.stream(response_id, -1 if starting_after is None else starting_after)

    @app.get("/v1/responses/{response_id}/input_items", responses=LOOKUP)
    async def response_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        items = response_store(serving, "response_id").input_items(response_id)
        return json_response(list_page(items, limit, order, after))

    @app.post("/v1/responses/{response_id}/cancel", responses=LOOKUP)
    async def cancel_response(response_id: str):
        """A background response still running is cancelled (its engine request aborted at once); one that has
        ended is returned as it ended, as OpenAI's cancel is idempotent. A delete while the cancel waits for the
        ending changes not its answer: the cancelled response (`BackgroundResponses.cancel`)."""
        store = response_store(serving, "response_id")
        if not store.is_background(response_id):
            raise APIError(400, f"Response '{response_id}' cannot be cancelled: only responses created with "
                           "background: true can be (close a stream to stop it)", "response_id")
        return Response(await serving.background.cancel(response_id), media_type="application/json")

    @app.delete("/v1/responses/{response_id}", responses=LOOKUP)
    async def delete_response(response_id: str):
        response_store(serving, "response_id").delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @app.api_route("/v1/models", methods=["GET", "HEAD"], responses=GUARDED)
    async def models():
        return json_response({"object": "list", "data": [model_card(name) for name in names]})

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"], responses=LOOKUP)
    async def model(model_id: str):
        serving.check_model(model_id)
        return json_response(model_card(model_id))

    @app.post("/tokenize", responses=LOOKUP)
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if req.messages is not None:
            msgs = [m.for_template() for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            kwargs = template_kwargs(req.chat_template_kwargs, tools, req.continue_final_message, req.documents)
            # counted whatever its length, as a prompt is below
            _, ids = await serving.prompts.render_chat(msgs, req.add_generation_prompt is not False,
                                                       add_special_tokens=bool(req.add_special_tokens), fits=False,
                                                       template_kwargs=kwargs)
        else:
            ids = await serving.prompts.encode(req.prompt, req.add_special_tokens is not False, fits=False)
        strs = (await asyncio.to_thread(serving.prompts.tokenizer.convert_ids_to_tokens, ids)
                if req.return_token_strs else None)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len,
                              "token_strs": strs})

    @app.post("/detokenize", responses=LOOKUP)
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        try:
            text = await serving.prompts.decode(req.tokens)
        except (OverflowError, ValueError, TypeError) as e:
            raise APIError(400, f"cannot decode these tokens: {e}", "tokens") from None
        return json_response({"prompt": text})

    # HEAD as /v1/models answers it: HTTP asks every server for HEAD where it serves GET, and checkers probe with it
    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"], responses=LOOKUP,
                   include_in_schema=enable_tokenizer_info_endpoint)
    async def get_tokenizer_info():
        if not enable_tokenizer_info_endpoint:
            raise APIError(404, "GET /tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint "
                                "(off by default, as it shows the chat template).")
        info = tokenizer_info.tokenizer_info(serving.prompts.tokenizer, serving.prompts.chat_template)
        return Response(tokenizer_info.dumps(info), media_type="application/json")

    @app.api_route("/health", methods=["GET", "HEAD"], response_class=Response, responses=HEALTH)
    async def health():
        if engine.dead:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "HEAD", "POST"], response_class=Response, responses=HEALTH)
    async def ping():
        return await health()

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def server_version():
        return json_response({"version": package_version()})

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def prometheus():
        stats.clear()
        stats.update(await engine.get_stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
