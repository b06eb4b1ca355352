"""Helpers shared by tests."""

from __future__ import annotations

import torch

from kiln.build.loader import LoadedEngine
from kiln.kernels.attention import AttentionMetadata
from kiln.runtime.kv_cache import KVCache


@torch.inference_mode()
def prefill_logits(
    engine: LoadedEngine, ids: list[int], tokens_per_block: int = 16
) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of every prompt position, one sequence, one step."""
    dev = engine.device
    n = len(ids)
    kv = KVCache(engine.config, -(-n // tokens_per_block), tokens_per_block, engine.dtype, dev)
    blocks = list(range(kv.num_blocks))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    hidden = engine.model(
        torch.tensor(ids, device=dev), torch.arange(n, device=dev), kv.layers, meta
    )
    return engine.model.compute_logits(hidden)
