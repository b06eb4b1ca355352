"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, for every
status the server answers with, and the exception handlers that produce them."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from kiln.errors import ConfigError

log = logging.getLogger("kiln.serve")

# OpenAI's error types by status
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client with ``status`` in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    body = error_body(message, TYPES.get(status, "invalid_request_error"), param, code)
    return json.dumps(body).encode()


_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)=")


def from_config_error(e: ConfigError, param: str | None = None) -> APIError:
    """A kiln ``ConfigError`` (``"{field}={value!r} is invalid: {allowed}."``) as a 400 whose
    ``param`` is the field."""
    msg = str(e)
    if param is None:
        m = _FIELD.match(msg)
        param = m.group(1) if m else None
    if param == "prompt_token_ids":
        param = "prompt"
    return APIError(400, msg, param=param)


def _short(value: Any, limit: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 1] + "…"


def from_validation_error(e: RequestValidationError) -> APIError:
    """pydantic's first complaint as one sentence naming the field, the value and the rule."""
    errors = e.errors()
    if not errors:
        return APIError(400, "the request body is invalid.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # union members add their type name to the location; keep the field path only
    loc = [p for p in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|list|function-.*", p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON.", code="invalid_json")
    if first.get("type") == "missing":
        return APIError(400, f"{param} is required.", param=param)
    if first.get("type") == "extra_forbidden":
        return APIError(
            400,
            f"{param} is not a known field (this server rejects unknown fields).",
            param=param,
            code="unknown_field",
        )
    msg = first.get("msg", "invalid")
    more = f" ({len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(
        400, f"{param}={_short(first.get('input'))} is invalid: {msg}.{more}", param=param
    )


def install_handlers(app: FastAPI) -> None:
    """Every error the app can raise, answered in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return from_validation_error(e).response()

    @app.exception_handler(ConfigError)
    async def _config(request: Request, e: ConfigError) -> Response:
        return from_config_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        msg = e.detail if isinstance(e.detail, str) else "request failed"
        if e.status_code == 404:
            msg = f"{request.url.path} is not a route of this server."
        elif e.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}."
        return APIError(e.status_code, msg, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(e).__name__}).").response()
