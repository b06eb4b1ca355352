"""Rotary embedding fused with the paged KV-cache write: the Triton kernel against the torch
reference, and the reference against the unfused path it replaced (rotary, then write_kv).
On the CPU the kernel runs under the Triton interpreter (tests/conftest.py); on a GPU the
same tests run compiled, plus larger sizes. Tolerances as in tests/test_triton_kernels.py:
relative to the largest value, float32 1e-5, half precision 4 ulp."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.attention import cache_values, write_kv_ref
from kiln.kernels.rotary import (
    apply_rotary_ref,
    rotary_write_kv,
    rotary_write_kv_ref,
    rotary_write_kv_triton,
)
from kiln.layers.rotary import RotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# (T, Hq, Hk, D): single token, GQA 4:1, MQA, odd head dims (48, 80 pad to powers of two)
SHAPES = [(1, 4, 1, 64), (7, 8, 2, 48), (33, 4, 1, 128), (7, 12, 3, 80)]
if DEV == "cuda":
    SHAPES += [(257, 32, 8, 128), (4096, 32, 8, 128), (1000, 64, 8, 128), (3000, 28, 4, 80)]
_TABLES: dict[tuple[int, int, bool], torch.Tensor] = {}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max().clamp_min(1e-30)
    rel = float((a.float() - b.float()).abs().max() / scale)
    assert rel <= TOL[dtype], f"relative error {rel:.3e} > {TOL[dtype]:.1e}"


def _table(d: int, max_pos: int, llama3: bool = False) -> torch.Tensor:
    key = (d, max_pos, llama3)
    if key not in _TABLES:
        rot = RotaryEmbedding(
            d, max_pos, 500000.0 if llama3 else 10000.0, LLAMA3 if llama3 else None
        )
        _TABLES[key] = rot.cos_sin(torch.device(DEV))
    return _TABLES[key]


def _inputs(
    t: int,
    hq: int,
    hk: int,
    d: int,
    dtype: torch.dtype,
    max_pos: int = 4096,
    skip_every: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """Fresh random qkv, positions, a prefilled cache with spare blocks, and distinct
    scattered slots; every ``skip_every``-th slot is -1 (a padding token)."""
    bs = 16
    nblocks = -(-t // bs) + 5
    qkv = (torch.randn(t, (hq + 2 * hk) * d, device=DEV) * 2).to(dtype)
    pos = torch.randint(0, max_pos, (t,), device=DEV)
    cache = torch.randn(2, nblocks, bs, hk, d, device=DEV).to(cache_dtype or dtype)
    slots = torch.randperm(nblocks * bs, device=DEV)[:t]
    if skip_every:
        slots[1::skip_every] = -1
    return qkv, pos, cache, slots


def _check_cache(out: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, slots) -> None:
    """Written slots agree within tolerance; every other slot is bit-for-bit untouched."""
    flat, flat_ref, flat_before = (c.view(2, -1, *c.shape[3:]) for c in (out, ref, before))
    written = slots[slots >= 0]
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    assert torch.equal(flat_ref[:, untouched], flat_before[:, untouched])
    if written.numel():
        _close(flat[:, written], flat_ref[:, written], out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,hq,hk,d", SHAPES)
def test_kernel_matches_reference(dtype: torch.dtype, t: int, hq: int, hk: int, d: int) -> None:
    torch.manual_seed(t * 1000 + d)
    qkv, pos, cache, slots = _inputs(t, hq, hk, d, dtype, skip_every=3 if t > 1 else 0)
    cs = _table(d, 4096)
    before, cache_ref = cache.clone(), cache.clone()
    q = rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d)
    q_ref = rotary_write_kv_ref(qkv, pos, cs, cache_ref, slots, hq, hk, d)
    assert q.shape == (t, hq, d) and q.dtype == dtype
    _close(q, q_ref, dtype)
    _check_cache(cache, cache_ref, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_positions_llama3_table(dtype: torch.dtype) -> None:
    """Positions up to 100k in a llama3-scaled 128k table (Llama 3.1's rope)."""
    torch.manual_seed(5)
    t, hq, hk, d = 9, 8, 2, 128
    qkv, pos, cache, slots = _inputs(t, hq, hk, d, dtype, skip_every=4)
    pos = torch.randint(60_000, 100_000, (t,), device=DEV)
    pos[0] = 100_000
    cs = _table(d, 131072, llama3=True)
    before, cache_ref = cache.clone(), cache.clone()
    q = rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d)
    q_ref = rotary_write_kv_ref(qkv, pos, cs, cache_ref, slots, hq, hk, d)
    _close(q, q_ref, dtype)
    _check_cache(cache, cache_ref, before, slots)


def test_all_padding_tokens_write_nothing() -> None:
    torch.manual_seed(6)
    qkv, pos, cache, slots = _inputs(5, 4, 1, 64, torch.float32)
    slots[:] = -1
    before, cache_ref = cache.clone(), cache.clone()
    q = rotary_write_kv_triton(qkv, pos, _table(64, 4096), cache, slots, 4, 1, 64)
    q_ref = rotary_write_kv_ref(qkv, pos, _table(64, 4096), cache_ref, slots, 4, 1, 64)
    _close(q, q_ref, torch.float32)
    assert torch.equal(cache, before) and torch.equal(cache_ref, before)


def test_strided_rows_and_cache_dtype() -> None:
    """qkv rows that are views into a wider tensor; a bfloat16 cache under float32 qkv (the
    rotated k is rounded to qkv's dtype, then to the cache's, as write_kv_ref does)."""
    torch.manual_seed(7)
    t, hq, hk, d = 6, 4, 2, 48
    _, pos, cache, slots = _inputs(t, hq, hk, d, torch.float32, cache_dtype=torch.bfloat16)
    qkv = torch.randn(t, (hq + 2 * hk) * d + 40, device=DEV)[:, 16 : 16 + (hq + 2 * hk) * d]
    before, cache_ref = cache.clone(), cache.clone()
    q = rotary_write_kv_triton(qkv, pos, _table(d, 4096), cache, slots, hq, hk, d)
    q_ref = rotary_write_kv_ref(qkv, pos, _table(d, 4096), cache_ref, slots, hq, hk, d)
    _close(q, q_ref, torch.float32)
    _check_cache(cache, cache_ref, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 1, 64), (33, 8, 2, 80)])
def test_reference_equals_unfused_path(dtype: torch.dtype, t: int, hq: int, hk: int, d: int):
    """rotary_write_kv_ref is bit-for-bit the layer's former split + apply_rotary_ref +
    write_kv_ref; with -1 slots it equals the old path over the non-padding tokens."""
    torch.manual_seed(8)
    qkv, pos, cache, slots = _inputs(t, hq, hk, d, dtype)
    cs = _table(d, 4096)
    before, old = cache.clone(), cache.clone()
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    q, k = apply_rotary_ref(q, k, pos, cs)
    write_kv_ref(k, v, old, slots)
    q_new = rotary_write_kv_ref(qkv, pos, cs, cache, slots, hq, hk, d)
    assert torch.equal(q_new, q) and torch.equal(cache, old)
    if t > 1:
        slots[::2] = -1
        keep = slots >= 0
        new, old = before.clone(), before.clone()
        q_new = rotary_write_kv_ref(qkv, pos, cs, new, slots, hq, hk, d)
        write_kv_ref(k[keep], v[keep], old, slots[keep])
        assert torch.equal(q_new, q) and torch.equal(new, old)


def test_dispatcher() -> None:
    """The reference off CUDA (bit-identical), the kernel on CUDA (within tolerance)."""
    torch.manual_seed(9)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    qkv, pos, cache, slots = _inputs(17, 8, 2, 64, dtype, skip_every=5)
    cs = _table(64, 4096)
    before, cache_ref = cache.clone(), cache.clone()
    qkv_in = qkv.clone()  # the kernel overwrites qkv's k (fresh_k)
    q, fresh = rotary_write_kv(qkv, pos, cs, cache, slots, 8, 2, 64, fresh_k=True)
    assert fresh == (DEV == "cuda")  # only the kernel leaves the rotated k in qkv
    q_ref = rotary_write_kv_ref(qkv_in, pos, cs, cache_ref, slots, 8, 2, 64)
    if DEV == "cpu":
        assert torch.equal(q, q_ref) and torch.equal(cache, cache_ref)
    else:
        _close(q, q_ref, dtype)
        _check_cache(cache, cache_ref, before, slots)


_COMPILE = """
import json, re
from kiln.kernels import rotary
from tests.sm90 import compile_sm90

sig = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64",
       "q_out_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "r_ptr": "*bf16",
       "inv_sqrt_d": "fp32", "stride_t": "i32", "stride_cs": "i32", "stride_qo_t": "i32",
       "stride_qo_h": "i32", "stride_kind": "i64", "stride_kb": "i32", "stride_kt": "i32",
       "stride_kh": "i32", "T": "i32", "HQ": "i32", "HK": "i32", "BS": "i32"}
out = []
for rotate, block_r, part in ((True, 64, 2), (True, 16, 0), (False, 16, 0)):
    consts = dict(D=128, HALF=64, HALF_PAD=64, BLOCK_R=block_r, FP8=True, EMULATE_FP8=False,
                  ROTATE=rotate, UPCAST=False, PRECISION="tf32", PART=part, PDL=0)
    ir = compile_sm90(rotary._rotary_kv_kernel, sig, consts, 4,
                      divisible=("qkv_ptr", "q_out_ptr", "kv_ptr", "stride_t"))["ttgir"]
    layouts = dict(re.findall(r"^#(blocked\\d*) = #ttg.blocked<(.*)>$", ir, re.M))
    stores = re.findall(rf"tt.store .*tensor<{block_r}x64x!tt.ptr<f8E4M3FN>, #(blocked\\d*)>", ir)
    out.append([block_r, [layouts[s] for s in stores]])
print(json.dumps(out))
"""


def test_fp8_value_stores_run_along_tokens() -> None:
    """Without a GPU: compiled for sm_90, the fp8 cache's transposed value stores (a kv
    program's (BLOCK_R, D / 2) halves, BLOCK_R consecutive tokens of one kv head) put a
    warp's lanes on rows first (32 rows, or all 16 of a decode step's programs), one byte
    each, so that tokens in consecutive slots are written as consecutive bytes of their
    block (see ``test_kv_program_owns_one_heads_tokens``)."""
    from tests import sm90

    got = sm90.run(_COMPILE)
    assert len(got) == 3
    for block_r, layouts in got:
        rows = min(32, block_r)
        along_rows = f"sizePerThread = [1, 1], threadsPerWarp = [{rows}, {32 // rows}]"
        v = [lay for lay in layouts if along_rows in lay and "order = [0, 1]" in lay]
        assert len(v) == 2, layouts  # the two halves of v
        # any other store of that shape: an unrotated k's halves, contiguous along a row
        assert all("order = [1, 0]" in lay for lay in layouts if lay not in v), layouts


@pytest.mark.parametrize("rotate", [False, True])
def test_kv_program_owns_one_heads_tokens(rotate: bool) -> None:
    """A kv program writes one kv head of BLOCK_R consecutive tokens: the first program
    alone writes head 0 of tokens 0-15; the first ``tiles + 1`` write head 0 of every token
    and head 1 of tokens 0-15. (2026-12-02, H200: with (token, head) rows instead, a warp's
    value bytes fell in 8 heads' tiles, and the kv programs of a 16,384-token prompt took
    203 us against 160.)"""
    from kiln.kernels import rotary as rt
    from kiln.kernels.hadamard import hadamard_signs

    torch.manual_seed(3)
    t, hq, hk, d = 40, 4, 2, 32
    qkv, pos, cache, slots = _inputs(t, hq, hk, d, torch.float32, cache_dtype=torch.float8_e4m3fn)
    cs, s = _table(d, 4096), torch.tensor([0.05, 0.05], device=DEV)
    signs = hadamard_signs(d, DEV, torch.float32) if rotate else qkv
    q_out = torch.empty(t, hq, d, device=DEV)
    tiles = -(-t // 16)
    blk, off = slots // 16, slots % 16
    first = {(i, 0) for i in range(16)}
    head0_and_next = {(i, 0) for i in range(t)} | {(i, 1) for i in range(16)}
    for n, want in ((1, first), (tiles + 1, head0_and_next)):
        got = torch.zeros_like(cache)
        rt._launch((n,), 2, qkv, pos, cs, slots, q_out, got, s, signs, d, 16, True, rotate,
                   True)  # fmt: skip
        for part in (got[0], cache_values(got)):  # keys, and values in token order
            written = part.view(torch.uint8)[blk, off].ne(0).any(-1)  # (t, hk)
            assert {(i, h) for i, h in written.nonzero().tolist()} == want


@pytest.mark.parametrize(
    "dtype,rotate", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_fresh_k_left_in_qkv(dtype: torch.dtype, rotate: bool) -> None:
    """``fresh_k``: the kernel also writes the rotated k (rotary, then the Hadamard rotation
    when on) over qkv's k, in qkv's dtype, for the tokens with a cache slot, which prefill
    attention then reads in place of an fp8 cache; q, v and the cache are as without it."""
    from kiln.kernels.hadamard import hadamard_signs

    torch.manual_seed(71)
    t, hq, hk, d = 70, 4, 2, 64
    qkv, pos, cache, slots = _inputs(t, hq, hk, d, dtype, skip_every=7,
                                     cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    cs, s = _table(d, 4096), torch.tensor([0.05, 0.04], device=DEV)
    signs = hadamard_signs(d, DEV, dtype) if rotate else None
    plain_qkv, plain_cache = qkv.clone(), cache.clone()
    q_plain = rotary_write_kv_triton(plain_qkv, pos, cs, plain_cache, slots, hq, hk, d, s, signs)
    q = rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d, s, signs, fresh_k=True)
    assert torch.equal(q, q_plain)
    assert torch.equal(cache.view(torch.uint8), plain_cache.view(torch.uint8))
    q_size, kv_size = hq * d, hk * d
    assert torch.equal(qkv[:, :q_size], plain_qkv[:, :q_size])  # q and v columns untouched
    assert torch.equal(qkv[:, q_size + kv_size :], plain_qkv[:, q_size + kv_size :])
    # the expected k: the reference's, written into a cache of qkv's dtype
    ref_cache = torch.zeros(2, cache.shape[1], 16, hk, d, dtype=dtype, device=DEV)
    rotary_write_kv_ref(plain_qkv, pos, cs, ref_cache, slots, hq, hk, d, None, signs)
    keep = slots >= 0
    k = qkv[:, q_size : q_size + kv_size].view(t, hk, d)
    k_ref = ref_cache[0].view(-1, hk, d)[slots[keep]]
    _close(k[keep], k_ref, dtype)
    skipped = plain_qkv[:, q_size : q_size + kv_size].view(t, hk, d)[~keep]
    assert torch.equal(k[~keep], skipped)  # padding tokens' k left as it was
