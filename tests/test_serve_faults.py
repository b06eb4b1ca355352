"""Security, the bounded queue, engine faults and SIGTERM, each on its own server process:
an API key from $KILN_API_KEY with options from a YAML file; a KV cache so small that one
request at a time runs; ``KILN_FAULT_INJECT`` (the documented test hook) making one engine
step raise, or every step from some point on; and a drain with requests in flight."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_util import Server, assert_openai_error, metrics, sse_events

KEY = "s3cret-key"
C = "/v1/completions"


@pytest.fixture(scope="module")
def strict(smollm2_llm: Any, serve_logs: Path) -> Any:
    """API key from the environment; YAML options: name, strict fields, queue bound 1 and
    a 64-token KV cache (two blocks), so a request with 40 tokens to go holds it alone."""
    cfg = serve_logs / "strict.yaml"
    cfg.write_text(
        "served-model-name: kiln-test\nreject_unknown_fields: true\nmax_queued_requests: 1\n"
        "kv_cache_max_tokens: 64\nshutdown_timeout: 5\n"
    )
    srv = Server(["--config", str(cfg)], serve_logs, {"KILN_API_KEY": KEY}, "strict")
    yield srv.wait_ready()
    srv.stop()


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_protects_v1(strict: Server) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", C), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, strict.url + path, json={"prompt": "x"}, timeout=10)
        assert assert_openai_error(r, 401, None)["code"] == "invalid_api_key"
        r = httpx.request(method, strict.url + path, headers=_auth("wrong"), timeout=10)
        assert_openai_error(r, 401, None)
    assert httpx.get(strict.url + "/health").status_code == 200  # public
    r = httpx.get(strict.url + "/v1/models", headers=_auth())
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "kiln-test"


def test_yaml_strict_unknown_fields(strict: Server) -> None:
    body = {"model": "kiln-test", "prompt": "x", "max_tokens": 1, "frobnicate": True}
    r = httpx.post(strict.url + C, json=body, headers=_auth(), timeout=30)
    assert assert_openai_error(r, 400, "frobnicate")["code"] == "unknown_field"


def test_queue_bound_answers_429_at_once(strict: Server) -> None:
    body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True}
    client = httpx.Client(base_url=strict.url, headers=_auth(), timeout=60)
    with client, client.stream("POST", C, json=body) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        while not next(lines).startswith("data: {"):
            pass  # the first token: this request holds the cache
        with client.stream("POST", C, json=body) as queued:
            assert queued.status_code == 200  # waits: the one queue place
            t0 = time.monotonic()
            r = client.post(C, json={**body, "stream": False})
            elapsed = time.monotonic() - t0
            assert_openai_error(r, 429, None)
            assert elapsed < 2.0
    deadline = time.monotonic() + 10
    while metrics(strict.url)["kiln:kv_cache_usage_perc"] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = metrics(strict.url)
    assert m["kiln:num_requests_running"] == m["kiln:kv_cache_usage_perc"] == 0


def test_engine_fault_fails_requests_not_the_process(serve_logs: Path) -> None:
    srv = Server([], serve_logs, {"KILN_FAULT_INJECT": "step:3"}, "fault").wait_ready()
    try:
        body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + C, json=body, timeout=60) as r:
            events, done = sse_events(list(r.iter_lines()))
        assert done, "the failed stream still ends with [DONE]"
        assert "error" in events[-1] and set(events[-1]["error"]) >= {"message", "type"}
        assert all("choices" in e for e in events[:-1]) and len(events) >= 2
        h = httpx.get(srv.url + "/health").json()
        assert h["status"] == "ok" and h["engine_step_failures"] == 1
        assert "InjectedFault" in h["last_engine_error"]
        r2 = httpx.post(srv.url + C, json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 3
        assert metrics(srv.url)["kiln:engine_step_failures_total"] == 1
    finally:
        srv.stop()


def test_dead_engine_makes_health_503(serve_logs: Path) -> None:
    srv = Server([], serve_logs, {"KILN_FAULT_INJECT": "step:2+"}, "dead").wait_ready()
    try:
        r = httpx.post(srv.url + C, json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert 500 <= r.status_code < 600 and "error" in r.json()
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "dead"
        r = httpx.post(srv.url + C, json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert_openai_error(r, 503)
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_sigterm_drains_in_flight(serve_logs: Path) -> None:
    srv = Server(["--shutdown-timeout", "30"], serve_logs, name="drain").wait_ready()
    body = {"prompt": "Tell me", "max_tokens": 16, "ignore_eos": True, "stream": True}
    results: list[Any] = []
    started = threading.Barrier(4, timeout=60)

    def client() -> None:
        try:
            with httpx.stream("POST", srv.url + C, json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                started.wait()
                results.append(sse_events([first, *lines]))
        except Exception as e:
            results.append(e)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.post(srv.url + C, json={"prompt": "x", "max_tokens": 1}, timeout=5)
    for t in threads:
        t.join(60)
    rc = srv.proc.wait(40)
    assert rc == 0, srv.tail()
    assert time.monotonic() - t0 < 35
    assert len(results) == 3
    for res in results:
        assert not isinstance(res, Exception), res
        events, done = res
        assert done
        tokens = sum(len(e["choices"][0]["text"]) > 0 for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length", json.dumps(events[-1])
        assert tokens >= 1
    srv.stop()


def test_health_is_503_while_the_model_loads(serve_logs: Path) -> None:
    """From the moment the port answers until the engine is ready, /health says 503
    ``loading`` and /v1 routes 503 ``not_ready``; then 200."""
    srv = Server([], serve_logs, name="loading")
    seen: list[tuple[int, str]] = []
    v1_while_loading: list[int] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.01)
                continue
            seen.append((r.status_code, r.json().get("status", "")))
            if r.status_code == 200:
                break
            if not v1_while_loading:
                v1 = httpx.post(srv.url + C, json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
                v1_while_loading.append(v1.status_code)
            time.sleep(0.01)
        assert seen and seen[-1] == (200, "ok"), seen[-3:]
        assert seen[0] == (503, "loading"), seen[:3]
        assert v1_while_loading == [503]
    finally:
        srv.stop()
