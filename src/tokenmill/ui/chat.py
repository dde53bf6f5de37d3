"""Chat helpers of the front-end that need neither Chainlit nor a server: settings, history, error text, headers
and the host names the UI answers for."""
from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

ENV_BASE_URL = "TOKENMILL_UI_BASE_URL"
ENV_API_KEY = "TOKENMILL_UI_API_KEY"
ENV_MAX_TOKENS = "TOKENMILL_UI_MAX_TOKENS"
ENV_TEMPERATURE = "TOKENMILL_UI_TEMPERATURE"
ENV_HISTORY = "TOKENMILL_UI_HISTORY_MESSAGES"
ENV_ALLOWED_HOSTS = "TOKENMILL_UI_ALLOWED_HOSTS"

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_INTERFACE = ("0.0.0.0", "::")
ANY_HOST = "*"


@dataclass(frozen=True)
class UISettings:
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key: str | None = None
    max_tokens: int = 256
    temperature: float = 0.7
    history_messages: int = 8
    allowed_hosts: tuple[str, ...] = LOCAL_HOSTS   # names a request's Host header may carry; see `host_allowed`

    @classmethod
    def from_env(cls, env=None) -> "UISettings":
        env = os.environ if env is None else env
        d = cls()
        return cls(base_url=env.get(ENV_BASE_URL) or d.base_url, api_key=env.get(ENV_API_KEY) or None,
                   max_tokens=int(env.get(ENV_MAX_TOKENS) or d.max_tokens),
                   temperature=float(env.get(ENV_TEMPERATURE) or d.temperature),
                   history_messages=int(env.get(ENV_HISTORY) or d.history_messages),
                   allowed_hosts=tuple(env[ENV_ALLOWED_HOSTS].split(",")) if env.get(ENV_ALLOWED_HOSTS)
                   else d.allowed_hosts)

    def check(self) -> None:
        """Refuses settings every message would fail with (a 400 from the server on each, or no server
        reached), naming them."""
        check_base_url(self.base_url)
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"--temperature must be between 0 and 2, got {self.temperature}")
        if self.history_messages < 0:
            raise ValueError(f"--history-messages must be 0 (all) or more, got {self.history_messages}")
        for name in self.allowed_hosts:   # the list travels to the page's process comma-separated
            if not name.strip() or "," in name:
                raise ValueError(f"--allowed-host takes one host name, got {name!r}")

    def to_env(self) -> dict[str, str]:
        env = {ENV_BASE_URL: self.base_url, ENV_MAX_TOKENS: str(self.max_tokens),
               ENV_TEMPERATURE: str(self.temperature), ENV_HISTORY: str(self.history_messages),
               ENV_ALLOWED_HOSTS: ",".join(self.allowed_hosts)}
        if self.api_key:
            env[ENV_API_KEY] = self.api_key
        return env


def check_base_url(url: str) -> None:
    """An http(s) URL with a host and, if a colon says one follows, a port: the openai client takes
    "127.0.0.1:8000/v1" (no scheme) or "http://host:/v1" (an empty port, as from an unset variable) and
    every message then fails as an unreachable server."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be an http:// or https:// URL with a host "
                         f"(e.g. http://127.0.0.1:8000/v1), got {url!r}")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"--base-url has a bad port ({e}), got {url!r}") from None
    if port is None and parts.netloc.endswith(":"):
        raise ValueError(f"--base-url has an empty port after its host, got {url!r}")


def trim_history(messages: list[dict], keep: int) -> list[dict]:
    """The last `keep` messages, starting at a user turn so the model never sees an orphaned reply."""
    out = messages[-keep:] if keep > 0 else list(messages)
    while out and out[0]["role"] != "user":
        out = out[1:]
    return out


def drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """`messages` without their oldest exchange (the first user turn and what answered it), for a prompt
    past the model's context; None where only the last user turn is left."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[starts[1]:] if len(starts) > 1 else None


def reasoning_of(delta) -> str | None:
    """A streamed chunk's thinking text: `reasoning_content`, as tokenmill sends it, or `reasoning`, the name
    other servers (vLLM's newer releases, OpenRouter) use for it."""
    return getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)


def exceeds_context(exc: BaseException) -> bool:
    """The server refused the prompt as longer than its context (OpenAI's code for it)."""
    body = getattr(exc, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else None
    return getattr(exc, "status_code", None) == 400 and isinstance(err, dict) and \
        err.get("code") == "context_length_exceeded"


def same_origin(environ: dict) -> bool:
    """Whether a page's websocket comes from this UI's own page: its Origin (which a browser always sends
    and a page cannot forge) names the host it connected to. Another site's page open in the user's browser
    would otherwise chat through the UI, its API key and all, and read the answers."""
    origin = environ.get("HTTP_ORIGIN")
    if origin is None:               # not a browser: no page of another site is behind it
        return True
    return urlsplit(origin).netloc.lower() == (environ.get("HTTP_HOST") or "").lower()


def host_name(host: str) -> str:
    """The name in a Host header, `--host` or `--allowed-host` value: lower-case, without its port, an IPv6
    address's brackets or a trailing dot ("[::1]:8001" -> "::1", "LocalHost.:80" -> "localhost")."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:       # more colons without brackets: a bare IPv6 address, no port
        host = host.partition(":")[0]
    return host.rstrip(".")


def allowed_hosts(bind_host: str, extra=()) -> tuple[str, ...]:
    """The host names the UI answers for: this machine's own, the address or name it binds unless that is
    every interface (then a LAN address or a proxy's name reaching it must be in `extra`), and `extra`."""
    names = list(LOCAL_HOSTS)
    bound = host_name(bind_host)
    if bound and bound not in ANY_INTERFACE:
        names.append(bound)
    names += [host_name(n) for n in extra]
    return tuple(dict.fromkeys(names))


def host_allowed(host_header: str | None, allowed) -> bool:
    """Whether a request or websocket naming `host_header` as its Host may reach the UI. `same_origin` and the
    CSP trust the Host header, so DNS rebinding (a site whose name later resolves to 127.0.0.1) would make
    another site's script the UI's own page, its API key and all; a browser always sends the name it
    resolved, so only names that no other site can answer for get through. Ports are not compared."""
    if ANY_HOST in allowed:
        return True
    name = host_name(host_header or "")
    return bool(name) and any(name == host_name(a) for a in allowed)


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.DOTALL | re.IGNORECASE)


def page_headers(html: str) -> dict[str, str]:
    """The headers of every response of the UI, for its page `html`. Answers are untrusted Markdown: an image
    in one (`![](https://elsewhere/?q=...)`) would be fetched as soon as it shows, carrying whatever the model
    put in its URL, so images, scripts and connections are the UI's own (the page's inline scripts are
    allowed by hash, nothing else inline); styles and fonts may come from elsewhere (Chainlit's Google font);
    no site may frame the page."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                      for s in INLINE_SCRIPT.findall(html))
    csp = (f"default-src 'self'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline' https:; "
           "font-src 'self' data: https:; img-src 'self' data: blob:; media-src 'self' blob:; "
           "connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer"}


def describe_error(exc: BaseException, base_url: str) -> str:
    """A markdown line for the chat that says what went wrong with the server, never a traceback."""
    import openai
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    detail = ""
    if isinstance(body, dict):
        err = body.get("error", body)
        detail = err.get("message", "") if isinstance(err, dict) else str(err)
    detail = detail or str(exc) or type(exc).__name__
    if status is not None:
        return f"**Server error {status}** from `{base_url}`: {detail}"
    if isinstance(exc, (openai.APIConnectionError, OSError)):
        return f"**Cannot reach the server** at `{base_url}`: {detail}"
    # an error the server sent within the stream (its engine stopped, ...)
    return f"**Server error** from `{base_url}`: {detail}"
