"""Latency at fixed batch sizes: for each batch size ``b``, ``b`` requests of fixed input
and output lengths submitted together, ``iterations`` times; reports time per output token,
time to first token, end-to-end latency and tokens/s per batch size."""

from __future__ import annotations

from typing import Any

from kiln.bench.datasets import synthetic
from kiln.bench.metrics import RequestTiming, aggregate
from kiln.bench.throughput import run_requests
from kiln.errors import bad_value
from kiln.llm import LLM


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,2,4"`` or ``"1-8"`` (every size from 1 to 8)."""
    sizes: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            sizes += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError as e:
            raise bad_value("--batch-sizes", text, "sizes like 1,2,4 or a range 1-8") from e
    if not sizes or min(sizes) < 1:
        raise bad_value("--batch-sizes", text, "positive sizes like 1,2,4 or 1-8")
    return sizes


def run_latency(
    llm: LLM,
    batch_sizes: list[int],
    isl: int,
    osl: int,
    *,
    iterations: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per batch size: ``aggregate``'s figures over every iteration's requests."""
    limit = llm.engine.limits["max_batch_size"]
    if max(batch_sizes) > limit:
        raise bad_value(
            "--batch-sizes", max(batch_sizes), f"at most the engine's max_batch_size {limit}"
        )
    rows = []
    for b in batch_sizes:
        timings: list[RequestTiming] = []
        wall = 0.0
        for it in range(iterations):
            # a fresh seed per iteration: no prompt is found in the prefix cache
            reqs = synthetic(b, isl, osl, llm.config.vocab_size, seed=seed + 1000 * b + it)
            res = run_requests(llm, reqs, progress=progress, desc=f"batch {b} #{it + 1}")
            timings += res.timings
            wall += res.wall_time_s
        fig = aggregate(timings, wall)
        fig["batch_size"] = b
        fig["iterations"] = iterations
        rows.append(fig)
    return rows
