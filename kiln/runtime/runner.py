"""The model runner: turns one ``SchedulerOutput`` into flattened model inputs and
attention metadata, runs the model, and returns logits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.kernels.attention import AttentionMetadata, to_device
from kiln.kernels.embedding import placeholder
from kiln.runtime.cuda_graphs import DecodeGraphs
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    last_logits: torch.Tensor
    """(num_scheduled, vocab) float32: logits of each scheduled sequence's last new token."""
    prompt_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    """Batch index -> (num_new_tokens, hidden) final hidden states of every new token, for
    the sequences that asked for prompt logprobs (the engine turns them into logits a few
    rows at a time: a step's (tokens, vocab) float32 logits would not fit beside the cache)."""


Patch = tuple[list[int], list[int], torch.Tensor]
"""(batch rows, rows of ``tokens``, tokens): row ``b``'s last new token is ``tokens[r]``."""


def _placeholder_patch(step: SchedulerOutput, previous: Any) -> Patch | None:
    """Which scheduled sequences end in a placeholder, and where its token is."""
    if previous is None or previous.pending is None:
        return None
    batch_rows, token_rows = [], []
    for b, s in enumerate(step.scheduled):
        if s.seq.num_pending:
            batch_rows.append(b)
            token_rows.append(previous.row_of[id(s.seq)])
    if not batch_rows:
        return None
    return batch_rows, token_rows, previous.pending.tokens_device


def mark_placeholders(ids: list[int], ends: list[int], patch: Patch) -> torch.Tensor:
    """Write each patched row's last input id (at ``ends[b] - 1``) as the placeholder of its
    token's row (``kiln.kernels.embedding``), in the host list; returns the tokens the
    model's embedding then reads them from (on the device: no copy, no host sync)."""
    batch_rows, token_rows, tokens = patch
    for b, r in zip(batch_rows, token_rows, strict=True):
        ids[ends[b] - 1] = placeholder(r)
    return tokens


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv_cache, device
        self.graphs: DecodeGraphs | None = None
        self.graph_steps = self.eager_steps = 0

    def capture_cuda_graphs(self, max_seq_len: int, batch_sizes: list[int]) -> float:
        """Capture decode steps for ``batch_sizes``; returns the seconds it took."""
        start = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.kv, self.device, max_seq_len, batch_sizes)
        graphs.capture()
        self.graphs = graphs
        return time.perf_counter() - start

    def token_buffer(self, n: int) -> torch.Tensor | None:
        """The (n,) int64 device buffer a step's sampled tokens should go into (the CUDA
        graphs' ``prev``, where they fit), or None for a new tensor."""
        return None if self.graphs is None else self.graphs.token_buffer(n)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, previous: Any = None) -> RunnerOutput:
        """``previous``: the launched step whose sampled tokens the host has not read yet
        (overlapped stepping); a sequence whose last token is such a placeholder takes it
        from ``previous.pending.tokens_device`` on the device."""
        patch = _placeholder_patch(step, previous)
        if self.graphs is not None and self.graphs.fits(step, patch):
            self.graph_steps += 1
            return RunnerOutput(self.graphs.run(step, patch))
        self.eager_steps += 1
        return self._eager(step, patch)

    def _eager(self, step: SchedulerOutput, patch: Patch | None) -> RunnerOutput:
        bs = self.kv.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for s in step.scheduled:
            seq, lo = s.seq, s.seq.num_computed
            hi = lo + s.num_new_tokens
            ids.extend(seq.tokens(lo, hi))
            positions.extend(range(lo, hi))
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(lo, hi))
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(hi)
        width = max(len(s.seq.block_ids) for s in step.scheduled)
        tables = [s.seq.block_ids + [0] * (width - len(s.seq.block_ids)) for s in step.scheduled]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=to_device(starts, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            block_tables=to_device(tables, torch.int32, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        prev = None if patch is None else mark_placeholders(ids, starts[1:], patch)
        hidden = self.model(
            to_device(ids, torch.int64, dev),
            to_device(positions, torch.int64, dev),
            self.kv.layers,
            meta,
            self.kv.scales,
            prev,
        )
        last = to_device(starts[1:], torch.int64, dev) - 1
        out = RunnerOutput(self.model.compute_logits(hidden[last]))
        for i, s in enumerate(step.scheduled):
            if s.seq.params.prompt_logprobs is not None and s.seq.in_prefill:
                out.prompt_hidden[i] = hidden[starts[i] : starts[i + 1]]
        return out
