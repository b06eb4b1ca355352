"""The model runner: turns one step's (sequence, number of new tokens) pairs into flattened
model inputs and attention metadata, runs the model, and returns next-token logits."""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.attention import AttentionMetadata
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv_cache, device

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute ``n`` new tokens of each sequence (from its ``num_computed``); return
        (len(batch), vocab) float32 logits of each sequence's last computed token."""
        bs = self.kv.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq, n in batch:
            lo, hi = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[lo:hi])
            positions.extend(range(lo, hi))
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(lo, hi))
            starts.append(starts[-1] + n)
            seq_lens.append(hi)
        width = max(len(seq.block_ids) for seq, _ in batch)
        tables = [seq.block_ids + [0] * (width - len(seq.block_ids)) for seq, _ in batch]
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
        return self.model.compute_logits(hidden[last])
