"""Per-request sampling parameters (the vLLM / TensorRT-LLM shape), validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import bad_value

MAX_N = 128  # sequences per request
MAX_LOGPROBS = 20  # top alternatives per position (logprobs, prompt_logprobs)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (as vLLM does)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` means greedy. ``top_k`` of -1 or 0, ``top_p=1`` and ``min_p=0`` disable
    those filters. A ``seed`` makes the request's samples reproducible whatever else is
    batched with it. ``max_tokens`` counts generated tokens; generation also stops at the
    engine's ``max_seq_len``.

    Penalties: ``repetition_penalty`` (Hugging Face semantics, 1 = off) divides the positive
    logits and multiplies the negative ones of every token seen in the prompt or the output;
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI semantics, 0 = off) subtract
    ``presence * (count > 0) + frequency * count`` over the *output* tokens only. They apply
    to greedy requests too.

    ``stop`` strings end generation where they first appear in the output text (the string
    itself is left out unless ``include_stop_str_in_output``). ``logprobs=k`` returns, for
    every generated token, its log-probability and those of the k most likely alternatives;
    ``prompt_logprobs=k`` does the same for prompt positions. Logprobs are those of the
    model's raw distribution (before temperature, penalties and filters)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad_value("max_tokens", self.max_tokens, "an integer >= 1 is required")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad_value("n", self.n, f"an integer in [1, {MAX_N}] is required")
        t = self.temperature
        if not _is_finite(t) or t < 0:
            raise bad_value("temperature", t, "a finite number >= 0 is required (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad_value("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        p = self.top_p
        if not _is_finite(p) or not 0.0 < p <= 1.0:
            raise bad_value("top_p", p, "a number in (0, 1] is required")
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad_value("min_p", self.min_p, "a number in [0, 1] is required (0 = off)")
        r = self.repetition_penalty
        if not _is_finite(r) or r <= 0:
            raise bad_value("repetition_penalty", r, "a finite number > 0 is required (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_finite(v) or not -2.0 <= v <= 2.0:
                raise bad_value(name, v, "a number in [-2, 2] is required (0 = off)")
        if self.seed is not None and not _is_int(self.seed):
            raise bad_value("seed", self.seed, "an integer or None")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad_value(
                "min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]"
            )
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise bad_value("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        self.stop = _normalize_stop(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad_value(
                "include_stop_str_in_output", self.include_stop_str_in_output, "True or False"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad_value(name, v, f"None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        """Argmax instead of sampling: temperature 0 (or below 1e-5, where dividing the
        logits by it would overflow)."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _normalize_stop(stop: object) -> list[str]:
    """None | str | list[str] -> list[str], each non-empty and bounded in number and size."""
    allowed = (
        f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
        f"{MAX_STOP_STRING_CHARS} characters each"
    )
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or len(items) > MAX_STOP_STRINGS:
        raise bad_value("stop", stop, allowed)
    for s in items:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
            raise bad_value("stop", stop, allowed)
    return list(items)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: object) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
