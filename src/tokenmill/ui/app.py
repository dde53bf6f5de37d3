"""The Chainlit app: one chat per browser session, streamed from the server's /v1/chat/completions.

Run it through `tokenmill ui --base-url http://127.0.0.1:8000/v1`; settings come from the environment
(see `chat.UISettings`)."""
from __future__ import annotations

import chainlit as cl
from openai import AsyncOpenAI

from tokenmill.ui.chat import UISettings, describe_error, trim_history

SETTINGS = UISettings.from_env()


def _client() -> AsyncOpenAI:
    return AsyncOpenAI(base_url=SETTINGS.base_url, api_key=SETTINGS.api_key or "none", max_retries=0,
                       timeout=120)


async def _model_name(client: AsyncOpenAI) -> str:
    models = await client.models.list()
    return models.data[0].id


@cl.on_chat_start
async def on_chat_start():
    cl.user_session.set("history", [])
    try:
        model = await _model_name(_client())
    except Exception as exc:   # an unreachable server is reported in the chat, and retried per message
        cl.user_session.set("model", None)
        await cl.Message(content=describe_error(exc, SETTINGS.base_url), author="tokenmill").send()
        return
    cl.user_session.set("model", model)
    await cl.Message(content=f"Connected to `{SETTINGS.base_url}`, model **{model}**.", author="tokenmill").send()


@cl.on_message
async def on_message(message: cl.Message):
    client = _client()
    history: list[dict] = cl.user_session.get("history") or []
    reply = cl.Message(content="", author="tokenmill")
    try:
        model = cl.user_session.get("model")
        if model is None:
            model = await _model_name(client)
            cl.user_session.set("model", model)
        reply.author = model
        messages = trim_history(history + [{"role": "user", "content": message.content}],
                                SETTINGS.history_messages)
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True, max_tokens=SETTINGS.max_tokens,
            temperature=SETTINGS.temperature)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                await reply.stream_token(chunk.choices[0].delta.content)
    except Exception as exc:
        error = describe_error(exc, SETTINGS.base_url)
        reply.content = f"{reply.content}\n\n{error}" if reply.content else error
        await reply.send()
        return
    await reply.send()
    cl.user_session.set("history", messages + [{"role": "assistant", "content": reply.content}])
