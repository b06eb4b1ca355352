"""A request's state in the engine, building its outputs, and a launched step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.sequence import Sequence
from kiln.sampling_params import SamplingParams


@dataclass
class InFlight:
    """A launched step: the sequences it sampled for, in row order, and their tokens on
    their way to the host; the prompt logprobs it made (``PendingPromptLogprobs``), also on
    their way. ``needs_sync``: it must be read back before the next launch."""

    seqs: list[Sequence]
    pending: Any  # PendingSample | None
    row_of: dict[int, int]  # id(seq) -> row of its token in ``pending.tokens_device``
    needs_sync: bool = False
    prompt_logprobs: Any = None  # PendingPromptLogprobs | None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    # prompt positions whose logprobs are made (or on their way to the host): a prompt
    # recomputed after a preemption, in chunks that need not match the first time's, skips them
    prompt_rows_launched: int = 0
    error: str | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished and not s.pending_children for s in self.seqs)


def sync_text(seq: Sequence) -> None:
    """Detokenize the output tokens not yet seen. Without stop strings the text is only
    needed when an output is built, so it is brought up to date lazily, several tokens
    per call (a non-streaming batch decodes each output once, at its end)."""
    known = len(seq.output_token_ids) - seq.num_pending
    if known > seq.detok_count:
        seq.emitted += seq.detok.update(seq.output_token_ids[seq.detok_count : known])
        seq.detok_count = known


# ---- outputs and stats -------------------------------------------------------------


def build_output(req: Request) -> RequestOutput:
    for s in req.seqs:
        sync_text(s)
    outs = [
        CompletionOutput(
            index=s.index,
            text=s.emitted,
            token_ids=list(s.known_output_ids),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
        )
        for s in sorted(req.seqs, key=lambda s: s.index)
    ]
    first = req.seqs[0]
    metrics = RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=first.first_token_time,
        finished_time=req.finished_time,
        token_times=list(first.token_times),
        num_cached_tokens=first.num_cached_tokens,
        num_preemptions=sum(s.num_preemptions for s in req.seqs),
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=outs,
        finished=req.finished,
        prompt_logprobs=req.prompt_logprobs,
        metrics=metrics,
        error=req.error,
    )
