"""Results of ``LLM.generate``, in the vLLM / TensorRT-LLM shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (eos or a stop token), "length", or None while running
    stop_reason: int | None = None  # the stop token id that ended it, if any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
