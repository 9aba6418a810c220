"""Errors as vLLM's OpenAI server sends them (chapter 11).

Body: {"error": {"message": ..., "type": ..., "param": ..., "code": <HTTP status>}}, with the
status on the response too. FastAPI would answer a schema violation with 422 and its own body;
vLLM (and OpenAI) answer 400, so the validation handler here rewrites it, naming the field
(`param`) and what pydantic expected (a type, a range).

Overload is 503 Service Unavailable with `Retry-After`, vLLM's choice (TGI sends 429): the
client did nothing wrong, the server is temporarily full. Note that the official `openai`
client retries 408/409/429/5xx twice by default with backoff, so a load test must pass
`max_retries=0` to see these answers at all.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """Raised in a route; becomes the error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One message listing every problem as `field: what is wrong`, and the first field's name."""
    parts, first_param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({ctx})" if ctx else "the request body is not valid JSON")
            continue
        # Pydantic names union members in the location (e.g. "str", "list[int]"): keep the field path only.
        path = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool",
                                                                               "function-after")]
        field = ".".join(path)
        msg = err.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err.get("type") == "missing":
            msg = "field required"
        first_param = first_param or (path[0] if path else None)
        parts.append(f"{field}: {msg}" if field else msg)
    # Pydantic reports each member of a union separately; say each distinct problem once.
    message = "; ".join(dict.fromkeys(parts)) or "invalid request"
    return message, first_param


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_validation_error(exc)
    return error_response(400, message, param)


async def unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
