"""``Guard``: the pure-ASGI middleware every request passes before any route runs.

In order: too many headers or header bytes (431; h11 reads a header block up to
``server.h11_header_bound``, well past the limit, so oversized blocks reach this check);
``/v1`` routes need the API key when one is set (401, compared in constant time); while
draining for shutdown, ``/v1`` routes answer 503; a POST body must be ``application/json``
(415), at most ``max_body_bytes`` (413, checked on ``Content-Length`` and while reading),
valid UTF-8, valid JSON (lone surrogates included) and a JSON object (400). The body read
here is replayed to the app, and later ``receive`` calls (the client's disconnect) pass
through."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.serve.errors import error_bytes


class _Reject(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        max_header_count: int,
        max_header_bytes: int,
        draining: Callable[[], bool],
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._check(scope, receive)
        except _Reject as r:
            await _answer(send, r)
            return
        if body is None:
            await self.app(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _check(self, scope: Scope, receive: Receive) -> bytes | None:
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if len(headers) > self.max_header_count:
            raise _Reject(431, f"more than {self.max_header_count} request headers.")
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            raise _Reject(431, f"the request headers exceed {self.max_header_bytes} bytes.")
        path: str = scope.get("path", "")
        if not path.startswith("/v1"):
            return None
        if self.expected is not None:
            given = b""
            for k, v in headers:
                if k == b"authorization":
                    given = v
                    break
            if not hmac.compare_digest(given, self.expected):
                raise _Reject(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        if self.draining():
            raise _Reject(503, "the server is shutting down; retry on another replica.")
        if scope.get("method") != "POST":
            return None
        ctype = b""
        length: int | None = None
        for k, v in headers:
            if k == b"content-type":
                ctype = v
            elif k == b"content-length":
                try:
                    length = int(v)
                except ValueError:
                    raise _Reject(400, "the Content-Length header is not a number.") from None
        media = ctype.split(b";")[0].strip().lower()
        if media != b"application/json":
            raise _Reject(
                415,
                f"the body must be application/json, not {media.decode('latin-1') or 'none'}.",
                code="unsupported_media_type",
            )
        too_big = _Reject(
            413, f"the request body exceeds {self.max_body_bytes} bytes.", code="body_too_large"
        )
        if length is not None and length > self.max_body_bytes:
            raise too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Reject(400, "the client went away before sending the body.")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Reject(
                400, f"the body is not valid UTF-8 (at byte {e.start}).", code="invalid_utf8"
            ) from None
        try:
            data: Any = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise _Reject(400, f"the body is not valid JSON: {e}.", code="invalid_json") from None
        if not isinstance(data, dict):
            raise _Reject(
                400,
                f"the body must be a JSON object, not {type(data).__name__}.",
                code="invalid_body",
            )
        try:  # "\ud800" escapes decode to lone surrogates, which no tokenizer can take
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _Reject(
                400, "the body holds a lone UTF-16 surrogate (invalid Unicode).", "invalid_utf8"
            ) from None
        except (RecursionError, ValueError):
            raise _Reject(400, "the body is nested too deeply.", code="invalid_body") from None
        return body


async def _answer(send: Send, r: _Reject) -> None:
    body = error_bytes(r.status, r.message, r.param, r.code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if r.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if r.status in (413, 431):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
