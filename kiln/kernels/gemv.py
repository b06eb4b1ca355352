"""Skinny matmul ``y = x @ w.T (+ bias)`` for a few rows of x (small-batch decode): Triton
kernel, its launcher, the torch reference, and the ``linear`` dispatcher the layers call.

At batch sizes of 1..16 a projection is bound by reading its weight ``w`` (N, K) once, so
the kernel is built to stream ``w`` at the memory's bandwidth:

- grid (N / BLOCK_N, SPLIT_K, M / BLOCK_M): each program owns BLOCK_N output columns (rows
  of ``w``) and a slice of K. ``w`` is read in (BLOCK_N, BLOCK_K) tiles along K, which is
  contiguous, so the loads are wide and coalesced; x is tiny and is re-read from L1/L2.
  Rows of the last column block past N are clamped to row N - 1 (their results are never
  stored), so ``w`` loads need no row mask;
- two inner products, chosen by the ``DOT`` constexpr: ``tl.dot(w_tile, x_tile.T)`` with
  the rows of x padded to 16 (tensor cores; ``w`` is the MMA's large operand, so BLOCK_N of
  64 or more allows Hopper's wgmma), or, for one to four rows, a broadcast multiply into a
  float32 (BLOCK_N, BLOCK_M, BLOCK_K) accumulator that is summed over K once at the end;
- split-K is deterministic: with SPLIT_K > 1 every split writes its float32 partial sums
  to a buffer and a second kernel adds them in a fixed order (then the bias), so results
  do not depend on scheduling. With SPLIT_K = 1 the first kernel writes the output.

Accumulation is in float32 throughout; float32 inputs use full-precision ("ieee") dots.
No host synchronization and only data-independent allocations: CUDA-graph capturable.

Launch configurations come from ``kiln.kernels.tuning`` (``skinny_matmul.by_shape``,
filled by the build-time tuner from ``skinny_config_candidates``) or else from
``skinny_default_config``, a heuristic for an H200."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels import pdl
from kiln.kernels._triton import INTERPRET, use_triton
from kiln.kernels.tuning import tuned

SKINNY_MAX_M = 16
"""The dispatcher sends inputs with at most this many rows to the skinny kernel."""
_DOT_MIN_M = 16  # tl.dot needs every dimension >= 16: rows of x are padded to this
_FMA_MAX_BLOCK_M = 4  # the broadcast-multiply path keeps BLOCK_M rows in its accumulator
_REDUCE_BLOCK = 1024


def skinny_matmul_ref(
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """``F.linear`` computed in float32 (inputs widened exactly, float32 accumulation, bias
    added in float32) and rounded once to x's dtype: the kernel's semantics. (The CPU
    path of ``linear`` is plain ``F.linear``, which for float32 inputs is the same.)"""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), w.float(), b).to(x.dtype)


@triton.jit
def _store_result(acc, offs_n, offs_m, b_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                  SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The skinny kernels' epilogue: a (BLOCK_N, BLOCK_M) float32 tile of y.T, written to
    the output (plus the bias) with one split, else to split ``pid_k``'s partial sums."""
    n_ok = offs_n < N
    mask = n_ok[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = part_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    sx_ptr,
    sw_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_sx,
    k_per_split,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl.pdl_enter(PDL, PDL)  # kiln.kernels.pdl: the launches overlap the grids before
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + rn
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    k_lo = pid_k * k_per_split
    # rows past N read row N - 1 (never stored), so that w's loads need no row mask; the
    # block's base offset is 64-bit (N * K may exceed 2^31), offsets within it 32-bit
    rows = tl.minimum(offs_n, N - 1) - pid_n * BLOCK_N
    w_base = w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn + k_lo
    w_ptrs = w_base + rows[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # (BLOCK_M, BLOCK_K)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    # compiled, the loop bound is a run-time value, so that every K shares one compiled
    # kernel; the interpreter needs a compile-time one (and no assignment of it, which
    # would make it a tensor)
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        # w is read once: evict it from L2 first, keeping x, partial sums and the rest
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k_lo + k + offs_k) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            if UPCAST:  # the interpreter multiplies bfloat16 dot operands as raw integers
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not DOT:
        acc = tl.sum(acc3, axis=2)  # (BLOCK_N, BLOCK_M)
    if SCALED:  # fp8 x and w (kiln.kernels.fp8_gemv): times the rows' and columns' scales
        sx = tl.load(sx_ptr + offs_m * stride_sx, mask=m_ok, other=0.0).to(tl.float32)
        sw = tl.load(sw_ptr + tl.minimum(offs_n, N - 1)).to(tl.float32)
        acc = acc * sw[:, None] * sx[None, :]
    _store_result(acc, offs_n, offs_m, b_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                  SPLIT_K, HAS_BIAS)  # fmt: skip


@triton.jit
def _split_k_reduce(
    part_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl.pdl_enter(PDL >= 1, PDL >= 2)  # kiln.kernels.pdl
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: deterministic
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_k_reduce(part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out`` (M, N) = the sum of the split-K partials ``part`` (SPLIT_K, M, N) float32, in
    split order (deterministic), plus ``bias``; one launch."""
    split, m, n = part.shape
    _split_k_reduce[(m, triton.cdiv(n, _REDUCE_BLOCK))](
        part, bias if bias is not None else out, out, m, n, out.stride(0), SPLIT_K=split,
        HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4, **pdl.kwargs(out),
    )  # fmt: skip


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # an H200 (the interpreter has no device to ask)
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 32)


def skinny_default_config(n: int, k: int, m: int, num_sms: int = 132) -> dict[str, Any]:
    """A heuristic launch configuration (untuned): 16-bit tiles of 16 KiB per stage, one row
    on the broadcast path and tensor cores otherwise, and split-K until there are about
    four programs per SM, keeping at least four K tiles per split."""
    dot = m > 1
    block_n, block_k = (32, 256) if dot else (16, 512)
    split, programs = 1, triton.cdiv(n, block_n)
    while programs * split * 2 <= 4 * num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "DOT": dot,
        "num_warps": 4,
        "num_stages": 4 if dot else 2,
    }


def split_options(n: int, k: int, block_n: int, block_k: int, num_sms: int = 132) -> list[int]:
    """Split-K counts for the tuner: 1, and the powers of two that give 1x, 2x and 4x as
    many programs as SMs over ``n / block_n`` column blocks, keeping at least two K tiles
    per split."""
    blocks = triton.cdiv(n, block_n)
    splits = {1}
    for target in (num_sms, 2 * num_sms, 4 * num_sms):
        s = triton.next_power_of_2(max(1, target // blocks))
        if s > 1 and k // s >= 2 * block_k:
            splits.add(s)
    return sorted(splits)


def skinny_config_candidates(n: int, k: int, m: int, num_sms: int = 132) -> list[dict[str, Any]]:
    """Configurations for the build-time tuner to time at shape (m, n, k): a few tile shapes
    of each inner product (the broadcast one for up to four rows only, within a register
    budget), each with split-K of 1 and the powers of two that give 1x, 2x and 4x as many
    programs as SMs (keeping at least two K tiles per split); the default comes first."""
    tiles = [  # (DOT, BLOCK_N, BLOCK_K, num_warps, num_stages)
        (True, 16, 256, 4, 4),
        (True, 32, 128, 4, 4),
        (True, 32, 256, 4, 3),
        (True, 32, 256, 4, 4),
        (True, 64, 128, 4, 4),
        (True, 64, 256, 8, 3),
        (True, 128, 128, 8, 3),
    ]
    if m <= _FMA_MAX_BLOCK_M:  # BLOCK_N for one row; fewer columns for more rows
        tiles += [
            (False, 8, 512, 4, 2),
            (False, 16, 256, 4, 2),
            (False, 16, 512, 4, 2),
            (False, 16, 512, 8, 2),
            (False, 32, 256, 8, 2),
            (False, 4, 1024, 4, 2),
        ]
    out = [skinny_default_config(n, k, m, num_sms)]
    for dot, bn, bk, warps, stages in tiles:
        bm = max(_DOT_MIN_M, _m_bucket(m)) if dot else min(_m_bucket(m), _FMA_MAX_BLOCK_M)
        if not dot:  # at most 64 float32 accumulator registers per thread
            bn = max(2, bn // bm)
            if bn * bm * bk > 64 * 32 * warps:
                continue
        for s in split_options(n, k, bn, bk, num_sms):
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "DOT": dot}
            cfg |= {"num_warps": warps, "num_stages": stages}
            if cfg not in out:
                out.append(cfg)
    return out


def skinny_config(n: int, k: int, m: int, num_sms: int = 132) -> dict[str, Any]:
    """The active configuration for shape (m, n, k): the tuned one for ``"{n}x{k}"`` at the
    smallest tuned row count >= m (else the largest tuned), or the default."""
    by_m = tuned("skinny_matmul")["by_shape"].get(f"{n}x{k}")
    if by_m:
        ms = sorted(int(r) for r in by_m)
        return by_m[str(next((r for r in ms if r >= m), ms[-1]))]
    return skinny_default_config(n, k, m, num_sms)


def skinny_matmul_triton(
    x: torch.Tensor,  # (M, K), unit stride along K
    w: torch.Tensor,  # (N, K), unit stride along K
    bias: torch.Tensor | None = None,  # (N,) contiguous
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Same contract as ``skinny_matmul_ref``; (M, N) in x's dtype. Correct for any M, fast
    for a few rows (w is streamed once per BLOCK_M rows). ``config`` overrides the active
    configuration (the tuner and benchmarks pass candidates)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1, "unit stride along K"
    assert w.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    cfg = config or skinny_config(n, k, m, _num_sms(x.device.index if x.is_cuda else None))
    dot, block_n, block_k = bool(cfg["DOT"]), cfg["BLOCK_N"], cfg["BLOCK_K"]
    block_m = max(_DOT_MIN_M, _m_bucket(m)) if dot else min(_m_bucket(m), _FMA_MAX_BLOCK_M)
    # K tiles per split (at least one), then as many splits as that takes
    tiles = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(tiles, max(1, min(cfg["SPLIT_K"], tiles))) * block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    upcast = INTERPRET and x.dtype == torch.bfloat16  # exact: bf16 products fit in float32
    _skinny_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))](
        x,
        w,
        b,
        out,
        part,
        out,  # the scales' pointers: unused here (SCALED is off)
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        0,
        k_per_split,
        K_PER_SPLIT=k_per_split if INTERPRET else 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        DOT=dot,
        EVEN_K=k_per_split * split == k,
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl.dependent_kwargs(x),
    )
    if split > 1:
        split_k_reduce(part, out, bias)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``; on CUDA the skinny kernel takes bf16/fp16 inputs of at most
    ``SKINNY_MAX_M`` rows with a contiguous ``w`` (decode steps). Everything else, and the
    CPU always, is ``F.linear`` itself."""
    if (
        use_triton(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and w.dim() == 2
        and w.is_contiguous()
        and x.shape[-1] == w.shape[1]
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    ):
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if 0 < m <= SKINNY_MAX_M and x2.stride(1) == 1:
            n, k = w.shape
            cfg = skinny_config(n, k, m, _num_sms(x.device.index))
            if not cfg.get("cublas"):  # the tuner found cuBLAS faster at this shape
                return skinny_matmul_triton(x2, w, bias, cfg).view(*x.shape[:-1], n)
    return F.linear(x, w, bias)
