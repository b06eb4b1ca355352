"""Per-request sampling parameters (the vLLM / TensorRT-LLM shape), validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import bad_value


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` means greedy. ``top_k`` of -1 or 0 and ``top_p=1`` disable those
    filters. A ``seed`` makes the request's samples reproducible whatever else is batched
    with it. ``max_tokens`` counts generated tokens; generation also stops at the engine's
    ``max_seq_len``."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad_value("max_tokens", self.max_tokens, "an integer >= 1 is required")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise bad_value("temperature", t, "a finite number >= 0 is required (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad_value("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise bad_value("top_p", p, "a number in (0, 1] is required")
        if self.seed is not None and not _is_int(self.seed):
            raise bad_value("seed", self.seed, "an integer or None")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad_value(
                "min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]"
            )
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise bad_value("stop_token_ids", self.stop_token_ids, "non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
