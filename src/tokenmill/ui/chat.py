"""Chat helpers of the front-end that need neither Chainlit nor a server: settings, history, error text."""
from __future__ import annotations

import os
from dataclasses import dataclass

ENV_BASE_URL = "TOKENMILL_UI_BASE_URL"
ENV_API_KEY = "TOKENMILL_UI_API_KEY"
ENV_MAX_TOKENS = "TOKENMILL_UI_MAX_TOKENS"
ENV_TEMPERATURE = "TOKENMILL_UI_TEMPERATURE"
ENV_HISTORY = "TOKENMILL_UI_HISTORY_MESSAGES"


@dataclass(frozen=True)
class UISettings:
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key: str | None = None
    max_tokens: int = 256
    temperature: float = 0.7
    history_messages: int = 8

    @classmethod
    def from_env(cls, env=None) -> "UISettings":
        env = os.environ if env is None else env
        d = cls()
        return cls(base_url=env.get(ENV_BASE_URL) or d.base_url, api_key=env.get(ENV_API_KEY) or None,
                   max_tokens=int(env.get(ENV_MAX_TOKENS) or d.max_tokens),
                   temperature=float(env.get(ENV_TEMPERATURE) or d.temperature),
                   history_messages=int(env.get(ENV_HISTORY) or d.history_messages))

    def to_env(self) -> dict[str, str]:
        env = {ENV_BASE_URL: self.base_url, ENV_MAX_TOKENS: str(self.max_tokens),
               ENV_TEMPERATURE: str(self.temperature), ENV_HISTORY: str(self.history_messages)}
        if self.api_key:
            env[ENV_API_KEY] = self.api_key
        return env


def trim_history(messages: list[dict], keep: int) -> list[dict]:
    """The last `keep` messages, starting at a user turn so the model never sees an orphaned reply."""
    out = messages[-keep:] if keep > 0 else list(messages)
    while out and out[0]["role"] != "user":
        out = out[1:]
    return out


def describe_error(exc: BaseException, base_url: str) -> str:
    """A markdown line for the chat that says what went wrong with the server, never a traceback."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    detail = ""
    if isinstance(body, dict):
        err = body.get("error", body)
        detail = err.get("message", "") if isinstance(err, dict) else str(err)
    detail = detail or str(exc) or type(exc).__name__
    if status is not None:
        return f"**Server error {status}** from `{base_url}`: {detail}"
    return f"**Cannot reach the server** at `{base_url}`: {detail}"
