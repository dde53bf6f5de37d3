"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tokenmill.engine.metrics import REJECT_REASONS
from tokenmill.sampling_params import MAX_SHOWN_CHARS
from tokenmill.server.protocol import MAX_UNKNOWN_NAMED, UnsupportedValue, json_kind

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          503: "service_unavailable_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body, as the OpenAPI schema documents it."""
    error: ErrorDetail


_DESCRIPTIONS = {400: "The request is invalid; `param` names the field where there is one.",
                 401: "The server has an API key and the request did not send it.",
                 404: "No such model (or stored response).",
                 413: "The body is larger than --max-request-body-bytes.",
                 500: "An internal error.",
                 503: "The server is overloaded (a full queue), draining, or its engine is not running; "
                      "Retry-After says when to try again where it can."}


def documented_errors(*statuses: int) -> dict:
    """`responses` for a route's decorator: these statuses, each with the error body."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


def document_errors_only(schema: dict) -> dict:
    """The OpenAPI schema without FastAPI's 422 responses and their validation-error schemas: this server
    answers a body that fails validation with a 400 in the error shape (`validation_error_handler`)."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


class BodyError(APIError, StarletteHTTPException):
    """An `APIError` raised while a body is parsed (`request.json()`): FastAPI passes only HTTP exceptions
    from there on unchanged (any other becomes "There was an error parsing the body"); it is answered by
    the `APIError` handler, first in its class order."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        APIError.__init__(self, status, message, param, code)
        StarletteHTTPException.__init__(self, status, message)


# an error's message and param at most: they quote a client's values cut short (`shown`); past this, a value
# some message quotes whole is cut here rather than sent back (a 30 MB name came back twice, 60 MB)
MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 4096, 256


def _cut(text: str | None, limit: int) -> str | None:
    return text if text is None or len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's shape: `code` is a string naming the error (e.g. "context_length_exceeded") or null."""
    message, param = _cut(message, MAX_MESSAGE_CHARS), _cut(param, MAX_PARAM_CHARS)
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def unsupported_cause(errors: list[dict]) -> UnsupportedValue | None:
    """The `UnsupportedValue` a model's own check raised, among a validation error's `errors()`."""
    return next((e["ctx"]["error"] for e in errors
                 if isinstance((e.get("ctx") or {}).get("error"), UnsupportedValue)), None)


NOT_READ_AS_JSON = "The request body was not read as JSON: send it with 'Content-Type: application/json'."


# the other mistakes that one message names at most (and unknown fields: protocol's MAX_UNKNOWN_NAMED)
MAX_NAMED_ERRORS = 5


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message naming the offending fields, and the first field as `param`. It names at most
    `MAX_UNKNOWN_NAMED` unknown fields (and how many more there are) and `MAX_NAMED_ERRORS` other mistakes,
    and reads no further than that: a body can hold ~150,000 mistakes the bounds before validation let
    through (logit_bias values: 0.48 s of the event loop to describe, naming them all)."""
    errors = exc.errors()
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        return _describe_bad_json(bad_json, getattr(exc, "body", None)), None
    unknown, more = _unknown_fields(errors)
    if unknown:
        # a union's branch that takes the unknown field may lack a field it needs: both are the mistake
        missing = [f"{'.'.join(_field_path(e))}: Field required" for e in errors if e.get("type") == "missing"]
        names = ", ".join(unknown) + (f" (and {more:,} more)" if more else "")
        return "; ".join([f"Unknown or unsupported field(s): {names}", *missing[:MAX_NAMED_ERRORS]]), unknown[0]
    cause = unsupported_cause(errors)
    if cause is not None:
        return str(cause), cause.field
    if any(tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes) for e in errors):
        # FastAPI reads a body as JSON only when its Content-Type says so (curl -d sends a form's)
        return NOT_READ_AS_JSON, None
    parts, param, seen = [], None, set()
    for e in errors:
        loc = _field_path(e)
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        message = f"{where}: {e.get('msg', 'invalid value')}"
        # a value of the wrong type, or a query parameter's text that does not parse as its type: what it was
        if "input" in e and (e.get("type", "").endswith(("_type", "_parsing", "_parsing_size"))
                             or e.get("type") in ("literal_error", "enum")):
            message += f" (got {json_kind(e['input'])})"
        if message not in seen:
            seen.add(message)
            parts.append(message)
            if len(parts) == MAX_NAMED_ERRORS:
                break
    return "; ".join(parts) or "invalid request", param


def _unknown_fields(errors: list[dict]) -> tuple[list[str], int]:
    """The paths of the first `MAX_UNKNOWN_NAMED` unknown fields, and how many more there are: pydantic's error
    for each, or protocol's one error for an object of several ("unknown_fields", naming the first few)."""
    named, more = [], 0
    for e in errors:
        kind = e.get("type")
        if kind == "extra_forbidden":
            names, count = [None], 1
        elif kind == "unknown_fields":
            names, count = e["ctx"]["named"], e["ctx"]["count"]
        else:
            continue
        names = names[:MAX_UNKNOWN_NAMED - len(named)]
        if names:
            path = _field_path(e)
            named += [".".join(path if name is None else path + [_name(str(name))]) for name in names]
        more += count - len(names)
    return named, more


def _field_path(error: dict) -> list[str]:
    """A validation error's location as the client's field path: without "body" (or "query": a query
    parameter's name is the client's field) and pydantic's union-branch names ("str", "list[int]",
    "constrained-str", or a model's class name such as "NamedToolChoice": the API's field names are lower
    case). An unknown field's own name, the location's last, is the client's whatever it is."""
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    if loc[:1] == ["query"] and len(loc) > 1:
        loc = loc[1:]
    last = loc.pop() if loc and error.get("type") == "extra_forbidden" else None
    path = [_name(x) for x in loc if (x.isdigit() or x.isidentifier() and not x[0].isupper())
            and x not in ("str", "int", "float", "bool")]
    return path + ([_name(last)] if last is not None else [])


def _name(key: str) -> str:
    """A name in an error's path (a client's key, such as an unknown field's), cut to `MAX_SHOWN_CHARS`."""
    return key if len(key) <= MAX_SHOWN_CHARS else f"{key[:MAX_SHOWN_CHARS]}...({len(key):,} characters)"


def _describe_bad_json(error: dict, doc) -> str:
    """'The request body is not valid JSON: <what> at line L, column C', from the decoder's position."""
    what = str((error.get("ctx") or {}).get("error") or "invalid JSON")
    loc = error.get("loc") or ()
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is not None and isinstance(doc, (str, bytes)):
        head = doc[:pos]
        nl = "\n" if isinstance(head, str) else b"\n"
        line = head.count(nl) + 1
        column = pos - (head.rfind(nl) + 1) + 1
        return f"The request body is not valid JSON: {what} at line {line}, column {column} (byte {pos})."
    return f"The request body is not valid JSON: {what}."


async def api_error_handler(request: Request, exc: APIError):
    # load shed or shut out before the engine (a request the engine had taken counts as an abort)
    if exc.status == 503 and exc.code in REJECT_REASONS and not getattr(exc, "in_flight", False):
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.reject(exc.code)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError):
    message, param = describe_validation_error(exc)
    return error_response(400, message, param)


async def http_error_handler(request: Request, exc: StarletteHTTPException):
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        # Starlette's 405 names the methods of the first route on the path; a path may have several
        headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
    return error_response(exc.status_code, str(exc.detail), headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """The methods of every route of the application on the request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


async def unhandled_error_handler(request: Request, exc: Exception):
    return error_response(500, f"internal error: {type(exc).__name__}")


def install(app):
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unhandled_error_handler)
