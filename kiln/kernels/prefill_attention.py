"""Paged prefill attention: causal flash attention of each sequence's new tokens over its
whole context in the block-table KV cache (the cached prefix and the tokens just written).

Grid: (query-head group, query tile, sequence). A program owns ``BLOCK_M`` rows, which are
``BLOCK_M // P`` consecutive new tokens times the ``P`` query heads that share one kv head
(token-major, so a tile's rows are contiguous in q), so every K/V tile it loads serves all
``P`` heads (GQA). It walks the sequence's keys in tiles of ``BLOCK_N`` positions, with an
online softmax in float32 (base 2); each tile's cache blocks are looked up in
``block_tables`` one iteration ahead, so that the pipelined K/V loads never wait on them.
Only the keys some row of the tile can see are visited: tiles wholly visible to every row
run unmasked, only the tiles on the causal diagonal (and on the sliding window's lower
edge) are masked. Query tiles are scheduled last-first, all heads of the longest rows
starting first, so that the short tiles fill the tail of the grid.

The key loop's bounds are loaded from memory. Compiled, that is a ``for`` loop the Triton
pipeliner overlaps with the loads; the Triton interpreter cannot take such a bound in
``range``, so there (``TRITON_INTERPRET=1``) the same body runs in a ``while`` loop.
Semantics: ``paged_attention_ref`` (same masking, same sliding window).

An fp8 (e4m3) cache (values transposed per block, see ``kiln.kernels.attention``): K/V
tiles are converted to the query dtype (exact; float16 for bfloat16 queries) before the
dots, the k scale joins ``qk_scale`` and the v scale the final normalization; both are
read from a device tensor. (fp8 tensor-core dots, with q and the probabilities rounded to
e4m3, were measured and not adopted: ``benchmarks/results/`` ``2026-12-01-h200-cpu-fp8-
prefill-dots.json``.) With ``fresh_kv`` (``FRESH``), whole prompts read the step's own keys
and values as computed, dense rows in q's dtype, instead of the cache (415.6 against
281.6 TFLOP/s over an fp8 cache at 8 x 2,048 on an H200). The key-tile loop lives in
``kiln.kernels.prefill_tiles``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels._triton import INTERPRET
from kiln.kernels.attention import KvScale, fp8_scales
from kiln.kernels.prefill_tiles import tiles


def _cfg(block_m: int, block_n: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


PREFILL_CONFIGS: list[dict[str, int]] = [
    _cfg(128, 64, 8, 3),
    _cfg(128, 64, 8, 4),
    _cfg(128, 128, 8, 2),
    _cfg(128, 32, 8, 4),
    _cfg(128, 64, 8, 2),
    _cfg(64, 64, 4, 3),
    _cfg(64, 64, 4, 4),
    _cfg(64, 32, 4, 3),
]
"""Candidate launch configurations (keyword arguments of ``prefill_attention_triton``) for
16-bit inputs with D <= 128, for a tuner to time on the device; the first is the default.
Compiled offline for sm_90 at D=128, none spills registers and all fit in shared memory."""
_SMALL_D_CONFIGS = [_cfg(128, 64, 4, 3), _cfg(128, 64, 4, 4)]  # spill at D=128, not at 64
_FP32_CONFIGS = [_cfg(16, 32, 4, 1), _cfg(32, 32, 4, 1), _cfg(64, 32, 4, 2)]
_D256_CONFIGS = [_cfg(128, 32, 8, 2), _cfg(64, 32, 4, 2)]


def prefill_config_candidates(
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16
) -> list[dict[str, int]]:
    """The configurations worth timing for this head size and dtype, the default first."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:  # full-precision dots run on the FMA units, never fast
        configs = _FP32_CONFIGS if d_pad >= 128 else _FP32_CONFIGS[::-1]
    elif d_pad > 128:
        configs = _D256_CONFIGS
    elif d_pad <= 64:
        configs = _SMALL_D_CONFIGS + PREFILL_CONFIGS
    else:
        configs = PREFILL_CONFIGS
    return [dict(c) for c in configs]


def _default_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    return prefill_config_candidates(head_dim, dtype)[0]


@triton.jit
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    bt_ptr,
    lens_ptr,
    qsl_ptr,
    rows_ptr,
    ks_ptr,
    kf_ptr,
    vf_ptr,
    stride_ft,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kind,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    qk_scale,
    window,
    G: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    FP8: tl.constexpr,
    FRESH: tl.constexpr = False,
):
    TM: tl.constexpr = BLOCK_M // P  # new tokens per tile
    hg = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest rows first
    s = tl.program_id(2)
    if HAS_ROWS:
        s = tl.load(rows_ptr + s)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    first = tile * TM
    if first >= q_len:
        return
    prefix = tl.load(lens_ptr + s) - q_len  # cached tokens before the new ones
    last = tl.minimum(first + TM, q_len) - 1
    q_lo = prefix + first  # position of the tile's first token
    q_hi = prefix + last  # and of its last (the padding rows repeat it)

    r = tl.arange(0, BLOCK_M)
    dd = tl.arange(0, D_PAD)
    tok = tl.minimum(first + r // P, last)
    head = hg * P + r % P
    row_ok = (r < TM * P) & (first + r // P <= last)
    qpos = prefix + tok
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + dd[None, :], mask=(dd < D)[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    hk = (hg * P) // G  # the program's kv head
    if FRESH:  # the prompt's own keys and values, rows q_start.. of (T, Hk, D) tensors
        k_base = kf_ptr + hk * D
        v_base = vf_ptr + hk * D
        bt_row = q_start
        stride_kb = stride_ft
        stride_kt = stride_ft
    else:
        if FP8:
            qk_scale = qk_scale * tl.load(ks_ptr)
            if q.dtype == tl.bfloat16:
                # as in decode attention: fp8 -> float16 is one packed instruction on
                # Hopper, fp8 -> bfloat16 is not, so the dots run in float16 (q clamped to
                # its range; p in [0, 1] loses nothing)
                q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        k_base = kv_ptr + hk * stride_kh
        # an fp8 cache's values are transposed per (block, head): head hk's (D, BS) tile at
        # hk * D * BS in the block
        v_base = kv_ptr + stride_kind + (hk * (D * BS) if FP8 else hk * stride_kh)
        bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    CACHE_FP8: tl.constexpr = FP8 and not FRESH
    # key tiles: [lo, full_lo) window edge (masked), [full_lo, full_hi) seen by every row
    # (unmasked), [full_hi, hi) causal diagonal (masked)
    hi = q_hi // BLOCK_N + 1
    if HAS_WINDOW:
        lo = tl.maximum(q_lo - window + 1, 0) // BLOCK_N
        full_lo = (tl.maximum(q_hi - window + 1, 0) + BLOCK_N - 1) // BLOCK_N
    else:
        lo = 0
        full_lo = 0
    full_hi = tl.maximum((q_lo + 1) // BLOCK_N, full_lo)

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: fully masked tiles give p = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if HAS_WINDOW:
        acc, m_i, l_i = tiles(
            q, acc, m_i, l_i, lo, full_lo, k_base, v_base, bt_row, stride_kb, stride_kt,
            qpos, q_hi, qk_scale, window, D, D_PAD, BS, BLOCK_N, True, HAS_WINDOW, PRECISION,
            DOT_F32, FOR_LOOP, CACHE_FP8, FRESH,
        )  # fmt: skip
    acc, m_i, l_i = tiles(
        q, acc, m_i, l_i, full_lo, full_hi, k_base, v_base, bt_row, stride_kb, stride_kt,
        qpos, q_hi, qk_scale, window, D, D_PAD, BS, BLOCK_N, False, HAS_WINDOW, PRECISION,
        DOT_F32, FOR_LOOP, CACHE_FP8, FRESH,
    )  # fmt: skip
    acc, m_i, l_i = tiles(
        q, acc, m_i, l_i, full_hi, hi, k_base, v_base, bt_row, stride_kb, stride_kt,
        qpos, q_hi, qk_scale, window, D, D_PAD, BS, BLOCK_N, True, HAS_WINDOW, PRECISION,
        DOT_F32, FOR_LOOP, CACHE_FP8, FRESH,
    )  # fmt: skip
    if CACHE_FP8:
        acc = acc * tl.load(ks_ptr + 1)
    o = acc / l_i[:, None]
    o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    mask = row_ok[:, None] & (dd < D)[None, :]
    tl.store(out_ptr + o_off + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


def _heads_per_program(g: int, block_m: int) -> int:
    """The most query heads of one kv head that one tile can hold (a divisor of G)."""
    return max(p for p in range(1, g + 1) if g % p == 0 and p <= block_m)


def prefill_attention_triton(
    q: torch.Tensor,  # (T, Hq, D): the step's queries
    kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32 context length (the new tokens included)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    out: torch.Tensor,  # (T, Hq, D), written at the rows of the sequences processed
    scale: float,
    max_query_len: int,  # most new tokens of any sequence processed
    sliding_window: int | None = None,
    rows: torch.Tensor | None = None,  # (R,) int32: the sequences to process; None: all
    *,
    BLOCK_M: int | None = None,  # launch configuration; None: the default for D, dtype
    BLOCK_N: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: KvScale = None,  # an fp8 cache's (k, v) scales
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Causal attention of the new tokens of the sequences in ``rows`` over their whole
    cached context, written into ``out``. Same result as ``paged_attention_ref``. q and out
    and the cache need unit stride in their last dim.

    ``fresh_kv``: the step's own (T, Hk, D) keys (rotated as q is) and values, in q's dtype;
    the sequences in ``rows`` must then have nothing cached before this step (a whole
    prompt): their keys and values are read from these instead of the cache, so an fp8
    cache's rounding does not enter a prompt's attention over itself, and the dots run in
    q's dtype with no conversion of the keys and values."""
    _, _, bs, hk, d = kv_cache.shape
    hq = q.shape[1]
    g = hq // hk
    assert hq == g * hk and q.shape[2] == d and kv_cache.stride(4) == 1 and q.stride(2) == 1
    assert out.stride(2) == 1
    cfg = _default_config(d, q.dtype)
    given = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": num_warps}
    cfg.update({k: v for k, v in (given | {"num_stages": num_stages}).items() if v is not None})
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0
    n_seqs = rows.shape[0] if rows is not None else seq_lens.shape[0]
    if n_seqs == 0 or max_query_len <= 0:
        return
    p = _heads_per_program(g, bm)
    assert triton.cdiv(max_query_len, bm // p) < 65536, "too many query tiles for grid dim 1"
    dot_f32 = INTERPRET and q.dtype == torch.bfloat16  # see _tile
    fp8 = fp8_scales(kv_cache, kv_scale)
    kf, vf = fresh_kv if fresh_kv is not None else (q, q)  # any pointers when unused
    if fresh_kv is not None:
        assert kf.dtype == vf.dtype == q.dtype and kf.shape == vf.shape == (q.shape[0], hk, d)
        assert kf.stride()[1:] == vf.stride()[1:] == (d, 1) and kf.stride(0) == vf.stride(0)
    grid = (hq // p, triton.cdiv(max_query_len, bm // p), n_seqs)
    _prefill_kernel[grid](
        q,
        kv_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        rows if rows is not None else seq_lens,
        fp8 if fp8 is not None else q,  # any pointer when unused
        kf,
        vf,
        kf.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        scale * math.log2(math.e),
        sliding_window or 0,
        G=g,
        P=p,
        D=d,
        D_PAD=max(16, triton.next_power_of_2(d)),
        BS=bs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_ROWS=rows is not None,
        HAS_WINDOW=sliding_window is not None,
        # float32 caches get full-precision dots (the default would round inputs to tf32)
        PRECISION="ieee" if q.dtype == torch.float32 or dot_f32 else "tf32",
        DOT_F32=dot_f32,
        FOR_LOOP=not INTERPRET,
        FP8=fp8 is not None,
        FRESH=fresh_kv is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
