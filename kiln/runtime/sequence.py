"""State of one generation in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kiln.sampling_params import SamplingParams

PENDING_TOKEN = -1
"""Placeholder of a sampled token not read by the host yet (overlapped stepping)."""


@dataclass
class Sequence:
    """One output sequence of a request (a request with ``n > 1`` has n of them).
    Token counts are in tokens; ``block_ids`` are KV-cache blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_len: int  # prompt + generated tokens may not exceed this
    index: int = 0  # which of the request's n sequences
    pending_children: int = 0  # n - 1 until the prompt is computed and the request forks
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the leading full blocks
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache when last admitted
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    # the 64-bit seed of this sequence's sampling noise (kiln.kernels.sampling); the engine
    # sets it at creation, the sampler draws one if it is still None
    sample_seed: int | None = None
    # filled by the engine
    detok: Any = None  # IncrementalDetokenizer
    emitted: str = ""  # output text released so far (stop-string hold-back excluded)
    detok_count: int = 0  # output tokens handed to ``detok`` so far
    # overlapped stepping: output tokens sampled on the GPU whose ids the host has not read
    # yet; they sit at the end of output_token_ids as PENDING_TOKEN placeholders
    num_pending: int = 0
    output_logprobs: list[Any] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, lo: int, hi: int) -> list[int]:
        """``token_ids[lo:hi]`` without building the whole list (the decode step's case)."""
        p = len(self.prompt_token_ids)
        if lo >= p:
            return self.output_token_ids[lo - p : hi - p]
        return self.token_ids[lo:hi]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def known_output_ids(self) -> list[int]:
        """Output token ids the host has read (placeholders excluded)."""
        out = self.output_token_ids
        return out[: len(out) - self.num_pending] if self.num_pending else out

    def drop_pending(self) -> None:
        """Forget placeholders (the sequence ended before their tokens were read)."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def awaiting_last_token(self) -> bool:
        """Its final token is sampled but unread: nothing more may be scheduled for it."""
        return self.num_pending > 0 and (
            len(self.output_token_ids) >= self.params.max_tokens
            or self.num_tokens >= self.max_total_len
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        """True until every known token (prompt, and outputs after a preemption) is computed
        but the last."""
        return self.num_tokens - self.num_computed > 1
