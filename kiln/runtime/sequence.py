from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.sampling_params import SamplingParams


@dataclass
class Sequence:
    """One generation in flight. Token counts are in tokens; ``block_ids`` in KV blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_len: int  # prompt + generated tokens may not exceed this
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are already in the cache
    finish_reason: str | None = None
    stop_reason: int | None = None
    generator: torch.Generator | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
