"""fp8 x fp8 skinny matmul for one to four rows: ``y = (xq @ wq.T) * sx * sw (+ bias)``
with e4m3 activations (one scale per row, or one for all) and e4m3 weights (one scale per
output channel): the products of ``torch._scaled_mm`` with row-wise scales, for decode
steps where that call, built for large tiles, reads the weight slower than the bf16
skinny kernel reads one twice its size (fp8 batch-1 decode measured 5.17 ms against bf16's
4.55 on the H200).

It is the skinny kernel (``kiln.kernels.gemv``) on its broadcast-multiply path with
``SCALED``: e4m3 codes widen to float32 exactly, their products are exact in float32 and
are summed in float32, then each output is multiplied by its row's and column's scales;
split-K partials are scaled before the fixed-order sum, and the bias comes last.

Chosen by measurement: the build's tuner times these configurations (and the tensor-core
kernel's, ``kiln.kernels.fp8_mma``, ``MMA`` in a configuration) against
``torch._scaled_mm`` per fp8 projection shape at 1, 4, 8, 16 and 32 rows
(``kiln.build.tuning``) and records ``{"scaled_mm": true}`` where that is faster; without a
tuning (or beyond the largest tuned row count, or ``FP8_SMALL_MAX_M``) the dispatcher keeps
``torch._scaled_mm``."""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

from kiln.errors import env_int
from kiln.kernels import pdl
from kiln.kernels._triton import INTERPRET
from kiln.kernels.fp8_mma import MAX_M, fp8_mma
from kiln.kernels.gemv import (
    _FMA_MAX_BLOCK_M,
    _m_bucket,
    _skinny_kernel,
    split_k_reduce,
    split_options,
)
from kiln.kernels.tuning import tuned

FP8_SKINNY_MAX_M = _FMA_MAX_BLOCK_M
"""Rows the skinny kernel takes (its float32 accumulator holds at most four)."""
FP8_SMALL_MAX_M = MAX_M
"""Rows a tuned pick may take: the tensor-core kernel's (``fp8_mma.MAX_M``)."""
ENABLED = env_int(os.environ, "KILN_FP8_SKINNY", 1, range(2))
"""``KILN_FP8_SKINNY=0``: ``torch._scaled_mm`` everywhere, whatever the tuning picked."""


def fp8_skinny_ref(
    xq: torch.Tensor,  # (M, K) e4m3
    sx: torch.Tensor,  # (M, 1) or (1, 1) float32
    wq: torch.Tensor,  # (N, K) e4m3
    sw: torch.Tensor,  # (N,) or (N, 1)
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The kernel's arithmetic in torch: float32 products and sums, then the scales, then
    the bias, rounded once to ``out_dtype``."""
    y = (xq.float() @ wq.float().t()) * sx.float() * sw.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_skinny_candidates(n: int, k: int, m: int, num_sms: int = 132) -> list[dict[str, Any]]:
    """Configurations for the tuner at shape (m, n, k): broadcast-multiply tiles of one-byte
    weights (K tiles twice the bf16 kernel's for the same bytes), within 64 float32
    accumulator registers a thread, each with split-K of 1 and the powers of two that give
    1x, 2x and 4x as many programs as SMs (at least two K tiles per split)."""
    bm = min(_m_bucket(m), _FMA_MAX_BLOCK_M)
    out = []
    for bn, bk, warps in ((8, 512, 4), (16, 512, 8), (8, 1024, 8), (4, 1024, 4),
                          (4, 2048, 8), (16, 256, 4), (2, 2048, 4)):  # fmt: skip
        bn = max(2, bn // bm)
        if bn * bm * bk > 64 * 32 * warps:
            continue
        for s in split_options(n, k, bn, bk, num_sms):
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": warps}
            if cfg not in out:
                out.append(cfg)
    return out


def fp8_skinny_config(n: int, k: int, m: int) -> dict[str, Any] | None:
    """The tuned configuration for shape (m, n, k) at the smallest tuned row count >= m,
    or None (``torch._scaled_mm``): untuned shapes, ``{"scaled_mm": true}`` picks, more
    rows than the largest tuned count (an engine tuned before the tensor-core kernel took
    16 and 32 rows) or than ``FP8_SMALL_MAX_M``, and skinny-kernel picks past
    ``FP8_SKINNY_MAX_M``."""
    if m > FP8_SMALL_MAX_M or not ENABLED:
        return None
    by_m = tuned("fp8_skinny")["by_shape"].get(f"{n}x{k}")
    if not by_m:
        return None
    ms = sorted(int(r) for r in by_m)
    if m > ms[-1]:
        return None
    cfg = by_m[str(next(r for r in ms if r >= m))]
    if cfg.get("scaled_mm") or (m > FP8_SKINNY_MAX_M and not cfg.get("MMA")):
        return None
    return cfg


def fp8_skinny_triton(
    xq: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: dict[str, Any],
) -> torch.Tensor:
    """Same contract as ``fp8_skinny_ref``, for at most ``FP8_SKINNY_MAX_M`` rows; xq and
    wq unit-stride along K, sx float32 with one entry per row or one in all. A
    configuration with ``MMA`` runs ``kiln.kernels.fp8_mma`` instead."""
    if config.get("MMA"):  # the tensor-core kernel (``kiln.kernels.fp8_mma``), <= 32 rows
        return fp8_mma(xq, sx, wq, sw, bias, out_dtype, config)
    m, k = xq.shape
    n = wq.shape[0]
    if m > FP8_SKINNY_MAX_M or wq.shape[1] != k or xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError(
            f"fp8 skinny matmul: x {tuple(xq.shape)}, w {tuple(wq.shape)}: at most "
            f"{FP8_SKINNY_MAX_M} rows, equal K, unit stride along K"
        )
    if sx.numel() not in (1, m) or sx.dtype != torch.float32 or sw.numel() != n:
        raise ValueError(f"fp8 skinny matmul: scales {tuple(sx.shape)} {sx.dtype} and "
                         f"{tuple(sw.shape)}: float32 per row or one, one per column")  # fmt: skip
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    block_m = min(_m_bucket(m), FP8_SKINNY_MAX_M)
    tiles = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(tiles, max(1, min(config["SPLIT_K"], tiles))) * block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    sx = sx.reshape(-1)
    _skinny_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))](
        xq, wq, bias if bias is not None else out, out, part, sx, sw.reshape(-1),
        m, n, k, xq.stride(0), wq.stride(0), out.stride(0), 1 if sx.numel() == m else 0,
        k_per_split, K_PER_SPLIT=k_per_split if INTERPRET else 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, DOT=False,
        EVEN_K=k_per_split * split == k, HAS_BIAS=bias is not None, PRECISION="ieee",
        UPCAST=False, SCALED=True, num_warps=config["num_warps"], num_stages=2,
        **pdl.dependent_kwargs(xq),
    )  # fmt: skip
    if split > 1:
        split_k_reduce(part, out, bias)
    return out
