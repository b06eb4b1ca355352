"""Decode steps as CUDA graphs.

At load, the model's decode forward (one token per sequence, logits included) is captured
once per batch size of ``batch_sizes``, from the largest down, into one shared memory pool.
Every graph writes its float32 logits into the first rows of one (largest batch, vocab)
buffer: a graph's output outlives its capture, so per-graph outputs would each hold pool
memory (on Llama-3.1-8B with graphs up to 2,048 rows, 19 GB of logits; an H100 ran out
of memory capturing them). A decode step of B sequences replays the smallest graph of at
least B rows; the padding
rows read and write only the KV cache's null block (``KVCache.null_block``), so they cost
a little arithmetic and touch no live block.

All inputs live in static device buffers; each step fills pinned host buffers in place and
copies them over asynchronously, so preparing a step costs no allocation and no host
synchronization. Only the used columns of the block table are copied."""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch import nn

from kiln.kernels.attention import AttentionMetadata
from kiln.kernels.partials import split_sums_deferred
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.scheduler import SchedulerOutput


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, every 32 up to 512, every 64 beyond; always
    ending at ``max_batch_size``. Padding stays under 12.5 % above 16 sequences."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]
    sizes += range(576, max(576, max_batch_size) + 1, 64)
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv: KVCache,
        device: torch.device,
        max_seq_len: int,
        batch_sizes: list[int],
    ) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.max_seq_len = max_seq_len
        self.batch_sizes = sorted(set(batch_sizes))
        n = self.batch_sizes[-1]
        width = -(-max_seq_len // kv.tokens_per_block)
        self.max_batch = n

        def buffers(dtype: torch.dtype, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, pin_memory=True),
            )

        self.ids, self.h_ids = buffers(torch.int64, n)
        self.pos, self.h_pos = buffers(torch.int64, n)
        self.slots, self.h_slots = buffers(torch.int64, n)
        self.lens, self.h_lens = buffers(torch.int32, n)
        self.tables, self.h_tables = buffers(torch.int32, n, width)
        self.starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.np_tables = self.h_tables.numpy()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # every graph's output: its first rows
        self.pool = None
        self._copied: torch.cuda.Event | None = None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.starts[: b + 1],
            seq_lens=self.lens[:b],
            block_tables=self.tables[:b],
            slot_mapping=self.slots[:b],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
            decode_only=True,
            max_seq_len=self.max_seq_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        # an fp8 cache's scales: a static device tensor, read in place by every replay
        with split_sums_deferred():  # warm-up and capture alike (kiln.kernels.partials)
            hidden = self.model(
                self.ids[:b], self.pos[:b], self.kv.layers, self._meta(b), self.kv.scales
            )
        out = None if self.logits is None else self.logits[:b]
        return self.model.compute_logits(hidden, out)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size (largest first, so smaller graphs reuse its pool)."""
        null = self.kv.null_block
        self.slots.fill_(null * self.kv.tokens_per_block)
        self.lens.fill_(1)
        self.tables.fill_(null)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile every Triton kernel and warm cuBLAS outside capture
                widest = self._forward(self.batch_sizes[-1]).shape
                self._forward(self.batch_sizes[0])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if self.logits is None:
            self.logits = torch.empty(widest, dtype=torch.float32, device=self.device)
        for b in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def fits(self, step: SchedulerOutput) -> bool:
        return (
            bool(self.graphs)
            and step.num_prefill_tokens == 0
            and len(step.scheduled) <= self.max_batch
            and all(s.num_new_tokens == 1 for s in step.scheduled)
        )

    def run(self, step: SchedulerOutput, patch: Any = None) -> torch.Tensor:
        """Replay the graph for a decode-only step; (B, vocab) float32 logits (a view into
        the graph's output, valid until the next replay)."""
        if self._copied is not None:  # the previous step's copies still read the pinned buffers
            self._copied.synchronize()
        b = len(step.scheduled)
        g = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        bs = self.kv.tokens_per_block
        null_slot = self.kv.null_block * bs
        ids, pos, slots, lens = [], [], [], []
        tables = self.np_tables
        width = 1
        for i, s in enumerate(step.scheduled):
            seq = s.seq
            p = seq.num_computed
            ids.append(seq.tokens(p, p + 1)[0])
            pos.append(p)
            blocks = seq.block_ids
            slots.append(blocks[p // bs] * bs + p % bs)
            lens.append(p + 1)
            n = len(blocks)
            tables[i, :n] = blocks
            width = max(width, n)
        pad = g - b
        self.h_ids[:g] = torch.tensor(ids + [0] * pad)
        self.h_pos[:g] = torch.tensor(pos + [0] * pad)
        self.h_slots[:g] = torch.tensor(slots + [null_slot] * pad)
        self.h_lens[:g] = torch.tensor(lens + [1] * pad)
        tables[b:g, 0] = self.kv.null_block
        for dev, host in (
            (self.ids, self.h_ids),
            (self.pos, self.h_pos),
            (self.slots, self.h_slots),
            (self.lens, self.h_lens),
        ):
            dev[:g].copy_(host[:g], non_blocking=True)
        self.tables[:g, :width].copy_(self.h_tables[:g, :width], non_blocking=True)
        if patch is not None:  # tokens sampled by the step still in flight
            from kiln.runtime.runner import apply_patch

            apply_patch(self.ids, list(range(g + 1)), patch)
        # the next step may rewrite the pinned buffers once these copies are done (not the
        # replay: waiting for that would stall the host behind the GPU)
        self._copied = torch.cuda.current_stream(self.device).record_event()
        graph, logits = self.graphs[g]
        graph.replay()
        return logits[:b]
