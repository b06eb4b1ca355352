"""The paged KV cache tensors: one per layer. Which block holds what is the block
manager's business (block_manager.py)."""

from __future__ import annotations

import torch

from kiln.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in bytes."""
    return 2 * cfg.num_hidden_layers * cfg.kv_size * dtype.itemsize


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        # one more block than the block manager hands out: padding rows of a CUDA-graph
        # batch write their K/V there and read only it, so they never touch a live block
        self.null_block = num_blocks
        shape = (2, num_blocks + 1, tokens_per_block, cfg.num_key_value_heads, cfg.head_dim)
        # (2, blocks + 1, tokens_per_block, Hk, D) per layer: [0] keys, [1] values
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's keys and values in every layer (copy-on-write of a fork)."""
        for layer in self.layers:
            layer[:, dst] = layer[:, src]
