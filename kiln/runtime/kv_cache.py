"""The paged KV cache tensors: one per layer. Which block holds what is the block
manager's business (block_manager.py).

With ``kv_dtype="fp8"`` the cache stores float8 e4m3 values and ``scales`` holds each
layer's two float32 scales (k, v): a value is ``stored * scale``. The scales are fixed for
the engine's life (calibrated at build time by ``calibrate_kv_scales``, or 1.0)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kiln.config import ModelConfig
from kiln.kernels.attention import FP8_MAX, KV_FP8, AttentionMetadata

KV_DTYPES = (None, "fp8")


def kv_storage_dtype(dtype: torch.dtype, kv_dtype: str | None) -> torch.dtype:
    """The cache tensors' dtype: float8 e4m3 for ``"fp8"``, else the engine dtype."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
    return KV_FP8 if kv_dtype == "fp8" else dtype


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in bytes (``dtype``: the storage dtype)."""
    return 2 * cfg.num_hidden_layers * cfg.kv_size * dtype.itemsize


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str | None = None,
        scales: Sequence[Sequence[float]] | None = None,
    ) -> None:
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        # one more block than the block manager hands out: padding rows of a CUDA-graph
        # batch write their K/V there and read only it, so they never touch a live block
        self.null_block = num_blocks
        self.kv_dtype = kv_dtype
        self.dtype = kv_storage_dtype(dtype, kv_dtype)
        shape = (2, num_blocks + 1, tokens_per_block, cfg.num_key_value_heads, cfg.head_dim)
        # (2, blocks + 1, tokens_per_block, Hk, D) per layer: [0] keys, [1] values
        self.layers = [
            torch.zeros(shape, dtype=self.dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]
        # (num_layers, 2) float32 (k, v) scales of an fp8 cache, a static device tensor (CUDA
        # graphs read it in place); None for a cache in the engine dtype
        self.scales: torch.Tensor | None = None
        if kv_dtype == "fp8":
            n = cfg.num_hidden_layers
            pairs = [(1.0, 1.0)] * n if scales is None else [tuple(p) for p in scales]
            if len(pairs) != n or any(len(p) != 2 or not min(p) > 0 for p in pairs):
                raise ValueError(f"kv scales: {n} positive (k, v) pairs needed, got {scales!r}")
            self.scales = torch.tensor(pairs, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes the cache's layers hold (the null block included; the scales are not)."""
        return sum(t.numel() * t.element_size() for t in self.layers)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's keys and values in every layer (copy-on-write of a fork)."""
        for layer in self.layers:
            layer[:, dst] = layer[:, src]


@torch.inference_mode()
def calibrate_kv_scales(
    model: nn.Module,
    token_ids: Sequence[int] | Sequence[Sequence[int]],
    tokens_per_block: int = 32,
) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) for an fp8 KV cache: the amax of K (after rotary) and of
    V over every token of ``token_ids`` (one sequence of ids, or several), divided by 448.
    The model runs in its own dtype over a cache in that dtype, each sequence as one prompt;
    K and V are read back from the cache, which holds exactly what attention would store.
    A layer whose K or V is all zero gets the scale 1.0."""
    seqs = [list(token_ids)] if token_ids and isinstance(token_ids[0], int) else token_ids
    seqs = [list(s) for s in seqs if len(s) > 0]  # type: ignore[arg-type]
    if not seqs:
        raise ValueError("calibrate_kv_scales needs at least one token")
    p = next(model.parameters())
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    amax = torch.zeros(cfg.num_hidden_layers, 2, dtype=torch.float32, device=p.device)
    for ids in seqs:
        t, bs = len(ids), tokens_per_block
        nb = -(-t // bs)
        kv = KVCache(cfg, nb, bs, p.dtype, p.device)
        dev = p.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(t, dtype=torch.int64, device=dev),
            query_start_loc_cpu=[0, t],
            seq_lens_cpu=[t],
        )
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        model(ids_t, torch.arange(t, device=dev), kv.layers, meta)
        for i, layer in enumerate(kv.layers):
            flat = layer.view(2, -1, cfg.kv_size)[:, :t].float().abs()  # (2, T, Hk * D)
            amax[i] = torch.maximum(amax[i], flat.amax(dim=(1, 2)))
    scales = (amax / FP8_MAX).tolist()
    return [(k if k > 0 else 1.0, v if v > 0 else 1.0) for k, v in scales]
