"""Prometheus metrics, all named ``kiln:*``, in the server's own ``CollectorRegistry``.

Engine state (running and waiting requests, KV-cache usage, preemptions, prefix cache) is
read from ``LLM.stats()`` at scrape time, so the gauges are never stale. Per-request figures
(tokens, time to first token, inter-token latency, end-to-end latency, queue time) are
observed by the server when a request ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, llm: Callable[[], Any], failures: Callable[[], int]) -> None:
        self._llm = llm
        self._failures = failures

    def collect(self) -> Iterator[Metric]:
        llm = self._llm()
        up = GaugeMetricFamily("kiln:engine_ready", "1 once the engine is loaded and alive")
        up.add_metric([], 1.0 if llm is not None and llm.dead is None else 0.0)
        yield up
        fails = CounterMetricFamily(
            "kiln:engine_step_failures", "engine steps that raised (their requests failed)"
        )
        fails.add_metric([], float(self._failures()))
        yield fails
        if llm is None:
            return
        s = llm.stats()
        for name, doc, value in (
            ("kiln:num_requests_running", "requests in the running batch", s.num_running),
            ("kiln:num_requests_waiting", "requests waiting to be scheduled", s.num_waiting),
            ("kiln:kv_cache_usage_perc", "fraction of KV-cache blocks in use", s.kv_cache_usage),
            ("kiln:kv_cache_blocks", "KV-cache blocks in all", s.kv_cache_blocks),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        for name, doc, value in (
            ("kiln:num_preemptions", "sequences preempted (recomputed later)", s.num_preemptions),
            ("kiln:prefix_cache_queries", "prompt tokens looked up", s.prefix_cache_queries),
            (
                "kiln:prefix_cache_hits",
                "prompt tokens found in the prefix cache",
                s.prefix_cache_hits,
            ),
            ("kiln:engine_steps", "engine steps run", s.steps),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c


class ServerMetrics:
    def __init__(self, llm: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._llm = llm
        self.prompt_tokens = Counter(
            "kiln:prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "kiln:generation_tokens", "generated tokens of finished requests", registry=r
        )
        self.requests = Counter(
            "kiln:request_success",
            "requests that ended, by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kiln:time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "kiln:inter_token_latency_seconds",
            "time between consecutive generated tokens",
            buckets=_TOKEN_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "kiln:e2e_request_latency_seconds",
            "arrival to the end of a request",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "kiln:request_queue_time_seconds",
            "arrival to first scheduled",
            buckets=_LATENCY,
            registry=r,
        )
        r.register(_EngineCollector(llm, self._step_failures))

    def _step_failures(self) -> int:
        llm = self._llm()
        return 0 if llm is None else llm.step_failures

    def observe(self, out: RequestOutput, end: float, reason: str | None = None) -> None:
        """Record a request that ended (finished, aborted or failed) at ``end``
        (``time.monotonic()``)."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
        if reason is None:
            reasons = [o.finish_reason for o in out.outputs if o.finish_reason]
            reason = reasons[0] if reasons else "abort"
        self.requests.labels(finished_reason=reason).inc()
        m = out.metrics
        if m is None:
            return
        if (t := m.time_to_first_token) is not None:
            self.ttft.observe(max(t, 0.0))
        for d in m.inter_token_latencies:
            self.itl.observe(max(d, 0.0))
        self.e2e.observe(max((m.finished_time or end) - m.arrival_time, 0.0))
        if (q := m.queue_time) is not None:
            self.queue.observe(max(q, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
