"""Launch configurations of the weight-only kernels (``kiln.kernels.wq_gemm``): the
untuned heuristic, the engine's tuned lookup by projection shape and row count, and the
split-K plan the launcher and the tuner share."""

from __future__ import annotations

import os

import triton

from kiln.errors import env_flag, env_int
from kiln.kernels.tuning import tuned


def _group_tile(group: int) -> int:
    """The K tile of an int4 kernel: the largest power of two up to 128 dividing the group."""
    return min(128, group & -group)


MMA_MAX_M = 8  # tokens of one token tile of the tensor-core kernel: the n dimension of an mma
MMA_CHUNK = 128  # its codes per lane-quad per row: 4 lanes x 4 words x 8 codes
# Past 8 rows the kernel runs NT token tiles on the same weight fragments (9-16 rows, NT 2,
# on by default since the H200 runs of 2026-12-01: 16 sequences 4.37 ms a step against
# 6.27 without; scripts/experiments/int4_mma16.py), and past 8 NT rows blocks of 8 NT rows
# in adjacent programs. Up to ``MMA_ROWS`` rows (the fused kernels' limit, WQ_MAX_M["int4"]):
# the tl.dot kernel there before took 14.1 ms a step at 32 sequences, 3.7x its 16-sequence
# time (a layer's projections at 32 rows 0.388 ms against 0.147 now, bf16 0.132).
# KILN_WQ_MMA_ROWS=8 or 16 restores earlier limits.
MMA_ROWS = env_int(os.environ, "KILN_WQ_MMA_ROWS", 96, range(1, 97))  # WQ_MAX_M["int4"]
MMA_MAX_NT = 4
"""Token tiles a program takes by default, fewer where R x CH > 2: sm_90 registers (with
PDL; ``test_mma_kernel_compiles_for_sm90``) for R / CH / NT 1 / 2 / 4 178, 2 / 1 / 4 222,
2 / 2 / 2 196, 2 / 4 / 2 238, but 2 / 2 / 4 255 and a 32-byte stack; NT 8 (a
configuration's ``NT``) with one chunk a step 174 at R 1, 4 warps."""


ZSUB = env_flag(os.environ, "KILN_WQ_ZSUB", False)
"""Tuner candidates of the tensor-core kernel with the zero point subtracted from the codes
(``sub.bf16x2``, its ``ZS``) in place of the sum(x) ``mma`` (a third of its ``mma`` at R 2,
half at R 1). Off by default: measured on the H200 (2026-12-02, int4_many_rows.py) it
won by 2 % on gate_up and down at one row and lost or tied elsewhere, not worth the
longer build tuning; its GPU tests passed (test_mma_matches_reference)."""


def mma_rows() -> int:
    """The most rows the tensor-core kernel takes (``KILN_WQ_MMA_ROWS``, 96 by default)."""
    return MMA_ROWS


def mma_token_tiles(m: int, cap: int | None = None, r: int = 1, ch: int = 1) -> int:
    """Token tiles of eight a program of the tensor-core kernel takes at ``m`` rows: a power
    of two, at most ``cap`` (a configuration's ``NT``), else ``MMA_MAX_NT`` where R x CH
    is at most 2 and 2 where it is more (register room)."""
    cap = cap or (MMA_MAX_NT if r * ch <= 2 else 2)
    return min(cap, triton.next_power_of_2(triton.cdiv(max(m, 1), MMA_MAX_M)))


def mma_eligible(k: int, m: int, group: int | None) -> bool:
    """Whether the tensor-core few-row int4 kernel (``kiln.kernels.wq_mma``) can take the
    shape: at most ``mma_rows()`` rows, groups and K of whole 128-code chunks (the
    launcher checks the rest: a CUDA bfloat16 x without smoothing, else it takes
    ``wq_default_config(..., mma=False)``)."""
    return group is not None and m <= mma_rows() and group % MMA_CHUNK == 0 and k % MMA_CHUNK == 0


def mma_config(r: int, warps: int, split: int, ch: int = 2, pf: bool = False,
               nt: int | None = None, zs: bool = False) -> dict:  # fmt: skip
    """A configuration of the tensor-core kernel: R groups of 16 rows per program, its
    warps on alternate chunks of K, CH chunks a warp per iteration, PF the double buffer,
    ``nt`` the most token tiles a program takes (``MMA_MAX_NT`` if not given), ``zs`` the
    zero point off the codes (``ZSUB``). BLOCK_N and BLOCK_K (16 R, one chunk) are what the
    split-K plan and the tuner read."""
    cfg = {"MMA": True, "R": r, "BLOCK_N": 16 * r, "BLOCK_K": 128, "SPLIT_K": split,
           "CH": ch, "PF": pf, "num_warps": warps}  # fmt: skip
    return cfg | ({"NT": nt} if nt else {}) | ({"ZS": True} if zs else {})


def wq_default_config(n: int, k: int, m: int, group: int | None, num_sms: int = 132,
                      mma: bool = True) -> dict:  # fmt: skip
    """Up to 8 rows of int4 with groups of whole 128-code chunks (and ``mma``): the
    tensor-core kernel, 32 rows by 4 warps by 2 chunks, split-K to about 8 programs per SM
    (scripts/experiments/int4_mma.py: within 10 % of each Llama-3.1-8B projection's best);
    up to ``mma_rows()`` 32 rows by 2 warps, 2 chunks a step at 9-16 rows (NT 2), one past
    16 (NT 4: the tuner's pick for every Llama-3.1-8B projection at 32-128 rows,
    scripts/experiments/int4_many_rows.py), split-K likewise.
    Else a heuristic from the H200 sweeps (kiln.bench.quant_bench,
    scripts/experiments/int4_row_words.py, int4_row_gluon.py), for engines built without
    tuning. One row: int4 the 32-bit-word kernel (``WORDS``), in its Gluon form
    (``GLUON``: 8 columns by K tiles of 4,096, or 2,048 where K is no multiple of 4,096,
    2 warps, no split; int4_row_stream.py) where the group is a multiple of 32 and K of
    2,048, else 64 columns by K tiles of 512 where the group is a
    power of two up to 512 (else the largest power of two up to 128 dividing it);
    int8 the broadcast-multiply kernel (``FMA``), 16 columns by 512. More rows: tensor
    cores, int4 128 columns by K tiles of the largest power of two up to 128 dividing the
    group, int8 32 by 256. Split-K until there are about four programs per SM with at
    least two tiles each (int4 words: eight per SM, one tile each; int4 on tensor cores:
    sixteen, with at least four tiles each; scripts/experiments/int4_tc_asm.py)."""
    if mma and mma_eligible(k, m, group):
        ch, warps = (2, 4) if m <= MMA_MAX_M else (2, 2) if m <= 2 * MMA_MAX_M else (1, 2)
        blocks = triton.cdiv(m, MMA_MAX_M * mma_token_tiles(m, None, 2, ch))
        split, programs = 1, triton.cdiv(n, 32) * blocks
        while programs * split * 2 <= 8 * num_sms and split < 4 and k // (split * 2) >= 1024:
            split *= 2
        return mma_config(2, warps, split, ch)
    fma = m == 1
    words = fma and group is not None
    if words and group % 32 == 0 and k % 2048 == 0:  # the Gluon form (Triton's off the GPU)
        bk = 4096 if k % 4096 == 0 else 2048  # two chunks of 32 codes per thread where K allows
        return {"BLOCK_N": 8, "BLOCK_K": bk, "SPLIT_K": 1, "FMA": True, "WORDS": True,
                "GLUON": True, "num_warps": 2, "num_stages": 2}  # fmt: skip
    if words:  # tiles of whole groups where the group is a power of two up to 512
        whole = group == group & -group and group <= 512
        block_n, block_k = 64, 512 if whole else _group_tile(group)
    elif fma:
        block_n, block_k = 16, 512
    else:
        block_n, block_k = (128, _group_tile(group)) if group else (32, 256)
    # int4 on tensor cores: more, shorter splits (at least four tiles each) measured best
    tc4 = not fma and group is not None
    per_sm, min_tiles = (16, 4) if tc4 else (8, 1) if words else (4, 2)
    split, programs = 1, triton.cdiv(n, block_n)
    while programs * split * 2 <= per_sm * num_sms and k // (split * 2) >= min_tiles * block_k:
        split *= 2
    cfg = {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "FMA": fma,
           "num_warps": 4, "num_stages": 2 if fma else 3 if tc4 else 4}  # fmt: skip
    return cfg | {"WORDS": True} if words else cfg


def wq_shape_key(n: int, k: int, group: int | None) -> str:
    """tuning.json's key of a weight-only projection: ``int4g128:6144x4096``, ``int8:...``."""
    return f"{f'int4g{group}' if group else 'int8'}:{n}x{k}"


def wq_config(n: int, k: int, m: int, group: int | None, num_sms: int = 132) -> dict:
    """The active configuration: the engine's tuned one for the shape at the smallest tuned
    row count >= m (else the largest tuned), or the default."""
    by_m = tuned("weight_only")["by_shape"].get(wq_shape_key(n, k, group))
    if by_m:
        ms = sorted(int(r) for r in by_m)
        return by_m[str(next((r for r in ms if r >= m), ms[-1]))]
    return wq_default_config(n, k, m, group, num_sms)


def split_k_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K per split, number of splits) for a requested ``split_k``: whole tiles per split,
    at most one split per tile (so requests past the tile count collapse to it)."""
    tiles = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(tiles, max(1, min(split_k, tiles))) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)
