"""The model runner: turns one ``SchedulerOutput`` into flattened model inputs and
attention metadata, runs the model, and returns logits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.kernels.attention import AttentionMetadata
from kiln.runtime.cuda_graphs import DecodeGraphs
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    last_logits: torch.Tensor
    """(num_scheduled, vocab) float32: logits of each scheduled sequence's last new token."""
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """Batch index -> (num_new_tokens, vocab) float32 logits of every new token, for the
    sequences that asked for prompt logprobs."""


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

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        if self.graphs is not None and self.graphs.fits(step):
            self.graph_steps += 1
            return RunnerOutput(self.graphs.run(step))
        self.eager_steps += 1
        return self._eager(step)

    def _eager(self, step: SchedulerOutput) -> RunnerOutput:
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
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv.layers,
            meta,
        )
        last = torch.tensor(starts[1:], device=dev) - 1
        out = RunnerOutput(self.model.compute_logits(hidden[last]))
        for i, s in enumerate(step.scheduled):
            if s.seq.params.prompt_logprobs is not None and s.seq.in_prefill:
                out.prompt_logits[i] = self.model.compute_logits(hidden[starts[i] : starts[i + 1]])
        return out
