"""Results of ``LLM.generate`` / ``generate_async``, in the vLLM / TensorRT-LLM shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any


@dataclass
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str  # generated text so far (all of it once finished; stop strings excluded)
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Any]] | None = None  # per token: {token id: Logprob}


@dataclass
class RequestMetrics:
    """Times from ``time.monotonic()``, in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token came
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in pairwise(t)]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
