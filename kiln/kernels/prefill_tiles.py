"""The key-tile loop of paged prefill attention (``kiln.kernels.prefill_attention``): a
tile's cache-block offsets, one tile folded into the online softmax (over a 16-bit or an
fp8 cache), and the loop over a range of tiles with its block-table lookups one iteration
ahead."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_offsets(bt_row, j, q_hi, stride_kb, BS: tl.constexpr, BLOCK_N: tl.constexpr,
               FRESH: tl.constexpr = False):  # fmt: skip
    """Key tile j's rows as (block offset ``block * stride_kb``, position in the block), both
    int64 (BLOCK_N,); positions past ``q_hi`` map to block 0. ``FRESH``: the keys are the
    step's own rows of a dense (T, Hk, D) tensor, the sequence's first at row ``bt_row``
    (an integer then) and ``stride_kb`` apart: (row of the tile's first key, n)."""
    n = tl.arange(0, BLOCK_N)
    start = j * BLOCK_N
    if FRESH:
        first = (bt_row + start).to(tl.int64) * stride_kb
        return first + tl.zeros([BLOCK_N], tl.int64), n.to(tl.int64)
    elif BS % BLOCK_N == 0:  # the tile lies in one cache block: one block-table lookup
        blk = tl.load(bt_row + start // BS, mask=start <= q_hi, other=0).to(tl.int64)
        return blk * stride_kb + tl.zeros([BLOCK_N], tl.int64), ((start % BS) + n).to(tl.int64)
    elif BLOCK_N % BS == 0:  # whole blocks: the offsets within them do not change
        # masked per block (a block whose first position is visible is read whole), so
        # that the compiler sees each block's offset constant over its BS rows and can
        # vectorize loads along the tokens (the transposed values of an fp8 cache)
        first = start + (n // BS) * BS
        blk = tl.load(bt_row + j * (BLOCK_N // BS) + n // BS, mask=first <= q_hi, other=0)
        return blk.to(tl.int64) * stride_kb, (n % BS).to(tl.int64)
    else:
        kpos = start + n
        blk = tl.load(bt_row + kpos // BS, mask=kpos <= q_hi, other=0).to(tl.int64)
        return blk * stride_kb, (kpos % BS).to(tl.int64)


@triton.jit
def _tile(
    q,
    acc,
    m_i,
    l_i,
    j,
    blk_off,
    in_blk,
    k_base,
    v_base,
    stride_kt,
    qpos,
    q_hi,
    qk_scale,
    window,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    FP8: tl.constexpr,
):
    """One key tile (positions j * BLOCK_N ..., in cache blocks at ``blk_off``, at
    ``in_blk`` within them) folded into the online softmax. An fp8 cache's values are
    transposed per (block, head): they are read as a (D_PAD, BLOCK_N) tile."""
    kpos = j * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, D_PAD)
    row = blk_off + in_blk * stride_kt
    ptrs = k_base + row[:, None] + dd[None, :]
    if FP8:
        col = blk_off + in_blk
        if BS % BLOCK_N == 0 or BLOCK_N % BS == 0:
            # runs of min(BS, BLOCK_N) consecutive tokens of one block, aligned (the
            # compiler cannot see it through the block-table lookup): 16-byte loads
            VEC: tl.constexpr = BS if BS < BLOCK_N else BLOCK_N
            col = tl.max_contiguous(tl.multiple_of(col, VEC), VEC)
        v_ptrs = v_base + col[None, :] + dd[:, None] * BS
    else:
        v_ptrs = v_base + row[:, None] + dd[None, :]
    if FP8:  # transposed values: a mask along the tokens would split the vector loads
        v = tl.load(v_ptrs, mask=(dd < D)[:, None], other=0.0) if D_PAD != D else tl.load(v_ptrs)
    if MASKED:  # also keeps unwritten (possibly non-finite) cache slots out of P @ V
        kv_mask = (kpos <= q_hi)[:, None] & (dd < D)[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        if not FP8:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif D_PAD != D:
        k = tl.load(ptrs, mask=(dd < D)[None, :], other=0.0)
        if not FP8:
            v = tl.load(v_ptrs, mask=(dd < D)[None, :], other=0.0)
    else:
        k = tl.load(ptrs)
        if not FP8:
            v = tl.load(v_ptrs)
    if FP8:  # e4m3 values are exact in any wider float; the scales are applied outside
        k = k.to(q.dtype)
        v = tl.trans(v).to(q.dtype)
        if MASKED:  # the masked positions' values (read from real blocks) are zeroed
            v = tl.where((kpos <= q_hi)[:, None], v, 0.0)
    if DOT_F32:  # the interpreter multiplies bfloat16 bit patterns as integers in tl.dot
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) float32
    if MASKED:
        ok = kpos[None, :] <= qpos[:, None]
        if HAS_WINDOW:
            ok = ok & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    # the scale (with log2 e) joins the subtraction in one FMA per score
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def tiles(
    q,
    acc,
    m_i,
    l_i,
    lo,
    hi,
    k_base,
    v_base,
    bt_row,
    stride_kb,
    stride_kt,
    qpos,
    q_hi,
    qk_scale,
    window,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    FP8: tl.constexpr,
    FRESH: tl.constexpr = False,
):
    """Key tiles lo .. hi - 1 (runtime bounds). The next tile's block-table lookup is issued
    one iteration ahead, so that the K/V loads do not wait on it. ``FRESH``: see
    ``kv_offsets`` (``stride_kt`` is then the dense tensor's row stride too)."""
    blk_off, in_blk = kv_offsets(bt_row, lo, q_hi, stride_kb, BS, BLOCK_N, FRESH)
    if FOR_LOOP:
        for j in range(lo, hi):
            blk_next, in_next = kv_offsets(bt_row, j + 1, q_hi, stride_kb, BS, BLOCK_N, FRESH)
            acc, m_i, l_i = _tile(
                q, acc, m_i, l_i, j, blk_off, in_blk, k_base, v_base, stride_kt, qpos, q_hi,
                qk_scale, window, D, D_PAD, BS, BLOCK_N, MASKED, HAS_WINDOW, PRECISION,
                DOT_F32, FP8,
            )  # fmt: skip
            blk_off, in_blk = blk_next, in_next
    else:
        j = lo
        while j < hi:
            blk_next, in_next = kv_offsets(bt_row, j + 1, q_hi, stride_kb, BS, BLOCK_N, FRESH)
            acc, m_i, l_i = _tile(
                q, acc, m_i, l_i, j, blk_off, in_blk, k_base, v_base, stride_kt, qpos, q_hi,
                qk_scale, window, D, D_PAD, BS, BLOCK_N, MASKED, HAS_WINDOW, PRECISION,
                DOT_F32, FP8,
            )  # fmt: skip
            blk_off, in_blk = blk_next, in_next
            j += 1
    return acc, m_i, l_i
