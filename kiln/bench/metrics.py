"""Per-request timings and the figures a benchmark reports from them.

Definitions (the ones of TensorRT-LLM's ``trtllm-bench`` and vLLM's ``benchmark_serving``):

- time to first token (TTFT): first output token's arrival minus the request's submission;
- end-to-end latency (E2E): last token's arrival minus submission;
- time per output token (TPOT), per request: ``(E2E - TTFT) / (output tokens - 1)``;
- inter-token latency (ITL): every gap between consecutive token arrivals of a request
  (a streamed chunk holding several tokens counts as one arrival);
- output tokens/s per user: per request ``(output tokens - 1) / (E2E - TTFT)`` = 1 / TPOT,
  the decode speed one user sees, averaged over requests;
- request throughput, output tokens/s, total (input + output) tokens/s: over the run's wall
  time, from the first submission to the last token.

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation; nan if empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """mean, min, max and p50/p90/p99 of ``values`` (nan when there are none)."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    out["min"] = min(values) if values else math.nan
    out["max"] = max(values) if values else math.nan
    return out


@dataclass
class RequestTiming:
    """One finished request; times in seconds on one clock (any origin)."""

    input_tokens: int
    output_tokens: int
    requested_output_tokens: int
    submitted: float
    token_times: list[float] = field(default_factory=list)  # arrival of each token/chunk
    ok: bool = True
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.submitted if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times)]


def aggregate(timings: list[RequestTiming], wall_time_s: float) -> dict[str, Any]:
    """The run's figures: counts, throughputs over ``wall_time_s`` and latency summaries
    (milliseconds) over the successful requests."""
    good = [t for t in timings if t.ok]
    out_tok = sum(t.output_tokens for t in good)
    in_tok = sum(t.input_tokens for t in good)
    ms = 1000.0
    tpots = [x for t in good if (x := t.tpot) is not None]
    return {
        "num_requests": len(timings),
        "num_completed": len(good),
        "num_failed": len(timings) - len(good),
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "requested_output_tokens": sum(t.requested_output_tokens for t in good),
        # every request succeeded and produced exactly the tokens it asked for
        "tokens_match": len(good) == len(timings)
        and all(t.output_tokens == t.requested_output_tokens for t in good),
        "wall_time_s": wall_time_s,
        "request_throughput": len(good) / wall_time_s,
        "output_tokens_per_s": out_tok / wall_time_s,
        "total_tokens_per_s": (in_tok + out_tok) / wall_time_s,
        "output_tokens_per_s_per_user": sum(1.0 / x for x in tpots if x > 0) / len(tpots)
        if tpots
        else math.nan,
        "ttft_ms": summarize([t.ttft * ms for t in good if t.ttft is not None]),
        "tpot_ms": summarize([x * ms for x in tpots]),
        "itl_ms": summarize([x * ms for t in good for x in t.itls]),
        "e2e_ms": summarize([t.e2e * ms for t in good if t.e2e is not None]),
    }
