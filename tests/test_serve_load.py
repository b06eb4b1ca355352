"""Load and fuzzing against the shared server: 200 concurrent streams of which half
disconnect mid-way (the engine must free everything and answer again at once), and
schemathesis over the served OpenAPI document (no 5xx). Both are bounded in count and time
and run in CI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.serve_util import Server, metrics

N_REQUESTS = 200
MAX_TOKENS = 8
DISCONNECT_AFTER = 2  # content chunks read before a disconnecting client goes away
LOAD_TIMEOUT_S = 150


async def _one(client: httpx.AsyncClient, i: int, disconnect: bool) -> tuple[str, int]:
    body = {
        "prompt": f"Request {i}: the weather today is",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}", 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done", chunks
            event = json.loads(line[6:])
            if "error" in event:
                return "error", chunks
            chunks += 1
            if disconnect and chunks >= DISCONNECT_AFTER:
                return "disconnected", chunks  # leaving the block closes the connection
    return "cut", chunks


async def _load(url: str) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=0)
    timeout = httpx.Timeout(LOAD_TIMEOUT_S, connect=30)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        tasks = [_one(client, i, disconnect=i % 2 == 1) for i in range(N_REQUESTS)]
        return await asyncio.wait_for(asyncio.gather(*tasks), LOAD_TIMEOUT_S)


def _idle(url: str, timeout: float) -> tuple[float, dict[str, float]]:
    t0 = time.monotonic()
    while True:
        m = metrics(url)
        idle = (
            m["kiln:num_requests_running"] == 0
            and m["kiln:num_requests_waiting"] == 0
            and m["kiln:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, m
        time.sleep(0.1)


def test_200_streams_half_disconnect(served: Server) -> None:
    before = metrics(served.url)
    t0 = time.monotonic()
    results = asyncio.run(_load(served.url))
    load_s = time.monotonic() - t0
    kinds = [k for k, _ in results]
    assert kinds.count("disconnected") == N_REQUESTS // 2, kinds
    assert kinds.count("done") == N_REQUESTS // 2, kinds
    assert all(n == MAX_TOKENS for k, n in results if k == "done")
    idle_s, m = _idle(served.url, timeout=5)
    leaked = round(m["kiln:kv_cache_usage_perc"] * m["kiln:kv_cache_blocks"])
    t1 = time.monotonic()
    r = httpx.post(
        served.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=5
    )
    answer_s = time.monotonic() - t1
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    gen = m["kiln:generation_tokens_total"] - before.get("kiln:generation_tokens_total", 0)
    print(
        f"\nLOAD: {N_REQUESTS} streams, {kinds.count('disconnected')} disconnected after "
        f"{DISCONNECT_AFTER} chunks, all done in {load_s:.1f} s; gauges idle {idle_s:.2f} s "
        f"after; new request answered in {answer_s:.2f} s; leaked blocks {leaked}; "
        f"generated tokens {gen:.0f}"
    )
    assert m["kiln:num_requests_running"] == 0
    assert m["kiln:num_requests_waiting"] == 0
    assert leaked == 0
    assert answer_s < 5


def test_schemathesis_finds_no_5xx(served: Server, tmp_path: Path) -> None:
    """Property-based requests generated from /openapi.json (valid and invalid ones);
    the only check is that none is answered with a 5xx."""
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        served.url + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        "10",
        "--max-time",
        "45",
        "--seed",
        "1",
        "--request-timeout",
        "60",
        "--workers",
        "2",
        "--no-shrink",
        "--report-dir",
        str(tmp_path),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    out = p.stdout + p.stderr
    print("\nSCHEMATHESIS:", out[-1500:])
    assert p.returncode == 0, out[-6000:]
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
