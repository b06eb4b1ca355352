"""The paged KV cache: one tensor per layer and a free list of block ids.
(Reference counts and prefix reuse arrive with the in-flight batching runtime.)"""

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
        shape = (2, num_blocks, tokens_per_block, cfg.num_key_value_heads, cfg.head_dim)
        # (2, blocks, tokens_per_block, Hk, D) per layer: [0] keys, [1] values
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache has {len(self._free)} free blocks, {n} requested")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()
