"""Torch references of the hot ops against independent straightforward formulations, on
fresh random inputs with odd sizes. Tolerances: fp32 1e-5 relative unless stated."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.kernels.activation import silu_and_mul_ref
from kiln.kernels.attention import AttentionMetadata, paged_attention_ref, write_kv_ref
from kiln.kernels.rmsnorm import rms_norm_ref
from kiln.kernels.rotary import apply_rotary_ref
from kiln.layers.rotary import RotaryEmbedding, inv_frequencies


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    rel = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
    assert rel <= tol, f"relative error {rel:.3e} > {tol:.1e}"


@pytest.mark.parametrize("t,h", [(1, 8), (7, 769), (33, 5125)])
def test_rms_norm_with_and_without_residual(t: int, h: int) -> None:
    x, r, w = torch.randn(t, h), torch.randn(t, h), torch.randn(h)
    out, res = rms_norm_ref(x, w, 1e-5)
    assert res is None
    _close(out, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w, 1e-5)
    out, res = rms_norm_ref(x, w, 1e-6, residual=r)
    s = x + r
    _close(res, s, 0)
    _close(out, s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w, 1e-5)


@pytest.mark.parametrize("t,i", [(1, 1), (5, 771)])
def test_silu_and_mul(t: int, i: int) -> None:
    x = torch.randn(t, 2 * i)
    g, u = x[:, :i], x[:, i:]
    _close(silu_and_mul_ref(x), g / (1 + torch.exp(-g)) * u, 1e-5)


def test_rotary_matches_complex_rotation() -> None:
    """Half-split rotary == multiplying (x_j, x_{j+D/2}) as a complex number by e^{i pos f_j}."""
    t, hq, hk, d = 11, 5, 1, 18
    q, k = torch.randn(t, hq, d), torch.randn(t, hk, d)
    pos = torch.randint(0, 4000, (t,))
    rot = RotaryEmbedding(d, 4096, 10000.0, None)
    qr, kr = apply_rotary_ref(q, k, pos, rot.cos_sin(q.device))
    f = inv_frequencies(d, 10000.0, None).double()
    for x, xr in ((q, qr), (k, kr)):
        z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
        z = z * torch.exp(1j * pos.double()[:, None, None] * f)
        # fp32 angles pos * f lose ~pos * 6e-8 rad: 1e-4 covers positions up to 4096.
        _close(xr, torch.cat([z.real, z.imag], -1), 1e-4)


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    _close(inv_frequencies(128, 500000.0, scaling), ref, 1e-6)


def _dense_attention(q, k, v, q_pos, window=None):  # q (L,Hq,D), k/v (S,Hk,D)
    hq, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hk, 1)
    v = v.repeat_interleave(hq // hk, 1)
    s = torch.einsum("lhd,shd->hls", q.double(), k.double()) / math.sqrt(q.shape[-1])
    kp = torch.arange(k.shape[0])
    mask = kp[None, :] <= q_pos[:, None]
    if window:
        mask &= kp[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", s.softmax(-1), v.double())


@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_over_shuffled_blocks(window: int | None) -> None:
    """Three sequences in one step: a fresh prefill, a chunk over a cached prefix, a decode
    token, with their blocks scattered through the cache in random order."""
    torch.manual_seed(0)
    bs, hk, hq, d, nblocks = 4, 3, 6, 16, 40
    cache = torch.zeros(2, nblocks, bs, hk, d)
    perm = torch.randperm(nblocks).tolist()
    ctx, new = [13, 21, 9], [13, 5, 1]  # context after the step, tokens new this step
    tables, seqs_kv = [], []
    for c in ctx:
        n = -(-c // bs)
        tables.append([perm.pop() for _ in range(n)])
        seqs_kv.append((torch.randn(c, hk, d), torch.randn(c, hk, d)))
    # the cached (old) tokens are already in the cache
    for (k, v), table, c, n in zip(seqs_kv, tables, ctx, new, strict=True):
        old = torch.arange(c - n)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in old.tolist()], dtype=torch.long)
        write_kv_ref(k[: c - n], v[: c - n], cache, slots)
    q = torch.randn(sum(new), hq, d)
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    slots = [
        t[p // bs] * bs + p % bs
        for t, c, n in zip(tables, ctx, new, strict=True)
        for p in range(c - n, c)
    ]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc_cpu=starts,
        seq_lens_cpu=ctx,
    )
    new_k = torch.cat([k[c - n :] for (k, _), c, n in zip(seqs_kv, ctx, new, strict=True)])
    new_v = torch.cat([v[c - n :] for (_, v), c, n in zip(seqs_kv, ctx, new, strict=True)])
    write_kv_ref(new_k, new_v, cache, meta.slot_mapping)
    out = paged_attention_ref(q, cache, meta, d**-0.5, window)
    for i, ((k, v), c, n) in enumerate(zip(seqs_kv, ctx, new, strict=True)):
        ref = _dense_attention(q[starts[i] : starts[i + 1]], k, v, torch.arange(c - n, c), window)
        _close(out[starts[i] : starts[i + 1]], ref, 1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_batched_decode_rows_match_dense_attention(window: int | None) -> None:
    """Many single-token sequences in one step take the batched decode path."""
    torch.manual_seed(1)
    bs, hk, hq, d, nblocks = 4, 2, 6, 8, 64
    cache = torch.randn(2, nblocks, bs, hk, d)
    ctx = [1, 3, 4, 5, 17, 9, 30]
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = max(map(len, tables))
    n = len(ctx)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=ctx,
    )
    q = torch.randn(n, hq, d)
    out = paged_attention_ref(q, cache, meta, d**-0.5, window)
    for i, (c, t) in enumerate(zip(ctx, tables, strict=True)):
        k = cache[0, t].reshape(-1, hk, d)[:c]
        v = cache[1, t].reshape(-1, hk, d)[:c]
        ref = _dense_attention(q[i : i + 1], k, v, torch.tensor([c - 1]), window)
        _close(out[i : i + 1], ref, 1e-5)
