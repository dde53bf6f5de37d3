"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.server.protocol import UnsupportedValue

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message naming the offending fields, and the first field as `param`."""
    errors = exc.errors()
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        return f"Unknown or unsupported field(s): {', '.join(unknown)}", unknown[0]
    parts, param = [], None
    for e in errors[:5]:
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, UnsupportedValue):
            return str(ctx_err), ctx_err.field
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # Drop pydantic's union-branch names (e.g. "str", "list[int]") from locations.
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", param


async def api_error_handler(request: Request, exc: APIError):
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError):
    message, param = describe_validation_error(exc)
    return error_response(400, message, param)


async def http_error_handler(request: Request, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def unhandled_error_handler(request: Request, exc: Exception):
    return error_response(500, f"internal error: {type(exc).__name__}")


def install(app):
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unhandled_error_handler)
