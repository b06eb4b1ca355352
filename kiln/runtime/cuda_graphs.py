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

Inputs: per batch size one static int64 region of the device (ids, positions, slots,
then lengths as int32), filled from one pinned host buffer in one asynchronous copy, and
one block table shared by every size, of which only the used columns are copied, and
only when a row changed. A
sequence whose last token the previous step sampled and the host has not read yet
(overlapped stepping) gets the placeholder id of that token's row (``kiln.kernels.
embedding``), which the graph's embedding reads from ``prev``, the buffer the sampler
writes its tokens into. So a step costs one or two host-to-device copies and the replay:
no allocation, no host synchronization and no kernels of its own.
"""

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


def _even(g: int) -> int:
    return g + (g & 1)


class GraphInputs:
    """The graphs' static inputs (see the module docstring), and the host side that fills
    them each step. On the CPU too (no pinned memory there), for tests."""

    def __init__(self, batch_sizes: list[int], width: int, device: torch.device) -> None:
        self.device = device
        self.offsets: dict[int, int] = {}
        at = 0
        for g in batch_sizes:  # four fields of an even count: each 16-byte aligned, as
            self.offsets[g], at = at, at + 4 * _even(g)  # Triton's eager variants take them
        n = max(batch_sizes)
        pin = device.type == "cuda"
        self.region = torch.zeros(at, dtype=torch.int64, device=device)
        self.host = torch.zeros(4 * _even(n), dtype=torch.int64, pin_memory=pin)
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.h_tables = torch.zeros(n, width, dtype=torch.int32, pin_memory=pin)
        self.np_tables = self.h_tables.numpy()
        self._rows: list[list[int] | None] = [None] * n  # each host table row's blocks
        # the device table holds the host's rows [:_sent[0]] and columns [:_sent[1]] as
        # they were at the last copy; _dirty: a host row changed since
        self._sent, self._dirty = (0, 0), True
        self.table_copies = self.table_skips = 0
        self.prev = torch.zeros(n, dtype=torch.int64, device=device)
        """The previous step's sampled tokens, which placeholder ids stand for."""

    def views(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch size ``g``'s (ids, positions, slots) int64 and lengths int32, each (g,)."""
        e = _even(g)
        r = self.region[self.offsets[g] : self.offsets[g] + 4 * e]
        return r[:g], r[e : e + g], r[2 * e : 2 * e + g], r[3 * e :].view(torch.int32)[:g]

    def reset(self, null_block: int, tokens_per_block: int) -> None:
        """Every size's padding state: token 0 at position 0, slot and table in the null
        block, length 1."""
        for g in self.offsets:
            ids, pos, slots, lens = self.views(g)
            ids.zero_()
            pos.zero_()
            slots.fill_(null_block * tokens_per_block)
            lens.fill_(1)
        self.tables.fill_(null_block)
        self._rows = [None] * len(self._rows)
        self._sent, self._dirty = (0, 0), True

    def fill(self, step: SchedulerOutput, g: int, null_block: int, bs: int, patch: Any) -> int:
        """Write ``step``'s inputs, padded to ``g`` rows, into the host buffers; returns the
        block table's used width. ``patch``: ``kiln.runtime.runner.Patch``; its tokens
        must be ``prev`` or fit in it (they are copied there, on the device)."""
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
            if self._rows[i] != blocks:  # else the host row holds them already (a list
                tables[i, :n] = blocks  # compare is cheaper than numpy's conversion)
                self._rows[i] = list(blocks)
                self._dirty = True
            width = max(width, n)
        b = len(ids)
        if patch is not None:
            from kiln.runtime.runner import mark_placeholders

            tokens = mark_placeholders(ids, list(range(1, b + 1)), patch)
            if tokens.data_ptr() != self.prev.data_ptr():  # sampled outside the buffer
                self.prev[: tokens.numel()].copy_(tokens, non_blocking=True)
        e, pad = _even(g), g - b
        tail = e - b  # the padding rows, and the alignment slot past an odd g
        self.host[: 3 * e] = torch.tensor(
            ids + [0] * tail + pos + [0] * tail + slots + [null_block * bs] * tail
        )
        self.host[3 * e : 4 * e].view(torch.int32)[:g] = torch.tensor(lens + [1] * pad)
        if any(r is not None for r in self._rows[b:g]):  # rows that held blocks: padding
            self._dirty = True
        tables[b:g, 0] = null_block
        self._rows[b:g] = [None] * (g - b)
        return width

    def send(self, g: int, width: int) -> None:
        """The asynchronous copies: batch size ``g``'s region, and the table's columns
        unless the device holds them already (no host row changed since a copy that
        covered them: at one sequence, 15 of 16 steps with 16-token blocks)."""
        at, e = self.offsets[g], _even(g)
        self.region[at : at + 4 * e].copy_(self.host[: 4 * e], non_blocking=True)
        if not self._dirty and g <= self._sent[0] and width <= self._sent[1]:
            self.table_skips += 1
            return
        self.tables[:g, :width].copy_(self.h_tables[:g, :width], non_blocking=True)
        self._sent, self._dirty = (g, width), False
        self.table_copies += 1


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
        self.max_batch = self.batch_sizes[-1]
        width = -(-max_seq_len // kv.tokens_per_block)
        self.inputs = GraphInputs(self.batch_sizes, width, device)
        self.starts = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # every graph's output: its first rows
        self.pool = None
        self._copied: torch.cuda.Event | None = None

    def _meta(self, b: int) -> AttentionMetadata:
        _, _, slots, lens = self.inputs.views(b)
        return AttentionMetadata(
            query_start_loc=self.starts[: b + 1],
            seq_lens=lens,
            block_tables=self.inputs.tables[:b],
            slot_mapping=slots,
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
            decode_only=True,
            max_seq_len=self.max_seq_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        # an fp8 cache's scales: a static device tensor, read in place by every replay
        ids, pos, _, _ = self.inputs.views(b)
        with split_sums_deferred():  # warm-up and capture alike (kiln.kernels.partials)
            hidden = self.model(
                ids, pos, self.kv.layers, self._meta(b), self.kv.scales, self.inputs.prev,
                head_input=True,
            )  # fmt: skip
        out = None if self.logits is None else self.logits[:b]
        return self.model.compute_logits(hidden, out)

    @torch.inference_mode()
    def forward_each(self) -> None:
        """One forward at every batch size on the padding state, uncaptured: the Triton
        variants the capture will launch (a load's dry run, ``kiln.runtime.warmup``)."""
        self.inputs.reset(self.kv.null_block, self.kv.tokens_per_block)
        for b in self.batch_sizes:
            self._forward(b)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size (largest first, so smaller graphs reuse its pool)."""
        self.inputs.reset(self.kv.null_block, self.kv.tokens_per_block)
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

    def fits(self, step: SchedulerOutput, patch: Any = None) -> bool:
        """A decode-only step of at most ``max_batch`` sequences whose placeholders' tokens
        (``patch``), if any, fit in ``prev``."""
        return (
            bool(self.graphs)
            and step.num_prefill_tokens == 0
            and len(step.scheduled) <= self.max_batch
            and all(s.num_new_tokens == 1 for s in step.scheduled)
            and (patch is None or patch[2].numel() <= self.max_batch)
        )

    def token_buffer(self, n: int) -> torch.Tensor | None:
        """Where the sampler should write a step's ``n`` tokens: the start of ``prev``, if
        they fit (the next replay then reads them in place)."""
        return self.inputs.prev[:n] if n <= self.max_batch else None

    def run(self, step: SchedulerOutput, patch: Any = None) -> torch.Tensor:
        """Replay the graph for a decode-only step; (B, vocab) float32 logits (a view into
        the graph's output, valid until the next replay)."""
        if self._copied is not None:  # the previous step's copies still read the pinned buffers
            self._copied.synchronize()
        b = len(step.scheduled)
        g = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        bs = self.kv.tokens_per_block
        width = self.inputs.fill(step, g, self.kv.null_block, bs, patch)
        self.inputs.send(g, width)
        # the next step may rewrite the pinned buffers once these copies are done (not the
        # replay: waiting for that would stall the host behind the GPU)
        if self.device.type == "cuda":  # (tests replay stand-ins on the CPU)
            self._copied = torch.cuda.current_stream(self.device).record_event()
        graph, logits = self.graphs[g]
        graph.replay()
        return logits[:b]
