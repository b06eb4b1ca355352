"""The one-token int4 qkv projection with rotary and the KV-cache write in its epilogue: the
Gluon rows kernel (``kiln.kernels.wq_gluon``) whose programs each take BLOCK_N / 2 rows of
a head's first half and the matching rows of its second half, so that a program holds the
pairs rotary mixes. It rounds its sums to x's dtype (as the projection's output), rotates
the q and k heads in float32 as ``kiln.kernels.rotary`` does, and stores q into the rotated
q buffer and k and v into the token's cache slot: the rotary kernel's launch and its
re-read of qkv are gone from a batch-1 decode step.

Taken only where that path would run anyway, and where the epilogue needs no more than it
does: one token, a bfloat16 x and cache, an int4 projection without bias, smoothing or
act-order permutation on the rows kernel unsplit (the tuned configuration), no Hadamard
rotation, a head of whole tiles. Elsewhere ``qkv_rotary_kv`` returns None and the caller
runs the projection and ``rotary_write_kv``. ``KILN_QKV_ROPE=0`` turns it off.

Gluon does not run in Triton's interpreter: the CPU tests compile it for sm_90, the GPU
tests compare it with the projection followed by ``rotary_write_kv``."""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.errors import env_flag
from kiln.kernels import pdl
from kiln.kernels._triton import INTERPRET
from kiln.kernels.wq_f16 import F16Act
from kiln.kernels.wq_gluon import _gdc, _rows_sum, row_layout

ENABLED = env_flag(os.environ, "KILN_QKV_ROPE", True)


@gluon.jit
def _wq4_rows_rope_kernel(x_ptr, w_ptr, s_ptr, z_ptr, pos_ptr, cs_ptr, slot_ptr, q_ptr, kv_ptr,
                          stride_wn, stride_sn, stride_cs, stride_qh, stride_kind, stride_kb,
                          stride_kt, stride_kh, K, magic, HQ, HK, BS,
                          D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          GROUP: gl.constexpr, NW: gl.constexpr,
                          PDL: gl.constexpr = False):  # fmt: skip
    """Grid ((HQ + 2 HK) D / BLOCK_N,), one token. Program t takes head ``h = t BLOCK_N //
    D``; of its ``D / BLOCK_N`` tiles the ``u``-th: dimensions ``u P .. u P + P - 1`` of
    both halves (``P = BLOCK_N / 2``). x, w, scales and zeros as in ``_wq4_rows_kernel``;
    positions and slots (int64, one each), the (positions, D) float32 ``[cos | sin]``
    table, q out (HQ, D), the layer's cache (2, blocks, BS, HK, D), slot -1: no write.
    With ``PDL`` the position, its cos and sin, and the slot load before the wait with
    the first tile's weights (as in ``_wq4_rows_kernel``): the step's
    inputs, which no kernel of the step writes."""
    S2: gl.constexpr = gl.SliceLayout(2, row_layout(BLOCK_N, NW))
    P: gl.constexpr = BLOCK_N // 2
    HALF: gl.constexpr = D // 2
    if PDL:
        _gdc(False)
    row0 = gl.program_id(0) * BLOCK_N
    head = row0 // D
    u = (row0 % D) // BLOCK_N
    j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    rows = head * D + (j // P) * HALF + u * P + j % P
    pos = gl.load(pos_ptr)
    slot = gl.load(slot_ptr)
    # each row's cos and sin (the pairs' dimensions u P + j % P), before the wait: they are
    # the step's input, and loaded after the K loop they were one more round trip there
    csj = cs_ptr + pos * stride_cs + u * P + j % P
    cosj = gl.load(csj)
    sinj = gl.load(csj + HALF)
    y = _rows_sum(x_ptr, w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn, 0, K, magic, BLOCK_N,
                  BLOCK_K, GROUP, NW, PDL)  # fmt: skip
    ty: gl.constexpr = q_ptr.dtype.element_ty
    yr = y.to(ty).to(gl.float32)  # the projection's output, rounded as it stores it
    x1, x2 = gl.split(gl.permute(gl.reshape(yr, [2, P]), [1, 0]))  # (P,): first, second half
    d1 = u * P + gl.arange(0, P, layout=x1.type.layout)  # the pairs' dimensions
    if head < HQ + HK:  # q or k: rotated as kiln.kernels.rotary does
        cos, _c = gl.split(gl.permute(gl.reshape(cosj, [2, P]), [1, 0]))  # as x1: (P,)
        sin, _s = gl.split(gl.permute(gl.reshape(sinj, [2, P]), [1, 0]))
        a1 = (x1 * cos - x2 * sin).to(ty)
        a2 = (x2 * cos + x1 * sin).to(ty)
        if head < HQ:
            dst = q_ptr + head * stride_qh + d1
            gl.store(dst, a1)
            gl.store(dst + HALF, a2)
        elif slot >= 0:
            dst = kv_ptr + (slot // BS) * stride_kb + (slot % BS) * stride_kt
            dst += (head - HQ) * stride_kh + d1
            gl.store(dst, a1.to(kv_ptr.dtype.element_ty))
            gl.store(dst + HALF, a2.to(kv_ptr.dtype.element_ty))
    elif slot >= 0:  # v: copied unrotated
        dst = kv_ptr + stride_kind + (slot // BS) * stride_kb + (slot % BS) * stride_kt
        dst += (head - HQ - HK) * stride_kh + d1
        gl.store(dst, x1.to(kv_ptr.dtype.element_ty))
        gl.store(dst + HALF, x2.to(kv_ptr.dtype.element_ty))


def rope_config(
    lin: torch.nn.Module, x: torch.Tensor | F16Act, head_dim: int, config: dict | None = None
) -> dict | None:
    """The rows kernel's tuned configuration for ``lin`` (the qkv projection) at x's one
    row (``config``: this one instead) when the fused epilogue can take the call, else None
    (see the module docstring)."""
    from kiln.kernels.gemv import _num_sms
    from kiln.kernels.wq_config import wq_config

    if not ENABLED or INTERPRET or not isinstance(x, torch.Tensor) or not x.is_cuda:
        return None  # x prepared for the float16-code kernel (F16Act) goes there
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    if getattr(lin, "algo", None) != "int4-awq":
        return None
    n, k = lin.out_features, lin.in_features
    cfg = config or wq_config(n, k, 1, lin.group_size, _num_sms(x.device.index))
    return cfg if epilogue_fits(lin, x, head_dim, cfg) else None


def epilogue_fits(lin: torch.nn.Module, x: torch.Tensor | F16Act, head_dim: int, cfg: dict) -> bool:
    """Whether the fused kernel takes ``lin`` at ``x`` with the rows kernel's ``cfg``, on
    any device (``rope_config`` adds the GPU): one bfloat16 token, an int4 projection
    without the float16-code path, bias, smoothing or act-order permutation; a Gluon word
    configuration, unsplit, of an even row count that tiles the head; x's rows as int32
    pairs with chunks inside groups."""
    from kiln.kernels.wq_config import split_k_plan
    from kiln.kernels.wq_fma import words_ok

    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 1:
        return False
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        return False
    if getattr(lin, "algo", None) != "int4-awq" or getattr(lin, "f16_rows", 1):
        return False
    if lin.bias is not None or lin.smooth_active or lin.input_perm is not None:
        return False
    k, group = lin.in_features, lin.group_size
    if not (cfg.get("FMA") and cfg.get("WORDS") and cfg.get("GLUON")) or cfg.get("MMA"):
        return False
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if split_k_plan(k, bk, cfg["SPLIT_K"])[1] != 1 or bn % 2 or head_dim % bn:
        return False
    # rows_ok's conditions but the device's (x's words_ok: an even row stride and start)
    return group % 32 == 0 and bk % 32 == 0 and words_ok(x, k, min(bk, group), k % bk == 0, None)


def qkv_rotary_kv(
    lin: torch.nn.Module,
    x: torch.Tensor | F16Act,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    config: dict | None = None,
) -> torch.Tensor | None:
    """``rotary_write_kv(lin(x), ...)``'s rotated q (1, HQ, D), k and v written to the
    cache, in one launch; None (nothing done) where the fused kernel does not take the
    call. No fp8 cache, no Hadamard rotation, no fresh-k request: the caller checks.
    ``config``: a rows-kernel configuration in place of the tuned one (tests)."""
    cfg = rope_config(lin, x, head_dim, config)
    if cfg is None or kv_cache.dtype != x.dtype:  # rope_config: an even head of whole tiles
        return None
    if lin.out_features != (num_heads + 2 * num_kv_heads) * head_dim:
        return None
    if cos_sin.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        return None
    from kiln.kernels.wq_gemm import scale_arg

    q = torch.empty(1, num_heads, head_dim, dtype=x.dtype, device=x.device)
    w, scale = lin.weight, scale_arg(lin.weight_scale)
    bn = cfg["BLOCK_N"]
    _wq4_rows_rope_kernel[(lin.out_features // bn,)](
        x.view(torch.int32), w.view(torch.int32), scale, lin.weight_zero, positions, cos_sin,
        slot_mapping, q, kv_cache, w.stride(0) // 4, scale.stride(0), cos_sin.stride(0),
        q.stride(1), *kv_cache.stride()[:4], lin.in_features,
        0x43000000, num_heads, num_kv_heads, kv_cache.shape[2], D=head_dim, BLOCK_N=bn,
        BLOCK_K=cfg["BLOCK_K"], GROUP=lin.group_size, NW=cfg["num_warps"],
        num_warps=cfg["num_warps"], **pdl.dependent_kwargs(x),
    )  # fmt: skip
    return q
