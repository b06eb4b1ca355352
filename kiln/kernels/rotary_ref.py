"""The torch references of rotary position embedding (half-split, Hugging Face layout),
alone and fused with the paged KV-cache write; ``kiln.kernels.rotary`` holds the Triton
kernel, its launcher and the dispatcher, and re-exports these."""

from __future__ import annotations

import torch

from kiln.kernels.attention import KvScale, write_kv_ref
from kiln.kernels.hadamard import rotate_ref


def apply_rotary_ref(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hk, D)
    positions: torch.Tensor,  # (T,) int64
    cos_sin: torch.Tensor,  # (max_positions, D) float32: [cos(f) | sin(f)], f = pos * inv_freq
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions; computed in float32, returned in the input dtype."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # (T, D)
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1).unsqueeze(1)  # (T, 1, D)
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1).unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    return rot(q), rot(k)


apply_rotary = apply_rotary_ref


def rotary_write_kv_ref(
    qkv: torch.Tensor,  # (T, (Hq + 2 Hk) * D): the fused projection, laid out [q | k | v]
    positions: torch.Tensor,  # (T,) int64
    cos_sin: torch.Tensor,  # (max_positions, D) float32
    kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = do not write this token
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: KvScale = None,  # an fp8 cache's (k, v) scales
    kv_rotation: torch.Tensor | None = None,  # (D, D) Hadamard signs, or None
) -> torch.Tensor:
    """Rotate q and k (``apply_rotary_ref``), write rotated k and raw v to the cache
    (``write_kv_ref``, skipping slots of -1; an fp8 cache quantizes them from the input
    dtype) and return the rotated q, (T, Hq, D). With ``kv_rotation``, q and k are then also
    multiplied by the same orthogonal Hadamard matrix (``rotate_ref``, from their rounded
    rotary values): q . k is unchanged, while k's channels are mixed, so that an fp8 cache's
    rounding errors no longer line up with the few channels that dominate the scores."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(t, num_heads, head_dim)
    k = k.view(t, num_kv_heads, head_dim)
    v = v.view(t, num_kv_heads, head_dim)
    q, k = apply_rotary_ref(q, k, positions, cos_sin)
    if kv_rotation is not None:
        q, k = rotate_ref(q, kv_rotation), rotate_ref(k, kv_rotation)
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # a host sync: fine for the reference, never graph-captured
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    write_kv_ref(k, v, kv_cache, slot_mapping, kv_scale)
    return q
