"""Online serving benchmark: Poisson arrivals of streaming ``/v1/completions`` requests
against a running ``kiln serve`` or any OpenAI-compatible server, at one or several
request rates.

Each request asks for ``max_tokens`` = its output length with ``stream: true`` and usage
in the last chunk. To force the length it also sends ``ignore_eos`` and ``min_tokens``
(kiln's and vLLM's extensions); a server that answers 400/422 to them is probed once and
then sent plain requests, and the tokens that come are counted (the usage's
``completion_tokens`` when given, else one per chunk with a choice). Token times are the
arrival times of the streamed chunks. Arrivals are seeded: the gaps between submissions
are exponential with mean ``1 / rate`` (``inf``: all at once), optionally capped at
``max_concurrency`` requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any

from tqdm import tqdm

from kiln.bench.datasets import BenchRequest
from kiln.bench.metrics import RequestTiming, aggregate
from kiln.errors import KilnError

FORCE_FIELDS = {"ignore_eos": True}


async def _httpx() -> Any:
    try:
        import httpx
    except ImportError as e:
        raise KilnError("kiln bench serve needs httpx (pip install httpx==0.28.1).") from e
    return httpx


async def model_id(client: Any, url: str) -> str:
    """The first model the server lists."""
    r = await client.get(url + "/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise KilnError(f"{url}/v1/models lists no model; pass --served-model.")
    return str(data[0]["id"])


def _body(model: str, req: BenchRequest, force: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.payload,
        "max_tokens": req.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if force:
        body.update(FORCE_FIELDS, min_tokens=req.output_tokens)
    return body


async def probe_force(client: Any, url: str, model: str, req: BenchRequest) -> bool:
    """Whether the server accepts the length-forcing fields (one short request)."""
    short = BenchRequest(req.task_id, 2, req.input_ids, req.prompt, req.input_tokens)
    body = {**_body(model, short, True), "stream": False}
    body.pop("stream_options")
    r = await client.post(url + "/v1/completions", json=body)
    if r.status_code in (400, 422):
        return False
    r.raise_for_status()
    return True


async def one_request(
    client: Any, url: str, model: str, req: BenchRequest, force: bool
) -> RequestTiming:
    """Send one streaming request; its timings (ok=False with the error on failure)."""
    t = RequestTiming(req.input_tokens, 0, req.output_tokens, time.monotonic())
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=_body(model, req, force)
        ) as r:
            if r.status_code != 200:
                t.ok, t.error = False, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return t
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    t.ok, t.error = False, str(ev["error"].get("message", ev["error"]))[:200]
                    return t
                if ev.get("usage"):
                    usage = ev["usage"]
                if ev.get("choices"):  # one chunk per engine step that advanced the request
                    t.token_times.append(time.monotonic())
                    chunks += 1
    except Exception as e:  # a benchmark records failures instead of stopping
        t.ok, t.error = False, f"{type(e).__name__}: {e}"
        return t
    t.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        t.input_tokens = int(usage["prompt_tokens"])
    if not t.token_times:
        t.ok, t.error = False, "no tokens streamed"
    return t


async def run_rate(
    url: str,
    model: str,
    reqs: list[BenchRequest],
    rate: float,
    *,
    force: bool,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``reqs`` at ``rate`` requests/s (Poisson); the figures of ``aggregate``."""
    httpx = await _httpx()
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(reqs))
    bar = tqdm(total=len(reqs), desc=f"rate {rate}", unit="req", disable=not progress)
    limits = httpx.Limits(
        max_connections=max_concurrency or len(reqs), max_keepalive_connections=64
    )
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def task(req: BenchRequest) -> RequestTiming:
            async with sem:
                t = await one_request(client, url, model, req, force)
            bar.update()
            return t

        tasks = []
        t0 = time.monotonic()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(task(req)))
            if math.isfinite(rate) and i + 1 < len(reqs):
                await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    bar.close()
    fig = aggregate(list(timings), wall)
    fig["request_rate"] = rate if math.isfinite(rate) else "inf"
    fig["max_concurrency"] = max_concurrency
    fig["errors"] = sorted({t.error for t in timings if t.error})[:5]
    return fig


async def sweep(
    url: str,
    reqs: list[BenchRequest],
    rates: list[float],
    *,
    model: str | None = None,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """One run per rate, in order, on the same dataset; whether the length was forced."""
    httpx = await _httpx()
    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        model = model or await model_id(client, url)
        force = await probe_force(client, url, model, reqs[0])
    results = []
    for rate in rates:
        results.append(
            await run_rate(
                url,
                model,
                reqs,
                rate,
                force=force,
                max_concurrency=max_concurrency,
                seed=seed,
                progress=progress,
            )
        )
    return {"model": model, "length_forced": force, "rates": results}


def parse_rates(text: str) -> list[float]:
    """``"1,2,inf"`` -> [1.0, 2.0, inf]; every rate positive."""
    rates = []
    for part in text.split(","):
        v = float(part.strip())
        if not v > 0:
            raise KilnError(f"--request-rate {part!r}: rates must be positive numbers or inf.")
        rates.append(v)
    return rates
