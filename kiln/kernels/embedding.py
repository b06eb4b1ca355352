"""Token embedding lookup that also resolves placeholders: Triton kernel, launcher,
reference and dispatcher.

With overlapped stepping the host launches a step before it has read the tokens the step
before sampled; those stay on the device. A step's input id ``-(r + 1)`` stands for "the
token in row ``r`` of ``prev``" (the previous step's sampled tokens), so the lookup reads
it there: no patching of the ids before the model runs (which took two host-to-device
copies and two kernels a step outside the CUDA graphs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels._triton import use_triton


def placeholder(row: int) -> int:
    """The input id that stands for row ``row`` of ``prev``."""
    return -(row + 1)


def resolve_ids_ref(ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """(T,) ids with placeholders replaced by their tokens from ``prev``."""
    rows = (-ids - 1).clamp(min=0, max=max(prev.numel() - 1, 0))
    return torch.where(ids >= 0, ids, prev[rows] if prev.numel() else ids)


def embed_ref(
    ids: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None = None
) -> torch.Tensor:
    """(T,) int64 ids (placeholders allowed where ``prev`` is given) -> (T, H) rows of
    ``weight``."""
    if prev is not None:
        ids = resolve_ids_ref(ids, prev)
    return F.embedding(ids, weight)


@triton.jit
def _embed_kernel(ids_ptr, prev_ptr, w_ptr, out_ptr, hidden, stride_w, stride_o,
                  BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    tok = tl.load(ids_ptr + t)
    if tok < 0:  # a placeholder: the previous step's token at row -tok - 1
        tok = tl.load(prev_ptr - tok - 1)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    row = tl.load(w_ptr + tok.to(tl.int64) * stride_w + offs, mask=mask)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, row, mask=mask)


def embed_triton(ids: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``embed_ref``'s contract; ``ids`` and ``prev`` contiguous int64, ``weight``'s rows
    contiguous."""
    if ids.dtype != torch.int64 or prev.dtype != torch.int64:
        raise ValueError(f"ids and prev must be int64, got {ids.dtype} and {prev.dtype}")
    t, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty(t, hidden, dtype=weight.dtype, device=weight.device)
    if t == 0:
        return out
    block = min(triton.next_power_of_2(hidden), 1024)
    grid = (t, triton.cdiv(hidden, block))
    _embed_kernel[grid](ids.contiguous(), prev.contiguous(), weight, out, hidden,
                        weight.stride(0), out.stride(0), BLOCK=block, num_warps=4)  # fmt: skip
    return out


def embed(
    ids: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None = None
) -> torch.Tensor:
    """The dispatcher: ``F.embedding`` without placeholders; with ``prev``, the Triton
    kernel on CUDA (one launch, no host synchronization), else the reference."""
    if prev is None:
        return F.embedding(ids, weight)
    if use_triton(weight) and weight.stride(1) == 1:
        return embed_triton(ids, weight, prev)
    return embed_ref(ids, weight, prev)
