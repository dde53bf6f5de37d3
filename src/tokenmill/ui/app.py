"""The Chainlit app: one chat per browser session, streamed from the server's /v1/chat/completions.

Run it through `tokenmill ui --base-url http://127.0.0.1:8000/v1`; settings come from the environment
(see `chat.UISettings`). A reasoning model's thinking streams into a "Thinking" step above the answer and
stays out of the history, as chat templates drop it from earlier turns. A turn stopped by the user keeps
what it had; a tab closed or reloaded mid-answer aborts the server's request (the stream is closed).
"""
from __future__ import annotations

import asyncio

import chainlit as cl
from chainlit.server import app, get_html_template
from openai import AsyncOpenAI
from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse

from tokenmill.ui.chat import (UISettings, describe_error, drop_oldest_turn, exceeds_context, host_allowed,
                               host_name, page_headers, reasoning_of, same_origin, trim_history)

SETTINGS = UISettings.from_env()
HEADERS = page_headers(get_html_template(""))   # a root path changes the page's links, not its inline scripts
CROSS_ORIGIN = "This page was opened from another site; tokenmill ui answers its own page only."


@app.middleware("http")   # added before Chainlit starts its server, which imports this module first
async def _security_headers(request, call_next):
    response = await call_next(request)
    response.headers.update(HEADERS)
    return response


class _AllowedHostsOnly:
    """Refuses every request and websocket whose Host is not an allowed name, before Chainlit sees it (an
    ASGI middleware, as an "http" one never sees websockets; Socket.IO's polling requests are HTTP)."""

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host")
            if not host_allowed(host, SETTINGS.allowed_hosts):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})   # before accept: an HTTP 403
                    return
                name = host_name(host or "")
                text = (f"tokenmill ui does not answer for host {name!r}; if that name is this machine's, "
                        f"start it with --allowed-host {name or 'NAME'}\n")
                await PlainTextResponse(text, status_code=403, headers=HEADERS)(scope, receive, send)
                return
        await self.app(scope, receive, send)


app.add_middleware(_AllowedHostsOnly)   # the outermost layer: added last


def _client() -> AsyncOpenAI:
    return AsyncOpenAI(base_url=SETTINGS.base_url, api_key=SETTINGS.api_key or "none", max_retries=0,
                       timeout=120)


def _own_page() -> bool:
    return same_origin(getattr(cl.context.session, "environ", None) or {})


async def _model_name(client: AsyncOpenAI) -> str:
    models = await client.models.list()
    return models.data[0].id


@cl.on_chat_start
async def on_chat_start():
    cl.user_session.set("history", [])
    if not _own_page():
        await cl.Message(content=CROSS_ORIGIN, author="tokenmill").send()
        return
    try:
        async with _client() as client:
            model = await _model_name(client)
    except Exception as exc:   # an unreachable server is reported in the chat, and retried per message
        cl.user_session.set("model", None)
        await cl.Message(content=describe_error(exc, SETTINGS.base_url), author="tokenmill").send()
        return
    cl.user_session.set("model", model)
    await cl.Message(content=f"Connected to `{SETTINGS.base_url}`, model **{model}**.", author="tokenmill").send()


@cl.on_chat_end
async def on_chat_end():
    """The tab closed or reloaded: its answer in progress is aborted (Chainlit does not cancel the
    handler, so its stream is closed here, which the server sees as a disconnect)."""
    stream = cl.user_session.get("stream")
    if stream is not None:
        await stream.close()


async def _stream_reply(client: AsyncOpenAI, model: str, messages: list[dict], reply: cl.Message) -> str | None:
    """Streams the answer into `reply` (the thinking into a step of its own); returns the finish reason."""
    stream = await client.chat.completions.create(
        model=model, messages=messages, stream=True, max_tokens=SETTINGS.max_tokens,
        temperature=SETTINGS.temperature)
    cl.user_session.set("stream", stream)
    thinking: cl.Step | None = None
    finish = None
    try:
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            reasoning = reasoning_of(choice.delta)
            if reasoning:
                if thinking is None:
                    thinking = cl.Step(name="Thinking", type="llm")
                    await thinking.send()
                await thinking.stream_token(reasoning)
            if choice.delta.content:
                await reply.stream_token(choice.delta.content)
            finish = choice.finish_reason or finish
    finally:
        cl.user_session.set("stream", None)
        if thinking is not None:
            await thinking.update()
    return finish


@cl.on_message
async def on_message(message: cl.Message):
    if not _own_page():
        await cl.Message(content=CROSS_ORIGIN, author="tokenmill").send()
        return
    history: list[dict] = cl.user_session.get("history") or []
    messages = trim_history(history + [{"role": "user", "content": message.content}], SETTINGS.history_messages)
    reply = cl.Message(content="", author="tokenmill")
    async with _client() as client:
        try:
            model = cl.user_session.get("model")
            if model is None:
                model = await _model_name(client)
                cl.user_session.set("model", model)
            reply.author = model
            while True:
                try:
                    finish = await _stream_reply(client, model, messages, reply)
                    break
                except Exception as exc:
                    # a conversation grown past the context: its oldest exchanges go until it fits
                    shorter = drop_oldest_turn(messages) if exceeds_context(exc) and not reply.content else None
                    if shorter is None:
                        raise
                    messages = shorter
        except asyncio.CancelledError:      # the Stop button: the turn keeps what was answered
            cl.user_session.set("history", messages + [{"role": "assistant", "content": reply.content}])
            raise
        except Exception as exc:
            error = describe_error(exc, SETTINGS.base_url)
            reply.content = f"{reply.content}\n\n{error}" if reply.content else error
            await reply.send()
            return
    answer = reply.content
    if finish == "length":
        await reply.stream_token(f"\n\n*(cut at {SETTINGS.max_tokens} tokens)*")
    await reply.send()
    cl.user_session.set("history", messages + [{"role": "assistant", "content": answer}])
