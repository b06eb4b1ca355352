# ruff: noqa: E501  (one case per line reads better than wrapped tuples)
"""Hostile input: every case is answered with a 4xx in OpenAI's error shape (never a 5xx),
and the server still answers afterwards. The served context is 96 tokens, ``max_n`` 4 and the
body limit 64 KiB (see the ``served`` fixture)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from tests.serve_util import Server, assert_openai_error

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
J = {"content-type": "application/json"}


def _j(body: Any) -> bytes:
    return json.dumps(body).encode()


# (name, path, headers, raw body, status, param or "any")
CASES: list[tuple[str, str, dict[str, str], bytes, int, str | None]] = [
    ("malformed json", C, J, b'{"prompt": "x",', 400, None),
    ("not an object: list", C, J, b"[1, 2]", 400, None),
    ("not an object: string", C, J, b'"prompt"', 400, None),
    ("not an object: null", CHAT, J, b"null", 400, None),
    ("empty body", C, J, b"", 400, None),
    ("wrong content type", C, {"content-type": "text/plain"}, _j({"prompt": "x"}), 415, None),
    ("form content type", C, {"content-type": "application/x-www-form-urlencoded"}, b"a=1", 415, None),
    ("no content type", C, {}, _j({"prompt": "x"}), 415, None),
    ("max_tokens 0", C, J, _j({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
    ("max_tokens -5", C, J, _j({"prompt": "x", "max_tokens": -5}), 400, "max_tokens"),
    ("chat max_tokens 0", CHAT, J, _j({"messages": MSG, "max_tokens": 0}), 400, "max_tokens"),
    ("max_completion_tokens -1", CHAT, J, _j({"messages": MSG, "max_completion_tokens": -1}), 400, "max_completion_tokens"),
    ("context exceeded", C, J, _j({"prompt": "x", "max_tokens": 96}), 400, "max_tokens"),
    ("prompt over context", C, J, _j({"prompt": "word " * 200, "max_tokens": 1}), 400, "prompt"),
    ("chat context exceeded", CHAT, J, _j({"messages": MSG, "max_tokens": 1000}), 400, "max_tokens"),
    ("temperature < 0", C, J, _j({"prompt": "x", "temperature": -0.1}), 400, "temperature"),
    ("temperature NaN", C, J, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", C, J, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("temperature > 2", CHAT, J, _j({"messages": MSG, "temperature": 2.5}), 400, "temperature"),
    ("temperature string", C, J, _j({"prompt": "x", "temperature": "hot"}), 400, "temperature"),
    ("top_p 0", C, J, _j({"prompt": "x", "top_p": 0}), 400, "top_p"),
    ("top_p > 1", C, J, _j({"prompt": "x", "top_p": 1.5}), 400, "top_p"),
    ("top_p negative", CHAT, J, _j({"messages": MSG, "top_p": -1}), 400, "top_p"),
    ("top_k -2", C, J, _j({"prompt": "x", "top_k": -2}), 400, "top_k"),
    ("n above max_n", C, J, _j({"prompt": "x", "n": 5}), 400, "n"),
    ("n times prompts above max_n", C, J, _j({"prompt": ["a", "b", "c"], "n": 2}), 400, "n"),
    ("n 0", CHAT, J, _j({"messages": MSG, "n": 0}), 400, "n"),
    ("top_logprobs 21", CHAT, J, _j({"messages": MSG, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs"),
    ("logprobs 21", C, J, _j({"prompt": "x", "logprobs": 21}), 400, "logprobs"),
    ("token id out of vocabulary", C, J, _j({"prompt": [1, 10**6]}), 400, "prompt"),
    ("negative token id", C, J, _j({"prompt": [1, -1]}), 400, "prompt"),
    ("huge token id", C, J, _j({"prompt": [2**40]}), 400, "prompt"),
    ("token ids in batch", C, J, _j({"prompt": [[1], [-3]]}), 400, "prompt"),
    ("invalid utf-8", C, J, b'{"prompt": "\xff\xfe"}', 400, None),
    ("lone surrogate", C, J, b'{"prompt": "\\ud800"}', 400, None),
    ("empty prompt", C, J, _j({"prompt": ""}), 400, "prompt"),
    ("empty token list", C, J, _j({"prompt": []}), 400, "prompt"),
    ("missing prompt", C, J, _j({"max_tokens": 1}), 400, "prompt"),
    ("empty messages", CHAT, J, _j({"messages": []}), 400, "messages"),
    ("bad role", CHAT, J, _j({"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages.0.role"),
    ("image part", CHAT, J, _j({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "messages.0.content"),
    ("huge stop list", C, J, _j({"prompt": "x", "stop": ["s"] * 10_000}), 400, "stop"),
    ("stop list of 17", C, J, _j({"prompt": "x", "stop": [str(i) for i in range(17)]}), 400, "stop"),
    ("huge stop string", C, J, _j({"prompt": "x", "stop": "s" * 5000}), 400, "stop"),
    ("empty stop string", C, J, _j({"prompt": "x", "stop": [""]}), 400, "stop"),
    ("presence_penalty 3", C, J, _j({"prompt": "x", "presence_penalty": 3}), 400, "presence_penalty"),
    ("seed too large", C, J, _j({"prompt": "x", "seed": 2**70}), 400, "seed"),
    ("stream not bool", C, J, _j({"prompt": "x", "stream": "maybe"}), 400, "stream"),
    ("unknown model", C, J, _j({"prompt": "x", "model": "gpt-5"}), 404, "model"),
    ("logit_bias", C, J, _j({"prompt": "x", "logit_bias": {"1": 5}}), 400, "logit_bias"),
    ("tools", CHAT, J, _j({"messages": MSG, "tools": [{"type": "function"}]}), 400, "tools"),
    ("json response_format", CHAT, J, _j({"messages": MSG, "response_format": {"type": "json_object"}}), 400, "response_format"),
    ("best_of", C, J, _j({"prompt": "x", "best_of": 3}), 400, "best_of"),
    ("deeply nested", C, J, b'{"prompt": ' + b"[" * 100_00 + b"]" * 100_00 + b"}", 400, None),
    ("body over the limit", C, J, _j({"prompt": "x" * 70_000}), 413, None),
    ("GET on a POST route", C, {}, b"", 405, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "path", "headers", "body", "status", "param"), CASES)
def test_hostile_body(
    served: Server,
    name: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    method = "GET" if name.startswith("GET") else "POST"
    r = httpx.request(method, served.url + path, content=body, headers=headers, timeout=30)
    assert_openai_error(r, status, param)
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200


def test_hostile_headers(served: Server) -> None:
    many = {f"x-h-{i}": "v" for i in range(150)}
    r = httpx.post(served.url + C, json={"prompt": "x", "max_tokens": 1}, headers=many)
    assert_openai_error(r, 431)
    r = httpx.get(served.url + "/health", headers={"x-big": "a" * 65536}, timeout=10)
    assert_openai_error(r, 431)
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    ok = httpx.post(served.url + C, json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_oversized_headers_in_pieces_get_a_431(served: Server) -> None:
    """A header block over ``max_header_bytes`` that reaches the server in several reads is
    still answered with a JSON 431 (h11 alone would fail it at the limit with a plain 400 and
    close with bytes unread, which a client can see as a reset)."""
    host, port = served.url.removeprefix("http://").split(":")
    head = f"GET /health HTTP/1.1\r\nhost: {host}\r\nx-big: ".encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + b"a" * 20000)
        time.sleep(0.3)  # the server reads the first 20 kB on its own
        s.sendall(b"a" * 45000 + b"\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"431", reply[:300]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["type"] == "invalid_request_error", body
    assert "exceed" in body["error"]["message"], body
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
