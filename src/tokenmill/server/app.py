"""The FastAPI application: OpenAI routes, tokenizer routes, health and Prometheus metrics."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson
from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from fastapi.routing import APIRoute

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.engine.tokenizer import template_kwargs
from tokenmill.sampling_params import MAX_JSON_DEPTH, json_depth, truncated_length
from tokenmill.server import errors, tokenizer_info
from tokenmill.server.background import BackgroundResponses
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.errors import APIError, BodyError, document_errors_only, documented_errors
from tokenmill.server.guard import RequestGuard, api_keys
from tokenmill.server.invocations import INVOCATION_BODY, invocation_request
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.responses import ResponsesRequest, create_response, list_page, response_store, retrieve
from tokenmill.server.protocol import (
    MAX_METADATA, MAX_PROMPTS, MAX_TEMPLATE_KWARGS, MAX_XARGS, ChatCompletionRequest, CompletionRequest,
    DetokenizeRequest, TokenizeRequest,
)
from tokenmill.server.serving import ChatOptions, Serving, json_response, prompt_too_long


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




def refuse_oversized(body, max_model_len: int, vocab_size: int | None) -> None:
    """Refuses, right after parsing, a body whose arrays cannot fit what they are for, before it is walked
    and validated: validation runs on the event loop at ~60 ns to ~10 us an element, so a 32 MB body of 16M
    prompt ids held every other client ~2 s (and took ~450 MB), 300,000 one-word messages 4.3 s, 1.5M
    logit_bias entries 3.2 s, /detokenize of 8M ids 4.2 s, 300,000 one-character prompts (1.1 MB) 2 s. A
    prompt of ids (or a batch's) that leaves no room in the context; /detokenize's tokens, chat messages or
    Responses input items with their content parts (and a message's tool calls), tools and documents (and their
    fields) (each at least a token) beyond the context; a batch of more than MAX_PROMPTS prompts; more logit_bias
    or allowed_token_ids entries than the vocabulary has tokens; and metadata, chat_template_kwargs or vllm_xargs
    past their counts (1M metadata pairs, 16 MB, held the loop ~1 s; 1M tool calls of null, 6 MB, 6.8 s making an
    error of each) are refused with what they hold and the limit. A prompt of ids longer than the request's
    truncate_prompt_tokens is cut to its last tokens here, before it is validated."""
    if type(body) is not dict:
        return
    prompt = body.get("prompt")
    keep = body.get("truncate_prompt_tokens")
    keep = truncated_length(keep, max_model_len) if keep == -1 or type(keep) is int and 0 < keep <= max_model_len \
        else None
    if type(prompt) is list and prompt:
        for ids in (prompt if type(prompt[0]) is list else [prompt]):
            if type(ids) is not list or not ids or type(ids[0]) is not int:
                continue
            if keep is not None and len(ids) > keep:
                del ids[:-keep]         # truncate_prompt_tokens: what the engine would drop is not validated
            if len(ids) >= max_model_len:
                raise BodyError(400, prompt_too_long(max_model_len, len(ids)), "prompt", "context_length_exceeded")
        if type(prompt[0]) is not int and len(prompt) > MAX_PROMPTS:
            raise BodyError(400, f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} are accepted.",
                            "prompt")
    for field, what in (("tokens", "token ids"), ("messages", "messages"), ("input", "input items"),
                        ("tools", "tools"), ("documents", "documents")):
        items = body.get(field)
        if type(items) is list:
            count = len(items)
            if field in ("messages", "input"):       # and the content parts (and a message's tool calls) within them
                count = max(count, sum(len(parts) for m in items if type(m) is dict
                                       for parts in (m.get("content"), m.get("output"), m.get("tool_calls"))
                                       if type(parts) is list))
                if count > len(items):
                    what = "messages, content parts or tool calls" if field == "messages" else \
                        "input items or content parts"
            elif field == "documents":              # and their fields
                count = max(count, sum(len(d) for d in items if type(d) is dict))
                what = "documents or document fields" if count > len(items) else what
            if count > max_model_len:
                raise BodyError(400, f"'{field}' holds {count} {what}, more than this model's maximum context "
                                     f"length of {max_model_len} tokens.", field, "context_length_exceeded")
    for field in ("logit_bias", "allowed_token_ids"):
        ids = body.get(field)
        if vocab_size is not None and type(ids) in (dict, list) and len(ids) > vocab_size:
            raise BodyError(400, f"{field} has {len(ids)} entries; the model's vocabulary has {vocab_size} "
                                 "tokens.", field)
    for field, limit in (("metadata", MAX_METADATA), ("chat_template_kwargs", MAX_TEMPLATE_KWARGS),
                         ("vllm_xargs", MAX_XARGS)):
        entries = body.get(field)
        if type(entries) is dict and len(entries) > limit:
            raise BodyError(400, f"'{field}' has {len(entries)} entries; at most {limit} are accepted.", field)


def _refuse_invalid_utf8(raw: bytes) -> None:
    """A body that is not UTF-8 is refused naming its first invalid byte and where it is: orjson says 'str is
    not valid UTF-8: surrogates not allowed' at byte 0 for any of them."""
    try:
        raw.decode()
    except UnicodeDecodeError as e:
        head = raw[:e.start]
        line, column = head.count(b"\n") + 1, e.start - head.rfind(b"\n")
        raise BodyError(400, f"The request body is not valid UTF-8: byte 0x{raw[e.start]:02x} ({e.reason}) at line "
                             f"{line}, column {column} (byte {e.start}).") from None


class _OrjsonRequest(Request):
    """Bodies are parsed by orjson, which (unlike the standard library) refuses lone UTF-16 surrogates
    such as "\\udfff": no string that cannot be encoded as UTF-8 reaches the handlers; and nest at most
    `MAX_JSON_DEPTH` levels."""

    async def json(self):
        if not hasattr(self, "_json"):
            raw = await self.body()
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                _refuse_invalid_utf8(raw)
                raise
            refuse_oversized(body, self.app.state.engine.max_model_len, self.app.state.serving.vocab_size)
            depth = json_depth(body)
            if depth > MAX_JSON_DEPTH:
                raise HTTPException(400, f"The request body nests arrays and objects {depth} levels deep; "
                                         f"at most {MAX_JSON_DEPTH} are accepted.")
            self._json = body
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
            _, ids = await serving.prompts.render_chat(msgs, req.add_generation_prompt is not False,
                                                       add_special_tokens=bool(req.add_special_tokens), **kwargs)
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
