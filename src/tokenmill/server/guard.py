"""What every HTTP request passes before the application reads it: the API key, then the body size.

Both checks run on the headers alone, so a client without the key, or with a body over the limit,
never makes the server read (or parse) that body. Refusals are OpenAI-shaped JSON errors.
"""
from __future__ import annotations

import secrets

from tokenmill.server.answers import dumps
from tokenmill.server.errors import error_body


def api_keys(api_key) -> tuple[str, ...]:
    """The keys that authorize a request: None (an open server), one key, or several (any of them passes).
    ValueError for an empty one: a bare 'Authorization: Bearer' would pass it."""
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    if any(not key.strip() for key in keys):
        raise ValueError("the API key is empty (--api-key or $VLLM_API_KEY): a bare 'Authorization: Bearer' would "
                         "pass; give a key, or none for an open server")
    return keys

# Paths that answer without the API key: probes and scraping (as vLLM leaves them open).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


def route_path(scope) -> str:
    """The request's path below the app's root_path (`--root-path`), which a proxy in front may have left
    on the path or taken off, as the router matches it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):] or "/"
    return path


class BodyTooLarge(Exception):
    pass


def _json_message(status: int, message: str, param: str | None, code: str | None,
                  extra_headers: list[tuple[bytes, bytes]] = ()) -> tuple[dict, dict]:
    body = dumps(error_body(status, message, param, code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


async def _refuse(send, status: int, message: str, param: str | None = None, code: str | None = None,
                  extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    start, body = _json_message(status, message, param, code, extra_headers)
    await send(start)
    await send(body)


class RequestGuard:
    """ASGI middleware: API-key check (all paths but `OPEN_PATHS` and CORS preflights: an OPTIONS request
    that names the method it asks for, which the CORS layer answers; any of `api_keys` passes, as vLLM's
    several --api-key values do), a body-size limit (`max_body_bytes`,
    413 past it, from Content-Length or counted while a chunked body arrives), and a 415 for a compressed
    body (read as JSON it was an unreadable error about UTF-8)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int):
        self.app = app
        self.api_keys = tuple(key.encode() for key in api_keys)     # empty: an open server
        self.max_body_bytes = max_body_bytes

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip()
        # every key is compared, each in constant time: the time taken tells nothing of which key, if any,
        # the token's prefix shares
        matches = [secrets.compare_digest(token, key) for key in self.api_keys]
        return scheme.lower() == b"bearer" and any(matches)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        preflight = scope["method"] == "OPTIONS" and b"access-control-request-method" in headers
        if (self.api_keys and route_path(scope) not in OPEN_PATHS and not preflight
                and not self._authorized(headers)):
            return await _refuse(send, 401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key",
                                 extra_headers=[(b"www-authenticate", b'Bearer realm="tokenmill"')])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"identity", b""):
            return await _refuse(send, 415, f"Content-Encoding {encoding.decode(errors='replace')!r} is not "
                                            "supported: send the body uncompressed (identity).",
                                 code="unsupported_content_encoding")
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _refuse(send, 400, f"Content-Length {length.decode(errors='replace')!r} is not "
                                                "a number.")
            if declared > limit:
                return await _refuse(send, 413, _too_large(declared, limit), code="request_too_large",
                                     extra_headers=[(b"connection", b"close")])
        received = 0
        over = False
        started = False

        async def counting_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message):
            # once the body went over the limit, whatever the application answers becomes the 413
            nonlocal started
            if over:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _refuse(send, 413, _too_large(received, limit), code="request_too_large",
                                  extra_headers=[(b"connection", b"close")])
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, _too_large(received, limit), code="request_too_large",
                              extra_headers=[(b"connection", b"close")])


def _too_large(size: int, limit: int) -> str:
    return (f"The request body is larger than the limit of {limit} bytes (at least {size} bytes); "
            "see --max-request-body-bytes.")
