"""Helpers of the ``kiln serve`` tests: start the server as a real subprocess on a free
loopback port, wait for ``/health``, read SSE streams, and stop it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0  # engine already in the cache: ~10 s; a busy machine: more


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kiln serve`` in a subprocess; its output goes to ``log``."""

    def __init__(
        self, args: list[str], log_dir: Path, env: dict[str, str] | None = None, name: str = "srv"
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}-{self.port}.log"
        full_env = {**os.environ, "KILN_CACHE_DIR": os.environ["KILN_CACHE_DIR"]}
        full_env.pop("KILN_API_KEY", None)
        full_env.pop("KILN_FAULT_INJECT", None)
        full_env.update(env or {})
        cmd = [sys.executable, "-m", "kiln.cli", "serve", "--port", str(self.port), *args]
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=self._out, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._out.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()
        return self.proc.returncode


def metrics(url: str) -> dict[str, float]:
    """Unlabelled samples of /metrics by name."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def sse_events(lines: list[str]) -> tuple[list[Any], bool]:
    """The JSON payloads of ``data:`` lines and whether ``data: [DONE]`` ended them."""
    events: list[Any] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, "data after [DONE]"
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


def stream_post(url: str, path: str, body: dict[str, Any], timeout: float = 60) -> list[str]:
    with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(r.iter_lines())


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    return err
