"""The Hadamard rotation of an fp8 KV cache's keys (and the matching queries): the
Sylvester matrix of +-1, when a head size allows it, and the torch reference of the
rotation (``kiln.kernels.rotary`` fuses it into the cache write)."""

from __future__ import annotations

import torch


def kv_rotation_allowed(head_dim: int) -> bool:
    """The KV rotation needs a power-of-two head size of at least 32 (the kernel's dot tiles
    are half a head wide and at least 16)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def hadamard_signs(d: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """The (d, d) Sylvester Hadamard matrix of +-1 (d a power of two): symmetric, and
    orthogonal once divided by sqrt(d). Exact in any float dtype."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim {d}: a Hadamard rotation needs a power of two")
    i = torch.arange(d)
    parity = torch.zeros(d, d, dtype=torch.int64)
    x = i[:, None] & i[None, :]
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return (1 - 2 * parity).to(device=device, dtype=dtype)


def rotate_ref(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x (..., D) times the orthogonal Hadamard matrix ``signs / sqrt(D)``, in float32,
    rounded once to x's dtype."""
    return (x.float() @ signs.float() * x.shape[-1] ** -0.5).to(x.dtype)
