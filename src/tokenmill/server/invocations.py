"""`POST /invocations`, SageMaker's inference path, as vLLM serves it beside `/ping`: the body's shape picks
the endpoint it goes to, and from there it is that endpoint's request (its validation, errors, streaming).

vLLM tries the chat completions request first, then the completions request, and answers a body that
validates as neither with one 400 that names neither's mistake. Here a field picks: `messages` is a chat
completions body, else `prompt` a completions body, and the picked request's own validation answers (a
chat body with a wrong temperature gets the chat endpoint's 400 naming temperature). As in vLLM, Responses
bodies (`input`) are not taken."""
from __future__ import annotations

import itertools

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tokenmill.sampling_params import shown
from tokenmill.server.errors import NOT_READ_AS_JSON, APIError, json_kind
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest

# (the field that picks it, the endpoint, its request), in the order they are looked for
INVOCATION_TYPES = (("messages", "/v1/chat/completions", ChatCompletionRequest),
                    ("prompt", "/v1/completions", CompletionRequest))

# the OpenAPI schema's request body: either endpoint's (their schemas are components of the app's schema)
INVOCATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    {"$ref": f"#/components/schemas/{request.__name__}"} for _, _, request in INVOCATION_TYPES]}}}}}


def invocation_request(body) -> ChatCompletionRequest | CompletionRequest:
    """The request `body` (parsed JSON; bytes where its Content-Type was not JSON's) is, validated as its
    endpoint validates it (FastAPI's errors, located in the body, so that the 400 reads the same); a 400
    naming the fields looked for where it has none of them."""
    if isinstance(body, bytes):
        raise APIError(400, NOT_READ_AS_JSON)
    wanted = " or ".join(f"a {path} body (with '{field}')" for field, path, _ in INVOCATION_TYPES)
    if not isinstance(body, dict):
        raise APIError(400, f"/invocations takes a JSON object, {wanted} (got {json_kind(body)}).")
    for field, _, request in INVOCATION_TYPES:
        if field in body:
            try:
                return request.model_validate(body, from_attributes=True)
            except ValidationError as e:
                errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors(include_url=False)]
                raise RequestValidationError(errors, body=body) from None
    fields = ", ".join(shown(key) for key in itertools.islice(body, 8)) + (", ..." if len(body) > 8 else "")
    has = f"its fields are {fields}" if body else "it has no fields"
    responses = " A Responses body ('input') goes to POST /v1/responses." if "input" in body else ""
    raise APIError(400, f"/invocations takes {wanted}; this body has neither ({has}).{responses}")
