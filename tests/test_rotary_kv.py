"""Rotary embedding fused with the paged KV-cache write: the Triton kernel against the torch
reference, and the reference against the unfused path it replaced (rotary, then write_kv).
On the CPU the kernel runs under the Triton interpreter (tests/conftest.py); on a GPU the
same tests run compiled, plus larger sizes. Tolerances as in tests/test_triton_kernels.py:
relative to the largest value, float32 1e-5, half precision 4 ulp."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.attention import write_kv_ref
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
    q = rotary_write_kv(qkv, pos, cs, cache, slots, 8, 2, 64)
    q_ref = rotary_write_kv_ref(qkv, pos, cs, cache_ref, slots, 8, 2, 64)
    if DEV == "cpu":
        assert torch.equal(q, q_ref) and torch.equal(cache, cache_ref)
    else:
        _close(q, q_ref, dtype)
        _check_cache(cache, cache_ref, before, slots)
